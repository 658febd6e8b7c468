"""The trainer's wait for data has a deadline: a hold deadlock is named instead of hanging.

The decision is tested as a pure function; the deadlock itself through the real runtime: GRPO in
async mode with `stale_policy: hold` and a hold budget ((max_staleness + 1) * steps_per_update = 32
slots) smaller than what any group needs to end (4 episodes of up to 24 steps, 8 environments
stepping side by side). The generator holds after one chunk per environment, the simulators ship
their open segments, and the trainer has 32 buffered steps but no whole group: without a credit
for those waiting steps in the hold budget neither side moves, and the trainer stops after
runtime.timeout_s naming the hold deadlock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from runtime_helpers import run_spec, synthetic_spec

from vlaslurm.runtime.roles.trainer import check_starved, generator_states


def test_every_generator_holding_past_the_deadline_is_named() -> None:
    with pytest.raises(RuntimeError, match="every generator holds.*generator-0, generator-1"):
        check_starved(121.0, 120.0, {"generator-0": "holding", "generator-1": "holding"})


@pytest.mark.parametrize(
    "silent, states",
    [
        (30.0, {"generator-0": "holding"}),  # not yet past the deadline
        (500.0, {"generator-0": "holding", "generator-1": "serving"}),  # someone still serves: slow, not stuck
        (500.0, {}),  # no heartbeat yet: nothing to conclude
    ],
)
def test_waiting_is_fine_otherwise(silent: float, states: dict) -> None:
    check_starved(silent, 120.0, states)


def test_states_come_from_the_generators_heartbeats(tmp_path: Path) -> None:
    beats = tmp_path / "heartbeats"
    beats.mkdir()

    def beat(progress: str) -> str:  # what Heartbeat.beat writes
        return json.dumps({"time": 1.0, "version": 3, "progress": progress})

    (beats / "generator-0.json").write_text(beat("served_steps=64 holding"))
    (beats / "generator-1.json").write_text(beat("served_steps=80 serving"))
    (beats / "simulator-0.json").write_text(beat("env_steps=10"))
    (beats / "generator-2.json").write_text("{torn")  # damaged: skipped, never a crash of the trainer
    assert generator_states(tmp_path) == {"generator-0": "holding", "generator-1": "serving"}


def grpo_hold_spec(timeout_s: float) -> dict:
    return {
        "name": "holddl",
        "env": {
            "type": "toy",
            "num_envs": 8,
            "max_episode_steps": 24,
            "obs": {"image_size": 32, "cameras": ["top"], "state": True},
        },
        "model": {"type": "openvla-oft", "action_chunk": 4, "action_dim": 2},
        "algo": {"type": "grpo", "group_size": 4, "steps_per_update": 32, "epochs": 1, "minibatches": 1},
        "rollout": {
            "mode": "async",
            "max_staleness": 0,
            "stale_policy": "hold",
            "weight_sync": "nccl",
            "total_env_steps": 600,
            "seed": 0,
            "batching": {"max_batch": 64, "max_wait_ms": 5},
        },
        "resources": {
            "layout": "disaggregated",
            "simulator": {"nodes": 1},
            "generator": {"nodes": 1},
            "trainer": {"nodes": 1},
        },
        "runtime": {"first_meeting_timeout_s": 120, "timeout_s": timeout_s},
    }


@pytest.mark.slow
def test_grpo_async_hold_does_not_deadlock(tmp_path: Path) -> None:
    run = run_spec(tmp_path, grpo_hold_spec(timeout_s=20), timeout_s=240)
    trainer_log = run.log("trainer", 0)
    assert "every generator holds" not in trainer_log, trainer_log[-1500:]
    assert run.rc == 0, trainer_log[-1500:]
    holds, updates = run.events("hold", "generator"), run.events("update", "trainer")
    # the deadlock's situation did arise: the generator held before the trainer had a single batch
    assert holds and updates and min(h["t0"] for h in holds) < min(u["t0"] for u in updates)
    assert len(updates) >= 3


@pytest.mark.slow
def test_trainer_followers_outwait_a_phase_longer_than_their_group_timeout(tmp_path: Path) -> None:
    """Two trainer ranks; the first batch takes well over the trainers' group timeout (first_meeting_timeout_s +
    timeout_s) to arrive. Rank 1 waits in a collective for it: rank 0's keep-alives must carry it through, where gloo
    alone would fail it at the timeout."""
    first_s, timeout_s = 10, 4  # the ranks meet within seconds of their start, loaded or not
    spec = synthetic_spec("sync", num_envs=4, step_ms=400, episode_steps=60, steps_per_update=240, total_env_steps=240)
    spec["runtime"] = {
        "first_meeting_timeout_s": first_s,
        "timeout_s": timeout_s,
        "local_ranks": {"trainer": 2, "generator": 1, "simulator": 1},
    }
    run = run_spec(tmp_path, spec, timeout_s=150)
    assert run.rc == 0, run.log("trainer", 1)[-1500:]
    first_update = min(u["t0"] for u in run.events("update", "trainer"))
    assert first_update > 1.3 * (first_s + timeout_s)  # the wait really outlasted the group's timeout
    assert len(run.events("update", "trainer")) == 2  # one update, on both ranks


def test_a_heartbeat_beats_while_a_block_runs_and_its_age_is_read_back(tmp_path: Path) -> None:
    from vlaslurm.rundir import Heartbeat, beat_age_s

    heartbeat = Heartbeat(tmp_path, "trainer", 0, every_s=0.05)
    assert beat_age_s(tmp_path, "trainer", 0) is None  # none yet
    path = tmp_path / "heartbeats" / "trainer-0.json"
    with heartbeat.during(3, "updating"):
        first = path.read_text()
        time.sleep(0.3)  # the loop that would beat is held here
        assert path.read_text() != first  # beaten again meanwhile (its time moved)
    assert json.loads(path.read_text())["progress"] == "updating"
    assert 0 <= beat_age_s(tmp_path, "trainer", 0) < 5
    path.write_text("{torn")
    assert beat_age_s(tmp_path, "trainer", 0) is None  # damaged: no age, never a crash


@pytest.mark.slow
def test_simulators_outwait_an_update_longer_than_the_running_deadline(tmp_path: Path) -> None:
    """Sync, two updates of 7 s each against runtime.timeout_s 3 s (as a 7B update can outlast the default
    120 s). The simulator waits for the next version past its deadline while the trainer's heartbeat beats
    during the update; before, its wait ended after 3 s with 'announced no version 1' and the run went on
    only through the simulator's restarts (one per update)."""
    spec = synthetic_spec(
        "sync", num_envs=4, step_ms=1, episode_steps=10, steps_per_update=40, update_ms=7000, total_env_steps=80
    )
    spec["runtime"] = {"first_meeting_timeout_s": 120, "timeout_s": 3}
    run = run_spec(tmp_path, spec, timeout_s=150)
    assert run.rc == 0, run.log("simulator", 0)[-1500:]
    assert "announced no version" not in run.log("simulator", 0)
    assert not (run.run_dir / "restarts.jsonl").exists()
    updates = run.events("update", "trainer")
    assert len(updates) == 2 and all(u["t1"] - u["t0"] >= 7 for u in updates)
