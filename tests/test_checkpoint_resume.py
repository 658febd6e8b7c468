"""Checkpoints and resume: an interrupted sync run, resumed, ends exactly where an uninterrupted one does.

The model is the real tiny OpenVLA-OFT policy trained with PPO on the toy reaching task (a few
versions, seconds per run). Sync mode starts every rollout phase from reset, seeded from (seed,
version, env id), so the only state that crosses a phase boundary is what the checkpoint holds:
parameters, optimizer, version, RNG and counters. Equal parameter checksums then mean that no
optimizer step was lost or repeated.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from conftest import vlaslurm
from runtime_helpers import Run, member_pid, run_spec, wait_for

from vlaslurm.rundir import read_info
from vlaslurm.runtime import checkpoint as ckpt
from vlaslurm.runtime.local import resume_local
from vlaslurm.runtime.signals import REQUEUE_EXIT

RANKS = "runtime.local_ranks={simulator: 1, generator: 1, trainer: 1}"


def toy_ppo_spec(versions: int = 6) -> dict:
    return {
        "name": "resume",
        "env": {"type": "toy", "num_envs": 4, "max_episode_steps": 6, "obs": {"image_size": 16, "cameras": ["top"]}},
        "model": {
            "type": "openvla-oft",
            "action_chunk": 2,
            "action_dim": 2,
            "backbone": {
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "intermediate_size": 64,
                "vision_channels": 8,
                "num_keypoints": 4,
            },
        },
        "algo": {"type": "ppo", "lr": 1.0e-3, "steps_per_update": 32, "epochs": 1, "minibatches": 2},
        "rollout": {
            "mode": "sync",
            "total_env_steps": 32 * versions,
            "weight_sync": "filesystem",
            "seed": 3,
            "batching": {"max_batch": 64, "max_wait_ms": 2},
        },
        "checkpoint": {"every_versions": 2, "keep": 2},
        "runtime": {"first_meeting_timeout_s": 60, "timeout_s": 20},
    }


def versions_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["version"] for line in lines if line.strip()), default=0)


def run_interrupted(tmp_path: Path, spec: dict, overrides, after_version: int, sig: int) -> Run:
    """Run `spec`; once `after_version` updates are done, send `sig` to trainer[0]; return the stopped run."""
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=run_spec(tmp_path, spec, overrides, name="cut")))
    runner.start()
    run_dir = tmp_path / "cut"
    try:
        wait_for(lambda: versions_done(run_dir) >= after_version, 90, f"version {after_version}")
        os.kill(member_pid(run_dir, "trainer", 0), sig)
    finally:
        runner.join(90)
    return result["run"]


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def test_interrupted_sync_ppo_run_resumes_to_the_same_parameters(tmp_path: Path) -> None:
    spec = toy_ppo_spec()
    whole = run_spec(tmp_path, spec, [RANKS], name="whole")
    assert whole.rc == 0, whole.log("trainer", 0)[-3000:]
    # USR2 is what Slurm sends before the time limit: the trainer checkpoints at its next update boundary.
    cut = run_interrupted(tmp_path, spec, [RANKS], after_version=3, sig=signal.SIGUSR2)
    assert cut.rc == REQUEUE_EXIT, cut.log("trainer", 0)[-3000:]
    assert "SIGUSR2: checkpoint v" in cut.log("trainer", 0)
    saved = ckpt.latest(cut.run_dir)
    assert saved is not None and 3 <= int(saved.name[1:]) < 6
    assert not (cut.run_dir / "final.json").exists()
    assert not list((cut.run_dir / "checkpoints").glob(".tmp-*")), "a checkpoint is renamed into place whole"

    rc = resume_local(read_info(cut.run_dir), echo=False, timeout_s=120)
    assert rc == 0, cut.log("trainer", 0)[-3000:]
    assert final(cut.run_dir) == final(whole.run_dir)  # same version count, same parameter checksum
    log = cut.log("trainer", 0)
    assert f"resumed from checkpoint {saved}" in log and log.count("==== trainer[0]") == 2  # appended, with headers
    # The resumed ledger continues the old one: every version consumed once, the same trajectories.
    cols = ["traj_id", "behavior_version", "consumed_version", "steps", "digest"]
    assert sorted(map(tuple, cut.ledger[cols].values.tolist())) == sorted(
        map(tuple, whole.ledger[cols].values.tolist())
    )
    updates = [e["v"] for e in cut.events("update", "trainer")]
    assert sorted(set(updates)) == list(range(6))
    assert len(list((cut.run_dir / "checkpoints").glob("v*"))) <= 2  # checkpoint.keep


def test_killed_trainer_stops_the_run_quickly_and_the_last_checkpoint_resumes(tmp_path: Path) -> None:
    """SIGKILL: no chance to save; the launcher names the trainer and stops the others at once, and a
    resume continues from the last periodic checkpoint (synthetic learner: weights + 1 per update)."""
    from runtime_helpers import synthetic_spec

    spec = synthetic_spec("sync", total_env_steps=64 * 8, update_ms=20)
    spec["checkpoint"] = {"every_versions": 2, "keep": 3}
    overrides = ["runtime.local_ranks={simulator: 2, generator: 1, trainer: 1}"]
    whole = run_spec(tmp_path, spec, overrides, name="whole")
    assert whole.rc == 0
    t0 = time.monotonic()
    cut = run_interrupted(tmp_path, spec, overrides, after_version=3, sig=signal.SIGKILL)
    assert cut.rc != 0 and time.monotonic() - t0 < 60
    exits = cut.exits()
    assert exits["trainer[0]"]["exit_code"] == -9
    assert max(e["end"] for e in exits.values()) - exits["trainer[0]"]["end"] < 12  # the others stop at once
    status = vlaslurm("status", str(cut.run_dir), runs_root=tmp_path / "runs")
    saved = ckpt.latest(cut.run_dir).name
    assert "FAILED" in status.stdout and f"ckpt     {saved}" in status.stdout, status.stdout
    proc = vlaslurm("resume", str(cut.run_dir), "--local", runs_root=tmp_path / "runs", timeout=180)  # the real CLI
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"from {saved}" in proc.stdout
    assert final(cut.run_dir) == final(whole.run_dir)
    again = vlaslurm("resume", str(cut.run_dir), "--local", runs_root=tmp_path / "runs")
    assert again.returncode == 2 and "is COMPLETED" in again.stderr


def test_a_resumed_run_ends_on_a_success_window_its_predecessor_began(tmp_path: Path) -> None:
    """`rollout.stop_at_success` over the last 6 progress reports, every episode a success (synthetic env): the run
    ends after its 6th update, interrupted or not. Resumed from a checkpoint before that, the window goes on from the
    reports the checkpoint kept; begun anew, it would need 6 more updates."""
    from runtime_helpers import synthetic_spec

    window = 6
    # Updates of 0.5 s, so that the cut after the 2nd lands before the 6th; episodes of 4 steps end in every phase.
    spec = synthetic_spec(
        "sync", num_envs=4, episode_steps=4, steps_per_update=32, update_ms=500, total_env_steps=32 * 20
    )
    spec["env"]["success_prob"] = 1.0
    spec["rollout"].update(stop_at_success=1.0, stop_window=window)
    spec["checkpoint"] = {"every_versions": 1, "keep": 2}
    whole = run_spec(tmp_path, spec, name="whole")
    assert whole.rc == 0, whole.log("trainer", 0)[-3000:]
    assert final(whole.run_dir)["versions"] == window and final(whole.run_dir)["ended_by"] == "rollout.stop_at_success"

    cut = run_interrupted(tmp_path, spec, [], after_version=2, sig=signal.SIGUSR2)
    assert cut.rc == REQUEUE_EXIT, cut.log("trainer", 0)[-3000:]
    saved = ckpt.latest(cut.run_dir)
    assert saved is not None and 2 <= int(saved.name[1:]) < window  # the window is part-filled at the checkpoint
    rc = resume_local(read_info(cut.run_dir), echo=False, timeout_s=120)
    assert rc == 0, cut.log("trainer", 0)[-3000:]
    assert final(cut.run_dir)["versions"] == window, final(cut.run_dir)
    assert final(cut.run_dir)["ended_by"] == "rollout.stop_at_success"
    assert cut.log("trainer", 0).count(f"of the last {window} reports reached rollout.stop_at_success") == 1


def test_resume_without_a_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(
        json.dumps({"name": "x", "run_dir": str(tmp_path / "run"), "kind": "local"})
    )
    proc = vlaslurm("resume", str(tmp_path / "run"), runs_root=tmp_path / "runs")
    assert proc.returncode == 2 and "has no checkpoint" in proc.stderr and "Traceback" not in proc.stderr
