"""The `vlaslurm` command line: plan, submit and watch jobs, run locally, resume, compare, profile, clean.

User errors (bad specs, unknown runs, a damaged run directory, an unreachable Slurm) print one clear
message and exit with code 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from vlaslurm.cli import clean, compare, doctor, evaluate, launch, placement, runs
from vlaslurm.cli.common import USER_ERROR, UserError, err_console
from vlaslurm.rundir import DamagedRunDir
from vlaslurm.spec import SpecError

COMMAND_GROUPS = (launch, evaluate, runs, clean, compare, placement, doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlaslurm", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs-root", help="folder of run directories (default: $VLASLURM_RUNS_ROOT or ./runs)")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from vlaslurm.slurm.cluster import SlurmUnavailable
    from vlaslurm.slurm.render import RenderError

    try:
        return args.func(args)
    except (SpecError, UserError, DamagedRunDir, SlurmUnavailable, RenderError, FileExistsError) as exc:
        err_console.print("[red]error:[/red] ", end="")
        err_console.print(str(exc), markup=False)
        return USER_ERROR


__all__ = ["USER_ERROR", "UserError", "build_parser", "main"]
