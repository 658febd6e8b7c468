"""The `vlaslurm` command line: plan, submit and watch jobs, run locally, resume, compare, profile, clean.

User errors (bad specs, unknown runs, an unreachable Slurm) print one clear
message and exit with code 2; they never show a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

from rich import box
from rich.console import Console
from rich.table import Table

from vlaslurm.spec import SpecError, load_spec

USER_ERROR = 2
# Tables stay readable when piped (rich would squeeze them into 80 columns).
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class UserError(Exception):
    """An error the user can act on; printed without a traceback."""


def _runs_root(args: argparse.Namespace) -> Path:
    explicit = args.runs_root or os.environ.get("VLASLURM_RUNS_ROOT")
    if explicit:
        return Path(explicit)
    from vlaslurm.spec.sites import site_runs_root

    return Path(site_runs_root(getattr(args, "site", None)) or "runs")


def _load(args: argparse.Namespace, extra: List[str] = ()):
    """The spec of `args` over the selected site profile (--site, else $VLASLURM_SITE)."""
    from vlaslurm.spec.sites import selected_site_name

    return load_spec(args.spec, [*args.overrides, *extra], site=selected_site_name(args.site))


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the resolved spec summary and the script; submit nothing."""
    from vlaslurm.slurm.plan import build_plan
    from vlaslurm.slurm.submit import plan_script

    loaded = _load(args)
    if args.placement == "auto" or args.gpus:
        from vlaslurm.placement.commands import plan_auto

        return plan_auto(args, loaded, _runs_root(args), console)
    plan = build_plan(loaded)
    _print_plan(loaded, plan)
    from vlaslurm.spec.sites import describe

    for line in describe(loaded, plan):
        console.print(line, markup=False)
    console.print("[bold]sbatch script[/bold]")
    console.print(plan_script(loaded, _runs_root(args)), markup=False, soft_wrap=True)
    if args.test_only:
        from vlaslurm.slurm.submit import test_only

        console.print(test_only(loaded, _runs_root(args)).strip(), markup=False)
    return 0


def _print_plan(loaded, plan) -> None:
    spec = loaded.spec
    console.print(f"[bold]{spec.name}[/bold]  env={spec.env.type}  model={spec.model.type}  algo={spec.algo.type}  "
                  f"mode={spec.rollout.mode}  layout={plan.layout}  files={', '.join(map(str, loaded.files))}")
    table = Table("comp", "roles", "nodes", "partition", "GPUs/node", "CPUs/node", "mem", "constraint",
                  box=box.SIMPLE_HEAD, title="components (one per group of nodes)", title_justify="left")
    for c in plan.components:
        table.add_row(str(c.index), "+".join(c.roles), str(c.nodes), c.partition or "(default)",
                      str(c.gpus_per_node), str(c.cpus_per_node), c.mem or "-", c.constraint or "-")
    console.print(table)
    steps = Table("step", "het-group", "ranks", "tasks/node", "CPUs/task", "GPUs/node", "kind",
                  box=box.SIMPLE_HEAD, title="srun steps (parts per component joined by /)", title_justify="left")
    for s in plan.steps:
        steps.add_row(s.role, "/".join(map(str, s.het_groups)), str(s.ntasks),
                      "/".join(str(p.tasks_per_node) for p in s.parts), str(s.cpus_per_task),
                      "/".join(str(p.gpus_per_node) for p in s.parts), "overlap" if s.overlap else "exact")
    console.print(steps)


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit the spec as one hetjob."""
    from vlaslurm.slurm.submit import submit

    entry_args = _entry_args(args)
    if args.seeds or args.sweep:
        return _submit_sweep(args, entry_args)
    loaded = _load(args)
    sub = submit(loaded, _runs_root(args), Path(args.run_dir) if args.run_dir else None, entry_args=entry_args)
    console.print(f"submitted job [bold]{sub.job_id}[/bold]  run dir: {sub.run_dir}")
    console.print(f"watch it:  vlaslurm status {sub.job_id}   vlaslurm logs {sub.job_id} --follow")
    return 0


def _submit_sweep(args: argparse.Namespace, entry_args: List[str]) -> int:
    """One job per combination of --seeds and --sweep values, all under one sweep name."""
    from vlaslurm.slurm import sweep

    if args.run_dir:
        raise UserError("--run-dir names one run; a sweep makes one run directory per job")
    combos = sweep.combinations(sweep.parse_seeds(args.seeds) if args.seeds else None,
                                [sweep.parse_sweep(item) for item in args.sweep])
    specs = [_load(args, combo) for combo in combos]  # all validated before anything is submitted
    name = args.sweep_name or sweep.default_sweep_name(specs[0].spec.name)

    def report(index: int, sub) -> None:
        console.print(f"submitted job [bold]{sub.job_id}[/bold]  {' '.join(combos[index])}  run dir: {sub.run_dir}")

    subs = sweep.submit_sweep(specs, _runs_root(args), name, entry_args=entry_args, on_submit=report)
    console.print(f"sweep [bold]{name}[/bold]: {len(subs)} jobs")
    console.print(f"watch it:  vlaslurm status {name}   vlaslurm runs --sweep {name}   vlaslurm cancel {name}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run every role as local processes on this machine (no Slurm)."""
    from vlaslurm.runtime.local import run_local

    loaded = _load(args)
    return run_local(loaded, _runs_root(args), Path(args.run_dir) if args.run_dir else None,
                     extra_args=tuple(_entry_args(args)))


def _entry_args(args: argparse.Namespace) -> List[str]:
    """Arguments every rank's worker gets (`--absent` is a hidden hook for tests of a missing role)."""
    return (["--probe"] if args.probe else []) + (["--absent", args.absent] if args.absent else [])


def cmd_eval(args: argparse.Namespace) -> int:
    """Success per task of the frozen policy (no trainer); failed trajectories kept per task. A Slurm job
    unless --local; --show prints an earlier eval's table (SPEC is then its run: directory, name or job id)."""
    if args.show:
        return _print_eval(_eval_dir(args))
    from vlaslurm.runtime.evaluate import EvalConfig, check_every_task_played, evaluate

    loaded = _load(args)
    try:
        cfg = EvalConfig(args.episodes, args.keep_failed, deterministic=not args.sample)
        check_every_task_played(loaded.spec, cfg.episodes)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.local:
        return _print_eval(evaluate(loaded, _runs_root(args), cfg.episodes, cfg.keep_failed, cfg.deterministic))
    from vlaslurm.slurm.submit import submit

    sub = submit(loaded, _runs_root(args), entry_args=cfg.args(), kind="eval")
    console.print(f"submitted eval job [bold]{sub.job_id}[/bold]  run dir: {sub.run_dir}")
    if not args.wait:
        console.print(f"when it is done:  vlaslurm eval --show {sub.job_id}   (vlaslurm status {sub.job_id} meanwhile)")
        return 0
    try:
        state = _wait_for_job(sub.run_dir)
    except KeyboardInterrupt:
        raise UserError(f"stopped waiting; job {sub.job_id} goes on (vlaslurm eval --show {sub.job_id} once done)") from None
    if state != "COMPLETED":
        raise UserError(f"eval job {sub.job_id} ended {state}; see vlaslurm logs {sub.job_id}")
    return _print_eval(sub.run_dir)


def _wait_for_job(run_dir: Path, poll_s: float = 2.0) -> str:
    """Block until Slurm has ended the job (its time limit bounds this) and its exit record is written."""
    from vlaslurm.runtime.rundir import read_info
    from vlaslurm.runtime.status import run_state

    info = read_info(run_dir)
    not_ended = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"}  # as run_state says
    while (state := run_state(info)) in not_ended:
        time.sleep(poll_s)
    return state


def _eval_dir(args: argparse.Namespace) -> Path:
    """The directory of the eval run named by SPEC: a directory holding eval.json, or a run's name or job id."""
    from vlaslurm.runtime.rundir import RunNotFound, resolve_run

    if (Path(args.spec) / "eval.json").exists():
        return Path(args.spec)
    try:
        return Path(resolve_run(_runs_root(args), args.spec).run_dir)
    except RunNotFound as exc:
        raise UserError(str(exc)) from None


def _print_eval(directory: Path) -> int:
    import json

    from vlaslurm.runtime.evaluate import EVAL_FILE

    if not (directory / EVAL_FILE).exists():
        raise UserError(f"{directory} has no {EVAL_FILE} yet (see vlaslurm status {directory})")
    summary = json.loads((directory / EVAL_FILE).read_text())
    table = Table("task", "episodes", "success")
    for task, rate in summary["success"].items():
        table.add_row(task, str(summary["episodes_per_task"][task]), f"{rate:.2f}")
    console.print(table)
    console.print(f"eval dir: {directory} (failed trajectories in failed/)")
    return 0


def _resolve(args: argparse.Namespace):
    from vlaslurm.runtime.rundir import RunNotFound, resolve_run

    try:
        return resolve_run(_runs_root(args), args.run)
    except RunNotFound as exc:
        raise UserError(str(exc)) from None


def _resolve_all(args: argparse.Namespace):
    from vlaslurm.runtime.rundir import RunNotFound
    from vlaslurm.slurm.sweep import resolve_runs

    try:
        return resolve_runs(_runs_root(args), args.run)
    except RunNotFound as exc:
        raise UserError(str(exc)) from None


def cmd_status(args: argparse.Namespace) -> int:
    """Show a run's state, its steps' exit records and its roles' progress."""
    from vlaslurm.runtime.status import describe_run

    for index, info in enumerate(_resolve_all(args)):  # a sweep name: every run of the sweep
        console.print(("\n" if index else "") + describe_run(info), markup=False)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (or follow) a run's logs."""
    info = _resolve(args)
    files = _log_files(Path(info.run_dir), args.role, args.rank)
    if not files:
        raise UserError(f"no logs yet under {info.run_dir}/logs" + (f" for role {args.role}" if args.role else ""))
    for path in files:
        console.print(f"[bold]==> {path.relative_to(info.run_dir)} <==[/bold]")
        sys.stdout.write(path.read_text(errors="replace"))
    if args.follow:
        _follow(files)
    return 0


def _log_files(run_dir: Path, role: Optional[str], rank: Optional[int]) -> List[Path]:
    logs = run_dir / "logs"
    pattern = f"{role or '*'}/{rank if rank is not None else '*'}.log"
    files = sorted(logs.glob(pattern))
    if role is None and rank is None:
        files = sorted(logs.glob("batch-*.log")) + files
    return files


def _follow(files: List[Path]) -> None:
    offsets = {p: p.stat().st_size for p in files}
    try:
        while True:
            for path in files:
                size = path.stat().st_size
                if size > offsets[path]:
                    with path.open(errors="replace") as handle:
                        handle.seek(offsets[path])
                        sys.stdout.write(handle.read())
                    offsets[path] = size
            sys.stdout.flush()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass


def cmd_resume(args: argparse.Namespace) -> int:
    """Start a stopped run again in its run directory; the trainer continues from the newest checkpoint."""
    from vlaslurm.runtime import checkpoint
    from vlaslurm.runtime.status import run_state

    info = _resolve(args)
    newest = checkpoint.latest(Path(info.run_dir))
    if newest is None:
        raise UserError(f"run {info.run_dir} has no checkpoint (checkpoints/v*) to resume from; start a new run")
    state = run_state(info)
    if state in ("RUNNING", "PENDING", "COMPLETED"):
        raise UserError(f"run {info.run_dir} is {state}; only a stopped run can be resumed")
    console.print(f"resuming {info.run_dir} from {newest.name}")
    if args.local or info.kind == "local":
        from vlaslurm.runtime.local import resume_local

        return resume_local(info)
    from vlaslurm.slurm.submit import resubmit

    sub = resubmit(info, _runs_root(args))
    console.print(f"submitted job [bold]{sub.job_id}[/bold]  run dir: {sub.run_dir}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a run's job."""
    from vlaslurm.slurm.submit import cancel

    runs = _resolve_all(args)  # a sweep name: every run of the sweep
    if len(runs) == 1 and not runs[0].job_id:
        raise UserError(f"run {runs[0].run_dir} is a local run; stop it with Ctrl-C where it runs")
    for info in runs:
        if info.job_id:
            cancel(info.job_id)
            console.print(f"cancelled job {info.job_id}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """List runs under the runs root."""
    from vlaslurm.runtime.rundir import list_runs
    from vlaslurm.runtime.status import run_state

    table = Table("name", "job", "kind", "state", "sweep", "created", "run dir")
    for info in list_runs(_runs_root(args)):
        if (args.name and info.name != args.name) or (args.sweep and info.sweep != args.sweep):
            continue
        state = run_state(info)
        if args.state and not state.upper().startswith(args.state.upper()):
            continue
        table.add_row(info.name, info.job_id or "-", info.kind, state, info.sweep or "-",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(info.created)), info.run_dir)
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlaslurm", description=__doc__.splitlines()[0])
    parser.add_argument("--runs-root", help="folder of run directories (default: $VLASLURM_RUNS_ROOT or ./runs)")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", help="experiment spec (YAML)")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        p.add_argument("--site", help="site profile: a name in ~/.config/vlaslurm/sites or vlaslurm/sites, or a "
                                      "file (default: $VLASLURM_SITE; 'none' for no site)")

    p = add("plan", cmd_plan, "show the resolved plan and sbatch script; submit nothing")
    spec_args(p)
    p.add_argument("--test-only", action="store_true", help="also ask Slurm (sbatch --test-only) if it would run")
    from vlaslurm.placement.commands import add_plan_options, register as register_placement

    add_plan_options(p)
    for name, func, text in (("submit", cmd_submit, "submit the spec as one heterogeneous Slurm job"),
                             ("run", cmd_run, "run every role as local processes on this machine")):
        p = add(name, func, text)
        spec_args(p)
        p.add_argument("--run-dir", help="use this run directory instead of a new one under the runs root")
        p.add_argument("--probe", action="store_true", help="run the connectivity probe instead of training")
        p.add_argument("--absent", help=argparse.SUPPRESS)  # tests: this role exits before meeting
        if name == "submit":
            p.add_argument("--seeds", help="one job per seed (rollout.seed), e.g. 0,1,2 or 0-4; grouped as a sweep")
            p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                           help="one job per value (repeat for a cartesian product); grouped as a sweep")
            p.add_argument("--sweep-name", help="name of the sweep (default: <spec name>-sweep-<date>-<time>)")
    for name, func, text in (("status", cmd_status, "show a run's state"),
                             ("cancel", cmd_cancel, "cancel a run's Slurm job")):
        add(name, func, text).add_argument("run", help="run directory, run name, job id or sweep name (all its runs)")
    p = add("eval", cmd_eval, "success per task of the frozen policy, without a trainer (a Slurm job unless --local)")
    spec_args(p)
    p.add_argument("--episodes", type=int, default=100, help="episodes to run in all, over every task (default 100)")
    p.add_argument("--keep-failed", type=int, default=3, help="failed trajectories kept per task (default 3)")
    p.add_argument("--sample", action="store_true", help="sample actions (seeded per episode and step) instead of "
                                                          "taking the policy's mean")
    p.add_argument("--local", action="store_true", help="run in this process instead of a Slurm job")
    p.add_argument("--wait", action="store_true", help="block until the job ends, then print its table")
    p.add_argument("--show", action="store_true", help="SPEC names an eval run instead (directory, name or job id): "
                                                        "print its table")
    p = add("resume", cmd_resume, "continue a stopped run from its newest checkpoint")
    p.add_argument("run", help="run directory, run name or job id")
    p.add_argument("--local", action="store_true", help="run every role as local processes (default: as the run ran)")
    p = add("logs", cmd_logs, "print a run's logs")
    p.add_argument("run", help="run directory, run name or job id")
    p.add_argument("--role", choices=["simulator", "generator", "trainer"])
    p.add_argument("--rank", type=int)
    p.add_argument("--follow", "-f", action="store_true")
    p = add("runs", cmd_runs, "list runs")
    p.add_argument("--name", help="only runs of this name")
    p.add_argument("--sweep", help="only runs of this sweep")
    p.add_argument("--state", help="only runs in this state (RUNNING, PENDING, COMPLETED, FAILED, CANCELLED, ...)")
    from vlaslurm.runtime.clean import register as register_clean

    register_clean(sub)
    from vlaslurm.tracking.compare import register as register_compare

    register_compare(sub)
    register_placement(sub)
    from vlaslurm.envs.preflight import register as register_doctor

    register_doctor(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from vlaslurm.slurm.cluster import SlurmUnavailable
    from vlaslurm.slurm.render import RenderError

    try:
        return args.func(args)
    except (SpecError, UserError, SlurmUnavailable, RenderError, FileExistsError) as exc:
        err_console.print("[red]error:[/red] ", end="")
        err_console.print(str(exc), markup=False)
        return USER_ERROR


if __name__ == "__main__":
    # `python -m vlaslurm.cli`: modules that import vlaslurm.cli (clean, compare) must get this module, so that
    # the UserError they raise is the one main() catches
    sys.modules.setdefault("vlaslurm.cli", sys.modules[__name__])
    sys.exit(main())
