"""`vlaslurm run` stopped by a signal: its ranks stop with it, and the trainer leaves a checkpoint to resume from.

Each rank runs in its own session (so that a Ctrl-C reaches the launcher alone), so without the launcher's own
handler a `kill` of `vlaslurm run` would leave every rank running unsupervised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import yaml
from conftest import REPO
from runtime_helpers import member_pid, run_spec, synthetic_spec, wait_for

from vlaslurm.runtime.signals import REQUEUE_EXIT

ROLES = {"simulator": 1, "generator": 1, "trainer": 2}
RANKS = "runtime.local_ranks={" + ", ".join(f"{r}: {n}" for r, n in ROLES.items()) + "}"


def read_metrics(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_a_signal_to_the_launcher_stops_every_rank_after_a_checkpoint(tmp_path: Path) -> None:
    """SIGTERM (SIGHUP, a closed terminal, takes the same path): the trainers drain as on a preemption, the
    launcher exits 128 + the signal and says how to resume."""
    signum = signal.SIGTERM
    spec = synthetic_spec("async", total_env_steps=10**7, max_staleness=4)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vlaslurm.cli", "--runs-root", str(tmp_path / "runs"), "run", str(path), RANKS]
        + ["--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "VLASLURM_TRACKING": "off"},
    )
    try:
        members = [(role, rank) for role, n in ROLES.items() for rank in range(n)]
        pids = [wait_for(lambda m=m: member_pid(run_dir, *m), 120, f"{m[0]}[{m[1]}]") for m in members]
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the first update")
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signum, err
    still = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not still, f"ranks left running after the launcher stopped: {still}"
    assert signal.Signals(signum).name in err
    assert f"vlaslurm resume {run_dir} --local" in err, err
    assert list((run_dir / "checkpoints").glob("v*")), "the trainer saved no checkpoint on its way out"


def test_a_term_to_every_rank_at_once_still_leaves_a_checkpoint(tmp_path: Path) -> None:
    """What Slurm does on a preemption or `scancel`: TERM to every rank together. The generators end at once, so
    a publication in progress fails; the trainer still saves its checkpoint and exits REQUEUE_EXIT (75)."""
    spec = synthetic_spec("async", total_env_steps=10**7, max_staleness=4)
    run_dir = tmp_path / "run"
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(run=run_spec(tmp_path, spec, [RANKS], timeout_s=180)), daemon=True
    )
    runner.start()
    members = [(role, rank) for role, n in ROLES.items() for rank in range(n)]
    pids = [wait_for(lambda m=m: member_pid(run_dir, *m), 120, f"{m[0]}[{m[1]}]") for m in members]
    wait_for(lambda: len(read_metrics(run_dir)) >= 3, 120, "three updates")
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    runner.join(150)
    assert "run" in result, "the run did not end after every rank got TERM"
    trainer = result["run"].exits()["trainer[0]"]
    assert trainer["exit_code"] == REQUEUE_EXIT, result["run"].log("trainer", 0)[-3000:]
    assert list((run_dir / "checkpoints").glob("v*")), "the trainer saved no checkpoint on its way out"
