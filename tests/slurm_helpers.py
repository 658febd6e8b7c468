"""Submitting real jobs to the local Slurm cluster from tests, and waiting for them with a deadline."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import pytest
from conftest import vlaslurm

from vlaslurm.rundir import job_outcome, list_runs
from vlaslurm.slurm.submit import job_states

DEADLINE_S = 90.0  # per job, from submission (jobs may queue behind each other on 4 nodes)


@dataclass
class Job:
    job_id: str
    run_dir: Path


def submit(root: Path, *args: str, env: Optional[Dict[str, str]] = None) -> Job:
    """`vlaslurm submit` on the local site; `env` is added to the environment the job inherits."""
    proc = vlaslurm("submit", *args, "--site", "local", runs_root=root, env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    info = next(r for r in list_runs(root) if r.job_id == job_id)
    return Job(job_id, Path(info.run_dir))


def wait_done(job: Job, deadline_s: float = DEADLINE_S) -> int:
    """The job's exit code from its exit record; fails (and cancels the job) past the deadline."""
    end = time.monotonic() + deadline_s
    while True:  # looks at least once, so a job already done passes with no time left
        outcome = job_outcome(job.run_dir)
        if outcome is not None and not set(job_states(job.job_id).values()) & {"RUNNING", "PENDING", "COMPLETING"}:
            return outcome
        if time.monotonic() >= end:
            break
        time.sleep(0.5)
    vlaslurm("cancel", job.job_id, runs_root=job.run_dir.parent.parent)
    pytest.fail(f"job {job.job_id} did not end within {deadline_s:.0f} s; run dir {job.run_dir}")
