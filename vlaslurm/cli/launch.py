"""`vlaslurm plan`, `submit`, `run`, `resume` and `cancel`: from a spec to a running job, and back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

from rich import box
from rich.table import Table

from vlaslurm.cli.common import UserError, add_command, add_spec_args, console, load, resolve, resolve_all, runs_root
from vlaslurm.rundir import RunInfo
from vlaslurm.spec import LoadedSpec
from vlaslurm.spec.plan import HetjobPlan, build_plan


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the resolved spec summary and the script; submit nothing."""
    from vlaslurm.slurm.submit import plan_script
    from vlaslurm.spec.sites import describe

    loaded = load(args)
    if args.placement == "auto" or args.gpus:
        from vlaslurm.cli.placement import plan_auto

        return plan_auto(args, loaded, runs_root(args))
    plan = build_plan(loaded)
    print_plan(loaded, plan)
    print_resolved(loaded)
    for line in describe(loaded, plan):
        console.print(line, markup=False)
    console.print("[bold]sbatch script[/bold]")
    console.print(plan_script(loaded, runs_root(args)), markup=False, soft_wrap=True)
    if args.test_only:
        from vlaslurm.slurm.submit import test_only

        console.print(test_only(loaded, runs_root(args)).strip(), markup=False)
    return 0


RESOLVED_SECTIONS = ("algo", "trainer", "rollout")  # what users tune most, with every default filled in


def print_resolved(loaded: LoadedSpec) -> None:
    """The sections that decide what is learned and how, as the runtime will read them (defaults included)."""
    import yaml

    resolved = loaded.to_dict()
    text = yaml.safe_dump({k: resolved[k] for k in RESOLVED_SECTIONS}, sort_keys=False, default_flow_style=None)
    console.print("[bold]resolved " + ", ".join(RESOLVED_SECTIONS) + "[/bold] (defaults filled in)")
    console.print(text.rstrip(), markup=False, soft_wrap=True)


def print_plan(loaded: LoadedSpec, plan: HetjobPlan) -> None:
    spec = loaded.spec
    console.print(
        f"[bold]{spec.name}[/bold]  env={spec.env.type}  model={spec.model.type}  algo={spec.algo.type}  "
        f"mode={spec.rollout.mode}  layout={plan.layout}  files={', '.join(map(str, loaded.files))}"
    )
    table = Table(
        "comp",
        "roles",
        "nodes",
        "partition",
        "GPUs/node",
        "CPUs/node",
        "mem",
        "constraint",
        box=box.SIMPLE_HEAD,
        title="components (one per group of nodes)",
        title_justify="left",
    )
    for c in plan.components:
        table.add_row(
            str(c.index),
            "+".join(c.roles),
            str(c.nodes),
            c.partition or "(default)",
            str(c.gpus_per_node),
            str(c.cpus_per_node),
            c.mem or "-",
            c.constraint or "-",
        )
    console.print(table)
    steps = Table(
        "step",
        "het-group",
        "ranks",
        "tasks/node",
        "CPUs/task",
        "GPUs/node",
        "kind",
        "restarts",
        box=box.SIMPLE_HEAD,
        title="srun steps (parts per component joined by /)",
        title_justify="left",
    )
    for s in plan.steps:
        steps.add_row(
            s.role,
            "/".join(map(str, s.het_groups)),
            str(s.ntasks),
            "/".join(str(p.tasks_per_node) for p in s.parts),
            str(s.cpus_per_task),
            "/".join(str(p.gpus_per_node) for p in s.parts),
            "overlap" if s.overlap else "exact",
            str(spec.max_restarts(s.role)),  # resources.<role>.max_restarts, the role's default resolved
        )
    console.print(steps)


def placed(loaded: LoadedSpec, args: argparse.Namespace) -> LoadedSpec:
    """The spec with its placement chosen (profiling first if none is cached) for `placement: auto`."""
    from vlaslurm.placement.choose import resolve_auto
    from vlaslurm.placement.profile import cached_profile

    root = runs_root(args)
    if loaded.spec.resources.placement == "auto" and cached_profile(loaded, root, False) is None:
        console.print(
            f"resources.placement is auto and no profile of {loaded.spec.name} is cached: running the "
            "profiling job through Slurm first (about a minute of measurements), then choosing.",
            markup=False,
        )
    return resolve_auto(loaded, root)


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit the spec as one hetjob."""
    from vlaslurm.slurm.submit import submit

    entry_args = _entry_args(args)
    if args.seeds or args.sweep:
        if args.follow:
            raise UserError("--follow follows one job; watch a sweep with: vlaslurm runs --sweep NAME")
        return _submit_sweep(args, entry_args)
    loaded = placed(load(args), args)
    sub = submit(loaded, runs_root(args), Path(args.run_dir) if args.run_dir else None, entry_args=entry_args)
    console.print(f"submitted job [bold]{sub.job_id}[/bold]  run dir: {sub.run_dir}")
    if args.follow:
        from vlaslurm.cli.progress import follow_job

        return follow_job(console, Path(sub.run_dir), loaded.spec.rollout.total_env_steps, loaded.spec.tracking.uri)
    console.print(f"watch it:  vlaslurm status {sub.job_id}   vlaslurm logs {sub.job_id} --follow")
    return 0


def _submit_sweep(args: argparse.Namespace, entry_args: List[str]) -> int:
    """One job per combination of --seeds and --sweep values, all under one sweep name."""
    from vlaslurm.slurm import sweep

    if args.run_dir:
        raise UserError("--run-dir names one run; a sweep makes one run directory per job")
    combos = sweep.combinations(
        sweep.parse_seeds(args.seeds) if args.seeds else None, [sweep.parse_sweep(item) for item in args.sweep]
    )
    specs = [load(args, combo) for combo in combos]  # all validated before anything is submitted
    specs = [placed(loaded, args) for loaded in specs]
    name = args.sweep_name or sweep.default_sweep_name(specs[0].spec.name)

    def report(index: int, sub) -> None:
        console.print(f"submitted job [bold]{sub.job_id}[/bold]  {' '.join(combos[index])}  run dir: {sub.run_dir}")

    subs = sweep.submit_sweep(specs, runs_root(args), name, entry_args=entry_args, on_submit=report)
    console.print(f"sweep [bold]{name}[/bold]: {len(subs)} jobs")
    console.print(f"watch it:  vlaslurm status {name}   vlaslurm runs --sweep {name}   vlaslurm cancel {name}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run every role as local processes on this machine (no Slurm), showing its progress."""
    from vlaslurm.cli.progress import Display, local_outcome
    from vlaslurm.runtime.local import run_local

    loaded = load(args)
    run_dir = Path(args.run_dir) if args.run_dir else None
    extra_args = tuple(_entry_args(args))
    if extra_args:  # a probe or a test of a missing role: no training to show
        return run_local(loaded, runs_root(args), run_dir, extra_args=extra_args)
    display = Display.choose(console, loaded.spec.rollout.total_env_steps, echoed=True)
    with display:  # off a terminal the launcher echoes trainer rank 0's progress lines itself
        code = run_local(loaded, runs_root(args), run_dir, echo=not display.live, on_tick=display.tick)
    display.summary(local_outcome(code), loaded.spec.tracking.uri)
    return code


def _entry_args(args: argparse.Namespace) -> List[str]:
    """Arguments every rank's worker gets (`--absent` is a hidden hook for tests of a missing role)."""
    return (["--probe"] if args.probe else []) + (["--absent", args.absent] if args.absent else [])


def cmd_resume(args: argparse.Namespace) -> int:
    """Start a stopped run again in its run directory; the trainer continues from the newest checkpoint."""
    from vlaslurm.rundir import read_resolved_spec
    from vlaslurm.runtime import checkpoint
    from vlaslurm.slurm.state import run_state

    info = resolve(args)
    newest = checkpoint.latest(Path(info.run_dir))
    if newest is None:
        raise UserError(f"run {info.run_dir} has no checkpoint (checkpoints/v*) to resume from; start a new run")
    state = run_state(info)
    if state in ("RUNNING", "PENDING", "COMPLETED"):
        raise UserError(f"run {info.run_dir} is {state}; only a stopped run can be resumed")
    read_resolved_spec(Path(info.run_dir))  # a damaged spec stops here, before any rank starts
    if args.overrides:
        change_for_resume(info, args.overrides)
    console.print(f"resuming {info.run_dir} from {newest.name}")
    if args.local or info.kind == "local":
        from vlaslurm.runtime.local import resume_local

        return resume_local(info)
    from vlaslurm.slurm.submit import resubmit

    sub = resubmit(info, runs_root(args))
    console.print(f"submitted job [bold]{sub.job_id}[/bold]  run dir: {sub.run_dir}")
    return 0


def change_for_resume(info: RunInfo, overrides: List[str]) -> None:
    """Resume with some settings changed (only `spec.schema.RESUMABLE` ones: the trainer's ranks and resources,
    deadlines, the run's length): the run directory's resolved spec is rewritten, the one it replaces kept, and
    the rank counts a local resume starts follow. A fsdp checkpoint loads onto any number of trainer ranks."""
    from vlaslurm import rundir
    from vlaslurm.runtime.local import local_ranks
    from vlaslurm.spec import load_spec

    paths = rundir.RunDir(Path(info.run_dir))
    loaded = load_spec(paths.spec, overrides, site=paths.site_copy if paths.site_copy.exists() else None)
    loaded.check_resumable()
    kept = rundir.replace_spec(paths.root, loaded.to_yaml())
    info.overrides = [*info.overrides, *overrides]
    info.ranks = local_ranks(loaded)
    rundir.write_info(info)
    console.print(f"changed for this attempt: {', '.join(overrides)} (the spec it replaces: {kept.name})")


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a run's job."""
    from vlaslurm.slurm.submit import cancel

    runs = resolve_all(args)  # a sweep name: every run of the sweep
    if len(runs) == 1 and not runs[0].job_id:
        raise UserError(f"run {runs[0].run_dir} is a local run; stop it with Ctrl-C where it runs")
    for info in runs:
        if info.job_id:
            cancel(info.job_id)
            console.print(f"cancelled job {info.job_id}")
    return 0


def register(sub) -> None:
    from vlaslurm.cli.placement import add_plan_options

    p = add_command(
        sub,
        "plan",
        cmd_plan,
        "show the resolved plan and sbatch script; submit nothing (--placement "
        "auto without a cached profile first runs the profiling job, and says so)",
    )
    add_spec_args(p)
    p.add_argument("--test-only", action="store_true", help="also ask Slurm (sbatch --test-only) if it would run")
    add_plan_options(p)
    for name, func, text in (
        ("submit", cmd_submit, "submit the spec as one heterogeneous Slurm job"),
        ("run", cmd_run, "run every role as local processes on this machine"),
    ):
        p = add_command(sub, name, func, text)
        add_spec_args(p)
        p.add_argument("--run-dir", help="use this run directory instead of a new one under the runs root")
        p.add_argument("--probe", action="store_true", help="run the connectivity probe instead of training")
        p.add_argument("--absent", help=argparse.SUPPRESS)  # tests: this role exits before meeting
        if name == "submit":
            p.add_argument("--seeds", help="one job per seed (rollout.seed), e.g. 0,1,2 or 0-4; grouped as a sweep")
            p.add_argument(
                "--sweep",
                action="append",
                default=[],
                metavar="KEY=V1,V2",
                help="one job per value (repeat for a cartesian product); grouped as a sweep",
            )
            p.add_argument("--sweep-name", help="name of the sweep (default: <spec name>-sweep-<date>-<time>)")
            p.add_argument(
                "--follow",
                "-f",
                action="store_true",
                help="show the job's progress until it ends, then a summary (Ctrl-C stops following)",
            )
    add_command(sub, "cancel", cmd_cancel, "cancel a run's Slurm job").add_argument(
        "run", help="run directory, run name, job id or sweep name (all its runs)"
    )
    p = add_command(sub, "resume", cmd_resume, "continue a stopped run from its newest checkpoint")
    p.add_argument("run", help="run directory, run name or job id")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="change for this attempt what may change: resources.trainer.*, runtime.local_ranks.trainer, "
        "trainer.micro_batch_size / activation_checkpointing / cpu_offload / replicas, runtime timeouts, "
        "rollout.total_env_steps, slurm.time",
    )
    p.add_argument("--local", action="store_true", help="run every role as local processes (default: as the run ran)")
