"""What every command shares: the consoles, user errors, the runs root, spec loading and run resolution.

`--site` and `--runs-root` are read here only, the same way for every command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from rich.console import Console

from vlaslurm.rundir import RunInfo, RunNotFound, resolve_run
from vlaslurm.spec import LoadedSpec, load_spec
from vlaslurm.spec.sites import selected_site_name, site_runs_root

USER_ERROR = 2
# Tables stay readable when piped (rich would squeeze them into 80 columns).
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

Command = Callable[[argparse.Namespace], int]
SITE_HELP = (
    "site profile: a name in ~/.config/vlaslurm/sites or vlaslurm/sites, or a file "
    "(default: $VLASLURM_SITE; 'none' for no site)"
)


class UserError(Exception):
    """An error the user can act on; printed without a traceback."""


def add_command(
    sub: argparse._SubParsersAction, name: str, func: Command, help_text: str, description: Optional[str] = None
) -> argparse.ArgumentParser:
    """A subcommand; every one takes `--site` (it may set the runs root, and it completes specs)."""
    p = sub.add_parser(name, help=help_text, description=description or help_text)
    p.set_defaults(func=func)
    p.add_argument("--site", help=SITE_HELP)
    return p


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="experiment spec (YAML)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")


def site_name(args: argparse.Namespace) -> Optional[str]:
    """The selected site profile: --site, else $VLASLURM_SITE (None: no site)."""
    return selected_site_name(getattr(args, "site", None))


def runs_root(args: argparse.Namespace) -> Path:
    """--runs-root, else $VLASLURM_RUNS_ROOT, else the site's runs_root, else ./runs."""
    explicit = getattr(args, "runs_root", None) or os.environ.get("VLASLURM_RUNS_ROOT")
    if explicit:
        return Path(explicit)
    return Path(site_runs_root(getattr(args, "site", None)) or "runs")


def load(args: argparse.Namespace, extra: Sequence[str] = ()) -> LoadedSpec:
    """The spec of `args` over the selected site profile, with its model checkpoint checked."""
    loaded = load_spec(args.spec, [*args.overrides, *extra], site=site_name(args))
    check_model_checkpoint(loaded)
    return loaded


def check_model_checkpoint(loaded: LoadedSpec) -> None:
    """A released checkpoint in `model.path` that the runtime would refuse (an `unnorm_key` it lacks, a missing
    head file, ...) is a spec error naming the field, before anything is planned or submitted.

    Only when the folder is there: `plan` may describe another machine's files (`run` and `submit` require the
    folder, `check_model_path`). It reads JSON files and file names, never weights.
    """
    path = loaded.spec.model.path
    if path is None or not os.path.isdir(os.path.expanduser(path)):
        return
    from vlaslurm.envs import known_action_dim, known_state_dim
    from vlaslurm.models.checkpoint import CheckpointError, check_checkpoint  # torch, only with a checkpoint

    try:
        env = loaded.spec.env
        action_dim, state_dim = known_action_dim(env), known_state_dim(env)
        check_checkpoint(loaded.spec.model, action_dim, env.obs.state, env.obs.image_size > 0, state_dim)
    except CheckpointError as exc:
        raise loaded.error(exc.field, exc.reason, suggestions=exc.suggestions) from None


def resolve(args: argparse.Namespace, ref: Optional[str] = None) -> RunInfo:
    """The run `args.run` names (a directory, name or job id)."""
    try:
        return resolve_run(runs_root(args), ref or args.run)
    except RunNotFound as exc:
        raise UserError(str(exc)) from None


def resolve_all(args: argparse.Namespace) -> List[RunInfo]:
    """The runs `args.run` names; a sweep name gives every run of the sweep."""
    from vlaslurm.slurm.sweep import resolve_runs

    try:
        return resolve_runs(runs_root(args), args.run)
    except RunNotFound as exc:
        raise UserError(str(exc)) from None
