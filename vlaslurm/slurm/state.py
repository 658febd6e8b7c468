"""A run's state: Slurm's word while it knows the job, the run directory's exit record after."""

from __future__ import annotations

import time
from pathlib import Path

from vlaslurm.rundir import RunDir, RunInfo, job_outcome
from vlaslurm.slurm.cluster import SlurmUnavailable
from vlaslurm.slurm.submit import job_states

ACTIVE = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"})


def run_state(info: RunInfo) -> str:
    """PENDING, RUNNING, COMPLETED, FAILED(code), CANCELLED, or UNKNOWN when neither Slurm nor the record knows.

    While Slurm knows the job its state wins (a requeued job's old exit record is not the end); once
    Slurm has forgotten it (MinJobAge), the exit record in the run directory is the truth.
    """
    outcome = job_outcome(Path(info.run_dir))
    if info.kind == "slurm" and info.job_id:
        try:
            states = set(job_states(info.job_id).values())
        except SlurmUnavailable:  # fall back to what the run directory says
            states = set()
        if states & ACTIVE:
            return "RUNNING" if "RUNNING" in states else sorted(states & ACTIVE)[0]
        if "CANCELLED" in states:
            return "CANCELLED"
        if states and outcome is None:
            return sorted(states)[0]
    if outcome is None:
        return "RUNNING" if info.kind == "local" and _recent_heartbeat(info) else "UNKNOWN"
    return "COMPLETED" if outcome == 0 else f"FAILED({outcome})"


def is_active(state: str) -> bool:
    return state in ACTIVE


def _recent_heartbeat(info: RunInfo, within_s: float = 60.0) -> bool:
    return any(time.time() - p.stat().st_mtime < within_s for p in RunDir(info.run_dir).heartbeat_files())
