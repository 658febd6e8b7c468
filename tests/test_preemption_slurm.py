"""Preemption and time limits on the local Slurm cluster: the job is requeued whole and resumes.

Two jobs of the synthetic workload (sync mode, 1 s per update, so a job runs long enough to be
interrupted): one requeued by `scontrol requeue` as an administrator or a preempting job would,
one that runs into its time limit (`slurm.time=00:02:00`, USR2 60 s before). Both must finish
with every version trained exactly once, the logs of both attempts appended, and the restart
meeting in a fresh rendezvous (`<job>-r1`).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

import pytest
import yaml
from conftest import vlaslurm

from vlaslurm.rundir import exit_records as exit_record
from vlaslurm.rundir import read_ledger

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

UPDATE_MS = 1000
STEPS_PER_UPDATE = 64


def spec(name: str, versions: int, time_limit: str = "00:10:00") -> dict:
    return {
        "name": name,
        "env": {"type": "synthetic", "num_envs": 4, "step_ms": {"dist": "constant", "mean": 2}, "episode_steps": 10},
        "model": {"type": "synthetic", "action_chunk": 2, "forward_ms": {"base": 1, "per_item": 0.1}},
        "algo": {"type": "synthetic", "steps_per_update": STEPS_PER_UPDATE, "update_ms": UPDATE_MS},
        "rollout": {
            "mode": "sync",
            "total_env_steps": STEPS_PER_UPDATE * versions,
            "weight_sync": "filesystem",
            "batching": {"max_batch": 64, "max_wait_ms": 2},
        },
        "resources": {
            "layout": "disaggregated",
            "simulator": {"nodes": 1, "cpus_per_task": 1},
            "generator": {"nodes": 1, "cpus_per_task": 1},
            "trainer": {"nodes": 1, "cpus_per_task": 1},
        },
        "checkpoint": {"every_versions": 5, "keep": 2},
        "slurm": {"partition": "cpu", "time": time_limit, "signal_seconds": 60},
        "runtime": {"first_meeting_timeout_s": 120, "timeout_s": 30},
    }


def submit(root: Path, tmp: Path, data: dict) -> tuple:
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = vlaslurm("submit", str(path), runs_root=root)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    run_dir = Path(proc.stdout.split("run dir: ")[1].splitlines()[0].strip())  # the root has spaces
    return job_id, run_dir


def versions_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["version"] for line in lines if line.strip()), default=0)


def wait_until(predicate, timeout_s: float, what: str, job_id: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(1)
    subprocess.run(["scancel", job_id], check=False)
    pytest.fail(f"job {job_id}: no {what} within {timeout_s:.0f} s")


def wait_progressing(predicate, progress, stall_s: float, what: str, job_id: str, cap_s: float = 900.0) -> None:
    """Wait for `predicate`; fail only when `progress()` has not changed for `stall_s` (or after `cap_s`)."""
    start = last_change = time.monotonic()
    seen = progress()
    while not predicate():
        now = time.monotonic()
        if (current := progress()) != seen:
            seen, last_change = current, now
        if now - last_change > stall_s or now - start > cap_s:
            subprocess.run(["scancel", job_id], check=False)
            pytest.fail(f"job {job_id}: no {what}; progress stuck at {seen} for {now - last_change:.0f} s")
        time.sleep(1)


def requeued(run_dir: Path) -> bool:
    return any(r["step"] == "job" and r["restart"] == 0 and r["exit_code"] == 75 for r in exit_record(run_dir))


def components(job_id: str) -> Dict[str, str]:
    """State of every component of the hetjob (`<id>+<k>`), by id."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %t"], capture_output=True, text=True).stdout
    return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)


def completing_nodes() -> list:
    """Nodes of the local cluster still cleaning up after a job (state COMPLETING)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if "completing" in line.lower()]


def restart_now(job_id: str, run_dir: Path, limit: Optional[str] = None, attempt: int = 1) -> Path:
    """Once the requeued job is pending again: start it now instead of at the begin time Slurm gives a requeued
    job (~90 s here), as an operator might, and optionally give it a longer time limit. An update sent while the
    job is still completing does not stick, hence the wait for PD (or for the restart, if Slurm was quicker).
    Returns the rendezvous folder of restart `attempt`."""
    restarted = run_dir / "rendezvous" / f"{job_id}-r{attempt}"
    wait_until(
        lambda: restarted.is_dir() or set(components(job_id).values()) == {"PD"}, 120, "requeued job pending", job_id
    )
    if restarted.is_dir():
        return restarted
    # Slurm gives a requeued job a begin time (cred_expire + 1 s) because the requeue revoked the job's credential:
    # a restart launched in the second of the revocation is refused ("Job credential revoked" in slurmctld.log,
    # every component exit 1 with run time 0; seen in full suites). The revocation precedes the nodes' clean-up,
    # so a start 2 s after the clean-up is safe.
    wait_until(lambda: not completing_nodes(), 120, "the nodes' clean-up after the requeue", job_id)
    time.sleep(2)
    updates = [f"JobId={c} TimeLimit={limit}" for c in components(job_id)] if limit is not None else []
    for update in [*updates, f"JobId={job_id} StartTime=now"]:
        done = subprocess.run(["scontrol", "update", *update.split()], capture_output=True, text=True)
        print(f"scontrol update {update}: rc {done.returncode} {done.stderr.strip()}")  # shown if the test fails
    return restarted


def requeues(run_dir: Path) -> int:
    return sum(r["step"] == "job" and r["exit_code"] == 75 for r in exit_record(run_dir))


def attempt_progress(run_dir: Path) -> tuple:
    """What shows an attempt moving: versions trained, attempts ended, restarts met at the rendezvous."""
    meetings = run_dir / "rendezvous"
    return versions_done(run_dir), requeues(run_dir), len(list(meetings.iterdir())) if meetings.is_dir() else 0


def wait_finished_restarting(job_id: str, run_dir: Path, limit: Optional[str] = None, stall_s: float = 120) -> None:
    """Wait until an attempt after the first finishes. Every further requeue (a loaded machine may bring an
    attempt to its own limit's signal, as a requeue loop does) is started at once too; the deadline is from
    observed progress (`attempt_progress`), which must change within `stall_s`."""
    started = 1  # the caller restarted the first requeue
    seen, last_change = attempt_progress(run_dir), time.monotonic()
    while not finished_after_restart(run_dir):
        if requeues(run_dir) > started:
            started = requeues(run_dir)
            restart_now(job_id, run_dir, limit, attempt=started)
            last_change = time.monotonic()
        if (current := attempt_progress(run_dir)) != seen:
            seen, last_change = current, time.monotonic()
        if time.monotonic() - last_change > stall_s:
            print(subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout)
            subprocess.run(["scancel", job_id], check=False)
            pytest.fail(f"job {job_id}: no finish after the restart; (versions, requeues) stuck at {seen}")
        time.sleep(1)


def finished_after_restart(run_dir: Path) -> bool:
    return any(r["step"] == "job" and r["restart"] >= 1 and r["exit_code"] == 0 for r in exit_record(run_dir))


def check_resumed(run_dir: Path, job_id: str, versions: int) -> None:
    assert json.loads((run_dir / "final.json").read_text())["versions"] == versions
    ledger = read_ledger(run_dir)
    used = ledger[ledger.used]
    assert sorted(set(used.consumed_version)) == list(range(versions))  # every version trained, none twice:
    assert used.traj_id.is_unique  # the synthetic weights say how many
    log = (run_dir / "logs" / "trainer" / "0.log").read_text()
    assert "SLURM_RESTART_COUNT 0" in log and "SLURM_RESTART_COUNT 1" in log  # appended, one header per attempt
    assert "resumed from checkpoint" in log
    assert (run_dir / "rendezvous" / f"{job_id}-r0").is_dir() and (run_dir / "rendezvous" / f"{job_id}-r1").is_dir()


@pytest.fixture(scope="module")
def root(local_slurm, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("preempt") / "runs 'q' $(x)"


def test_scontrol_requeue_restarts_the_whole_job_from_its_checkpoint(root: Path, tmp_path: Path) -> None:
    versions = 30
    job_id, run_dir = submit(root, tmp_path, spec("requeue", versions))
    wait_until(lambda: versions_done(run_dir) >= 7, 120, "version 7", job_id)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    restarted = restart_now(job_id, run_dir)
    # Deadlines from observed progress: a requeued job may wait for nodes (more on a loaded machine), and once
    # it runs, each new version proves it is not stuck.
    wait_until(restarted.is_dir, 300, "start after the requeue", job_id)
    wait_progressing(
        lambda: finished_after_restart(run_dir), lambda: versions_done(run_dir), 90, "finish after the restart", job_id
    )
    check_resumed(run_dir, job_id, versions)


def test_time_limit_signal_checkpoints_and_requeues(root: Path, tmp_path: Path) -> None:
    versions = 60  # ~70 s of updates: USR2 comes 30-60 s after the start (limit - 60 s, checked every 30 s)
    job_id, run_dir = submit(root, tmp_path, spec("timelimit", versions, time_limit="00:02:00"))
    wait_until(lambda: requeued(run_dir), 240, "checkpoint and requeue at the limit's signal", job_id)
    # The attempt that follows has the same limit: on a loaded machine it may reach its own signal too, as it ends
    # (what a requeue loop does; not what this test checks), so it gets the time to finish, as an operator would.
    restart_now(job_id, run_dir, limit="00:10:00")
    wait_finished_restarting(job_id, run_dir, limit="00:10:00")
    log = (run_dir / "logs" / "trainer" / "0.log").read_text()
    assert "SIGUSR2: checkpoint v" in log
    first = [r for r in exit_record(run_dir) if r["step"] == "job" and r["restart"] == 0]
    assert first and first[0]["exit_code"] == 75  # the script's requeue, not a failure
    check_resumed(run_dir, job_id, versions)
