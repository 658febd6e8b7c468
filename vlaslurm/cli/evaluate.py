"""`vlaslurm eval`: success per task of the frozen policy, without a trainer (a Slurm job unless --local)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.table import Table

from vlaslurm.cli.common import UserError, add_command, add_spec_args, console, load, runs_root
from vlaslurm.rundir import RunDir, RunNotFound, read_eval, read_info, resolve_run


def cmd_eval(args: argparse.Namespace) -> int:
    """Success per task of the frozen policy (no trainer); failed trajectories kept per task. A Slurm job
    unless --local; --show prints an earlier eval's table (SPEC is then its run: directory, name or job id)."""
    if args.show:
        return print_eval(_eval_dir(args))
    from vlaslurm.runtime.evaluate import EvalConfig, check_every_task_played, evaluate

    loaded = load(args)
    try:
        cfg = EvalConfig(args.episodes, args.keep_failed, deterministic=not args.sample)
        check_every_task_played(loaded.spec, cfg.episodes)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.local:
        return print_eval(evaluate(loaded, runs_root(args), cfg.episodes, cfg.keep_failed, cfg.deterministic))
    from vlaslurm.placement.choose import resolve_auto
    from vlaslurm.slurm.submit import submit

    sub = submit(resolve_auto(loaded, runs_root(args)), runs_root(args), entry_args=cfg.args(), kind="eval")
    console.print(f"submitted eval job [bold]{sub.job_id}[/bold]  run dir: {sub.run_dir}")
    if not args.wait:
        console.print(f"when it is done:  vlaslurm eval --show {sub.job_id}   (vlaslurm status {sub.job_id} meanwhile)")
        return 0
    try:
        state = wait_for_job(sub.run_dir)
    except KeyboardInterrupt:
        raise UserError(
            f"stopped waiting; job {sub.job_id} goes on (vlaslurm eval --show {sub.job_id} once done)"
        ) from None
    if state != "COMPLETED":
        raise UserError(f"eval job {sub.job_id} ended {state}; see vlaslurm logs {sub.job_id}")
    return print_eval(sub.run_dir)


def wait_for_job(run_dir: Path, poll_s: float = 2.0) -> str:
    """Block until Slurm has ended the job (its time limit bounds this) and its exit record is written."""
    from vlaslurm.slurm.state import is_active, run_state

    info = read_info(run_dir)
    while is_active(state := run_state(info)):
        time.sleep(poll_s)
    return state


def _eval_dir(args: argparse.Namespace) -> Path:
    """The directory of the eval run named by SPEC: a directory holding its result (`RunDir.eval`), or a run's
    name or job id."""
    if RunDir(args.spec).eval.exists():
        return Path(args.spec)
    try:
        return Path(resolve_run(runs_root(args), args.spec).run_dir)
    except RunNotFound as exc:
        raise UserError(str(exc)) from None


def print_eval(directory: Path) -> int:
    summary = read_eval(directory)
    if summary is None:
        name = RunDir(directory).eval.name
        raise UserError(f"{directory} has no {name} yet (see vlaslurm status {directory})")
    table = Table("task", "episodes", "success")
    for task, rate in summary["success"].items():
        table.add_row(task, str(summary["episodes_per_task"][task]), f"{rate:.2f}")
    console.print(table)
    console.print(f"eval dir: {directory} (failed trajectories in failed/)")
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "eval", cmd_eval, "success per task of the frozen policy, without a trainer (a Slurm job unless --local)"
    )
    add_spec_args(p)
    p.add_argument("--episodes", type=int, default=100, help="episodes to run in all, over every task (default 100)")
    p.add_argument("--keep-failed", type=int, default=3, help="failed trajectories kept per task (default 3)")
    p.add_argument(
        "--sample",
        action="store_true",
        help="sample actions (seeded per episode and step) instead of taking the policy's mean",
    )
    p.add_argument("--local", action="store_true", help="run in this process instead of a Slurm job")
    p.add_argument("--wait", action="store_true", help="block until the job ends, then print its table")
    p.add_argument(
        "--show",
        action="store_true",
        help="SPEC names an eval run instead (directory, name or job id): print its table",
    )
