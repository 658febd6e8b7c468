"""`vlaslurm status`, `logs` and `runs`: what a run is doing and what it has written."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from rich.table import Table

from vlaslurm.cli.common import UserError, add_command, console, resolve, resolve_all, runs_root
from vlaslurm.cli.progress import fmt_version, latest_metrics
from vlaslurm.rundir import (
    DamagedRunDir,
    RunDir,
    RunInfo,
    checkpoint_fallback_line,
    exit_records,
    read_eval,
    read_heartbeat,
    read_heartbeats,
    read_resolved_spec,
    restart_records,
    scan_runs,
)
from vlaslurm.slurm.state import run_state


def describe_run(info: RunInfo, now: Optional[float] = None) -> str:
    """A readable multi-line summary: state, steps' exits, restarts, checkpoints, each rank's heartbeat,
    and which role stalled. A damaged file is shown as unreadable, and the rest still shown."""
    run_dir = Path(info.run_dir)
    now = time.time() if now is None else now
    state = _guarded(run_dir, lambda: run_state(info))
    lines = [
        f"run      {info.name}  ({info.kind}{', job ' + info.job_id if info.job_id else ''})",
        f"dir      {info.run_dir}",
        f"state    {state}",
        f"ranks    {', '.join(f'{r}={n}' for r, n in info.ranks.items())}",
    ]
    lines += body_lines(run_dir, now)
    if state == "RUNNING":
        lines += stalled_lines(info, now)
    return "\n".join(lines)


def describe_unreadable(run_dir: Path, damage: DamagedRunDir, now: Optional[float] = None) -> str:
    """The summary of a run whose run info is damaged: everything else it has written."""
    now = time.time() if now is None else now
    lines = [f"run      unreadable ({damage.relative(run_dir)})", f"dir      {run_dir}", "state    UNKNOWN"]
    return "\n".join(lines + body_lines(run_dir, now))


def body_lines(run_dir: Path, now: float) -> List[str]:
    """Steps' exits, restarts, the newest checkpoint, eval, metrics and heartbeats, each damaged part unreadable."""
    sections = (
        ("step", step_lines),
        ("restart", restart_lines),
        ("ckpt", checkpoint_lines),
        ("eval", eval_lines),
        ("metrics", metrics_lines),
    )
    lines = [line for label, read in sections for line in _guarded_lines(run_dir, label, read)]
    return lines + heartbeat_lines(run_dir, now)


def _guarded(run_dir: Path, read: Callable[[], object]) -> str:
    try:
        return str(read())
    except DamagedRunDir as exc:
        return f"unreadable ({exc.relative(run_dir)})"


def _guarded_lines(run_dir: Path, label: str, read: Callable[[Path], List[str]]) -> List[str]:
    try:
        return read(run_dir)
    except DamagedRunDir as exc:
        return [f"{label:<8} unreadable ({exc.relative(run_dir)})"]


def step_lines(run_dir: Path) -> List[str]:
    return [
        f"step     {record['step']:<10} exit {record['exit_code']:<4} "
        f"after {float(record['end']) - float(record['start']):.1f} s "
        f"(restart {record.get('restart', 0)})"
        for record in exit_records(run_dir)
        if record["step"] != "job"
    ]


def restart_lines(run_dir: Path) -> List[str]:
    """One line per worker restart: which rank, which of how many, why it died, the back-off and when."""
    return [restart_line(record) for record in restart_records(run_dir)]


def restart_line(record: dict) -> str:
    code = record["exit_code"]
    how = record.get("how") if isinstance(record.get("how"), str) else None
    if how is None:  # a record from before `how` was written
        how = f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
    of = record.get("max_restarts")
    line = f"restart  {record['role']}[{record['rank']}] restart {record['restart']}"
    line += f" of {of}" if isinstance(of, int) else ""
    line += f" after {how}"
    wait, when = record.get("backoff_s"), record.get("time")
    if isinstance(wait, (int, float)):
        line += f", back-off {wait:.0f} s"
    if isinstance(when, (int, float)):
        line += f", at {time.strftime('%H:%M:%S', time.localtime(when))}"
    return line


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def checkpoint_lines(run_dir: Path) -> List[str]:
    from vlaslurm.runtime.checkpoint import latest

    newest = latest(run_dir)
    lines = [f"ckpt     {newest.name if newest else 'none yet'}"]
    fallback = checkpoint_fallback_line(run_dir)  # a resume that skipped a checkpoint that did not verify
    return lines + ([f"fallback {fallback}"] if fallback else [])


def metrics_lines(run_dir: Path) -> List[str]:
    metrics = latest_metrics(run_dir)
    if not metrics.row:
        return []
    try:
        total = (read_resolved_spec(run_dir).get("rollout") or {}).get("total_env_steps")
    except DamagedRunDir as exc:  # the line without the share of the total
        return [f"metrics  {metrics.line(None)}", f"spec     unreadable ({exc.relative(run_dir)})"]
    return [f"metrics  {metrics.line(total)}"]


def heartbeat_lines(run_dir: Path, now: float) -> List[str]:
    """One line per rank's heartbeat file; a damaged one is shown as unreadable."""
    lines = []
    for path in RunDir(run_dir).heartbeat_files():
        try:
            beat = read_heartbeat(path)
        except DamagedRunDir as exc:
            lines.append(f"role     {path.stem:<14} unreadable ({exc.relative(run_dir)})")
            continue
        if beat is not None:
            lines.append(
                f"role     {path.stem:<14} {fmt_version(beat):<5} {beat.get('progress', '')}  "
                f"last heartbeat {now - beat.get('time', 0):.0f} s ago"
            )
    return lines


def stalled_lines(info: RunInfo, now: float) -> List[str]:
    run_dir = Path(info.run_dir)
    return [
        f"STALLED  {name}: no heartbeat for {age:.0f} s (others are alive); see "
        f"vlaslurm logs {info.run_dir} --role {name.split('-')[0]}"
        for name, age in stalled_ranks(read_heartbeats(run_dir), _stall_after_s(run_dir), now)
    ]


def eval_lines(run_dir: Path) -> List[str]:
    """An eval run's result, once its result file is written: success overall and per task."""
    summary = read_eval(run_dir)
    if summary is None:
        return []
    outcomes = [ok for eps in summary["outcomes"].values() for ok in eps.values()]
    overall = sum(outcomes) / max(1, len(outcomes))
    tasks = ", ".join(f"{task} {rate:.2f}" for task, rate in summary["success"].items())
    failed = RunDir(run_dir).failed
    kept = f"; failed trajectories in {failed}" if failed.is_dir() else ""
    return [f"eval     success {overall:.2f} over {len(outcomes)} episodes ({tasks}){kept}"]


def stalled_ranks(beats: Dict[str, dict], after_s: float, now: float) -> List[Tuple[str, float]]:
    """Ranks silent for more than `after_s` while some other rank still beats: the ones holding the run up.
    (When every rank is silent the run is over or dead, which the state says.)"""
    ages = {
        name: now - beat.get("time", 0)
        for name, beat in beats.items()
        if not str(beat.get("progress", "")).startswith("finished")
    }
    if not ages or min(ages.values()) > after_s:
        return []
    return sorted(((n, a) for n, a in ages.items() if a > after_s), key=lambda item: -item[1])


def _stall_after_s(run_dir: Path) -> float:
    """A rank is stalled when silent for longer than the run's running deadline (at least 30 s)."""
    try:
        return max(30.0, float(read_resolved_spec(run_dir)["runtime"]["timeout_s"]))
    except (DamagedRunDir, KeyError, TypeError, ValueError):
        return 120.0


def cmd_status(args: argparse.Namespace) -> int:
    """Show a run's state, its steps' exit records and its roles' progress (damaged files shown as unreadable)."""
    try:
        runs = resolve_all(args)
    except DamagedRunDir as exc:
        if not RunDir(args.run).holds_run():
            raise
        console.print(describe_unreadable(Path(args.run), exc), markup=False)
        return 0
    for index, info in enumerate(runs):  # a sweep name: every run of the sweep
        console.print(("\n" if index else "") + describe_run(info), markup=False)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (or follow) a run's logs."""
    info = resolve(args)
    paths = RunDir(info.run_dir)
    files = paths.role_logs(args.role, args.rank)
    if args.role is None and args.rank is None:
        files = paths.batch_logs() + files
    if not files:
        raise UserError(f"no logs yet under {paths.logs}" + (f" for role {args.role}" if args.role else ""))
    for path in files:
        console.print(f"[bold]==> {path.relative_to(info.run_dir)} <==[/bold]")
        sys.stdout.write(path.read_text(errors="replace"))
    if args.follow:
        _follow(files)
    return 0


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


def _state_or_unreadable(info: RunInfo, damaged: List[DamagedRunDir]) -> str:
    """The run's state, or 'unreadable' with the damage kept for the lines under the table."""
    try:
        return run_state(info)
    except DamagedRunDir as exc:
        damaged.append(exc)
        return "unreadable"


def cmd_runs(args: argparse.Namespace) -> int:
    """List runs under the runs root; index lines and run directories that cannot be read are listed after."""
    root = runs_root(args)
    listing = scan_runs(root)
    table = Table("name", "job", "kind", "state", "sweep", "created", "run dir")
    for info in listing.runs:
        if (args.name and info.name != args.name) or (args.sweep and info.sweep != args.sweep):
            continue
        state = _state_or_unreadable(info, listing.damaged)
        if args.state and not state.upper().startswith(args.state.upper()):
            continue
        table.add_row(
            info.name,
            info.job_id or "-",
            info.kind,
            state,
            info.sweep or "-",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(info.created)),
            info.run_dir,
        )
    console.print(table)
    for damage in listing.damaged:
        console.print(f"unreadable  {damage.relative(root)}", markup=False)
    return 0


def register(sub) -> None:
    add_command(sub, "status", cmd_status, "show a run's state").add_argument(
        "run", help="run directory, run name, job id or sweep name (all its runs)"
    )
    p = add_command(sub, "logs", cmd_logs, "print a run's logs")
    p.add_argument("run", help="run directory, run name or job id")
    p.add_argument("--role", choices=["simulator", "generator", "trainer"])
    p.add_argument("--rank", type=int)
    p.add_argument("--follow", "-f", action="store_true")
    p = add_command(sub, "runs", cmd_runs, "list runs")
    p.add_argument("--name", help="only runs of this name")
    p.add_argument("--sweep", help="only runs of this sweep")
    p.add_argument("--state", help="only runs in this state (RUNNING, PENDING, COMPLETED, FAILED, CANCELLED, ...)")
