"""`vlaslurm doctor SPEC`: does the spec's simulator import and render one frame on this machine?"""

from __future__ import annotations

import argparse

from vlaslurm.cli.common import add_command, add_spec_args, load
from vlaslurm.envs.preflight import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, run


def cmd_doctor(args: argparse.Namespace) -> int:
    report = run(load(args).spec, args.timeout)
    print(report.text())
    return 0 if report.ok else 1


def register(sub) -> None:
    p = add_command(
        sub, "doctor", cmd_doctor, "check that the spec's simulator imports and renders one frame on this machine"
    )
    add_spec_args(p)
    p.add_argument(
        "--timeout", type=float, help=f"seconds the probe may take (default ${TIMEOUT_ENV} or {DEFAULT_TIMEOUT_S:g})"
    )
