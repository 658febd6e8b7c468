"""What `vlaslurm status` and `vlaslurm runs` say about a run."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from vlaslurm.runtime.records import read_jsonl
from vlaslurm.runtime.rundir import RunInfo


_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"}


def run_state(info: RunInfo) -> str:
    """PENDING, RUNNING, COMPLETED, FAILED(code), CANCELLED, or UNKNOWN when neither Slurm nor the record knows.

    While Slurm knows the job its state wins (a requeued job's old exit record is not the end); once
    Slurm has forgotten it (MinJobAge), the exit record in the run directory is the truth.
    """
    from vlaslurm.slurm.cluster import SlurmUnavailable
    from vlaslurm.slurm.submit import job_outcome, job_states

    outcome = job_outcome(Path(info.run_dir))
    if info.kind == "slurm" and info.job_id:
        try:
            states = set(job_states(info.job_id).values())
        except SlurmUnavailable:  # fall back to what the run directory says
            states = set()
        if states & _ACTIVE:
            return "RUNNING" if "RUNNING" in states else sorted(states & _ACTIVE)[0]
        if "CANCELLED" in states:
            return "CANCELLED"
        if states and outcome is None:
            return sorted(states)[0]
    if outcome is None:
        return "RUNNING" if info.kind == "local" and _recent_heartbeat(info) else "UNKNOWN"
    return "COMPLETED" if outcome == 0 else f"FAILED({outcome})"


def _recent_heartbeat(info: RunInfo, within_s: float = 60.0) -> bool:
    beats = list(Path(info.run_dir).glob("heartbeats/*.json"))
    return any(time.time() - p.stat().st_mtime < within_s for p in beats)


def describe_run(info: RunInfo, now: Optional[float] = None) -> str:
    """A readable multi-line summary: state, steps' exits, restarts, checkpoints, each rank's heartbeat,
    and which role stalled."""
    from vlaslurm.runtime.checkpoint import latest
    from vlaslurm.slurm.submit import exit_record

    run_dir = Path(info.run_dir)
    state = run_state(info)
    lines = [f"run      {info.name}  ({info.kind}{', job ' + info.job_id if info.job_id else ''})",
             f"dir      {info.run_dir}",
             f"state    {state}",
             f"ranks    {', '.join(f'{r}={n}' for r, n in info.ranks.items())}"]
    records = [r for r in exit_record(run_dir) if r.get("step") != "job"]
    for record in records:
        lines.append(f"step     {record['step']:<10} exit {record['exit_code']:<4} "
                     f"after {float(record['end']) - float(record['start']):.1f} s (restart {record.get('restart', 0)})")
    for record in read_jsonl(run_dir / "restarts.jsonl"):
        lines.append(f"restart  {record['role']}[{record['rank']}] restarted ({record['restart']}) after exit code "
                     f"{record['exit_code']}")
    newest = latest(run_dir)
    lines.append(f"ckpt     {newest.name if newest else 'none yet'}")
    lines += eval_lines(run_dir)
    beats = heartbeats(run_dir)
    now = time.time() if now is None else now
    for name, beat in beats.items():
        lines.append(f"role     {name:<14} v{beat.get('version', '-')}  {beat.get('progress', '')}  "
                     f"last heartbeat {now - beat.get('time', 0):.0f} s ago")
    if state == "RUNNING":
        stalled = stalled_ranks(beats, _stall_after_s(run_dir), now)
        for name, age in stalled:
            lines.append(f"STALLED  {name}: no heartbeat for {age:.0f} s (others are alive); see "
                         f"vlaslurm logs {info.run_dir} --role {name.split('-')[0]}")
    return "\n".join(lines)


def eval_lines(run_dir: Path) -> List[str]:
    """An eval run's result, once its eval.json is written: success overall and per task."""
    from vlaslurm.runtime.evaluate import EVAL_FILE

    try:
        summary = json.loads((Path(run_dir) / EVAL_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return []
    outcomes = [ok for eps in summary["outcomes"].values() for ok in eps.values()]
    overall = sum(outcomes) / max(1, len(outcomes))
    tasks = ", ".join(f"{task} {rate:.2f}" for task, rate in summary["success"].items())
    failed = Path(run_dir) / "failed"
    kept = f"; failed trajectories in {failed}" if failed.is_dir() else ""
    return [f"eval     success {overall:.2f} over {len(outcomes)} episodes ({tasks}){kept}"]


def heartbeats(run_dir: Path) -> Dict[str, dict]:
    """`role-rank` -> its last heartbeat (time, version, progress)."""
    beats = {}
    for path in sorted(Path(run_dir).glob("heartbeats/*.json")):
        try:
            beats[path.stem] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return beats


def stalled_ranks(beats: Dict[str, dict], after_s: float, now: float) -> List[Tuple[str, float]]:
    """Ranks silent for more than `after_s` while some other rank still beats: the ones holding the run up.
    (When every rank is silent the run is over or dead, which the state says.)"""
    ages = {name: now - beat.get("time", 0) for name, beat in beats.items()
            if not str(beat.get("progress", "")).startswith("finished")}
    if not ages or min(ages.values()) > after_s:
        return []
    return sorted(((n, a) for n, a in ages.items() if a > after_s), key=lambda item: -item[1])


def _stall_after_s(run_dir: Path) -> float:
    """A rank is stalled when silent for longer than the run's running deadline (at least 30 s)."""
    try:
        import yaml

        spec = yaml.safe_load((Path(run_dir) / "spec.yaml").read_text())
        return max(30.0, float(spec["runtime"]["timeout_s"]))
    except (OSError, KeyError, TypeError, ValueError):
        return 120.0

