"""Worker failures in local runs: a dead simulator or generator is restarted by its step's supervisor
and the run completes; no sample of a dead worker is trained on twice or under a wrong version.

Every check reads what the run recorded against an independent record: the trained samples against
the versions the generators recorded serving (written before each reply), the ledger against an
uninterrupted run of the same seed (sync mode redoes a restarted simulator's phase exactly).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import List

import pytest
from runtime_helpers import Run, member_pid, run_spec, served_versions, synthetic_spec, wait_for

RANKS = "runtime.local_ranks={simulator: 2, generator: 1, trainer: 1}"


def versions_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["version"] for line in lines if line.strip()), default=0)


def run_with_kill(
    tmp_path: Path, spec: dict, overrides: List[str], name: str, victim: tuple, after_version: int, delay_s: float = 0.0
) -> Run:
    """Run `spec`; after `after_version` updates (+ `delay_s`), SIGKILL the worker process of `victim`."""
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(run=run_spec(tmp_path, spec, overrides, name=name, timeout_s=120))
    )
    runner.start()
    run_dir = tmp_path / name
    try:
        wait_for(lambda: versions_done(run_dir) >= after_version, 60, f"version {after_version}")
        time.sleep(delay_s)
        os.kill(member_pid(run_dir, *victim), signal.SIGKILL)
    finally:
        runner.join(150)
    return result["run"]


def restarts(run: Run) -> List[dict]:
    path = run.run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def audit(run: Run, max_staleness: int) -> None:
    """Nothing corrupted or mislabelled reached an update."""
    served = served_versions(run)
    ledger = run.ledger
    used = ledger[ledger.used]
    assert len(used) > 0 and ledger.traj_id.is_unique
    for row in used.itertuples():
        for step in row.step_ids:
            versions = served.get((row.env_id, row.episode, int(step)))
            assert versions, f"{row.traj_id} step {step} was never served"
            assert set(versions) == {row.behavior_version}, (row.traj_id, step, versions, row.behavior_version)
        assert 0 <= row.lag <= max_staleness
    for (_, _), rows in ledger.groupby(["env_id", "episode"]):  # whole episodes or their first pieces, no holes
        assert sorted(rows.segment) == list(range(len(rows)))
    trained = [u["v"] for u in run.events("update", "trainer")]
    assert trained == sorted(set(trained)), "a version was trained twice"


def trajectories(run: Run) -> set:
    cols = ["traj_id", "behavior_version", "consumed_version", "steps", "digest"]
    return set(run.ledger[run.ledger.used][cols].itertuples(index=False, name=None))


def test_killed_simulator_restarts_and_sync_redoes_its_phase_exactly(tmp_path: Path) -> None:
    spec = synthetic_spec("sync", total_env_steps=64 * 10, update_ms=50)
    spec["resources"] = {"simulator": {"max_restarts": 2}}
    whole = run_spec(tmp_path, spec, [RANKS], name="whole")
    killed = run_with_kill(tmp_path, spec, [RANKS], "killed", ("simulator", 1), after_version=3, delay_s=0.03)
    assert whole.rc == 0 and killed.rc == 0, killed.log("simulator", 1)[-3000:]
    assert [(r["role"], r["rank"], r["exit_code"]) for r in restarts(killed)] == [("simulator", 1, -9)]
    (trainer,) = killed.counters("trainer")
    assert trainer["simulator_restarts"] == 1
    assert "discarded_segments" in trainer or trainer.get("discarded_steps", 0) == 0  # counted when there were any
    assert "restart 1 of 2" in killed.log("simulator", 1)
    audit(killed, max_staleness=0)
    assert trajectories(killed) == trajectories(whole)  # the restarted phase is the phase that would have run


def test_lost_generator_is_restarted_and_simulators_reconnect(tmp_path: Path) -> None:
    """Filesystem weight sync: a restarted generator cannot rejoin a broadcast group (see the README)."""
    spec = synthetic_spec("async", total_env_steps=1500, max_staleness=2, weight_sync="filesystem")
    spec["resources"] = {"generator": {"max_restarts": 1}}
    run = run_with_kill(tmp_path, spec, [RANKS], "gen", ("generator", 0), after_version=3)
    assert run.rc == 0, run.log("simulator", 0)[-3000:]
    assert [(r["role"], r["exit_code"]) for r in restarts(run)] == [("generator", -9)]
    assert sum(c.get("generator_reconnects", 0) for c in run.counters("simulator")) == 2
    assert "reconnecting and resending" in run.log("simulator", 0)
    audit(run, max_staleness=2)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_kills_never_let_a_bad_sample_into_an_update(tmp_path: Path, seed: int) -> None:
    """A loop of short runs, each killing a random simulator or generator worker at a random moment."""
    rng = random.Random(seed)
    mode = ["sync", "async", "pipelined"][seed % 3]
    extra = {"max_staleness": 1} if mode == "async" else {"pipeline_depth": 2} if mode == "pipelined" else {}
    spec = synthetic_spec(mode, total_env_steps=900, weight_sync="filesystem", **extra)
    spec["resources"] = {"simulator": {"max_restarts": 1}, "generator": {"max_restarts": 1}}
    victim = rng.choice([("simulator", 0), ("simulator", 1), ("generator", 0)])
    run = run_with_kill(
        tmp_path, spec, [RANKS], f"chaos{seed}", victim, after_version=rng.randint(1, 6), delay_s=rng.uniform(0, 0.1)
    )
    assert run.rc == 0, (victim, run.log(victim[0], victim[1])[-3000:])
    assert len(restarts(run)) == 1
    audit(run, max_staleness=extra.get("max_staleness", 0))
