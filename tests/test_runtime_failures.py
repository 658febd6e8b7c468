"""Every wait has a deadline: a generator that stops answering is named within runtime.timeout_s."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

from runtime_helpers import member_pid, run_spec, synthetic_spec, wait_for

TIMEOUT_S = 3


def served_steps(run_dir: Path, generator: int) -> int:
    """What generator[rank]'s heartbeat says it has served (0 before its first beat)."""
    beat = run_dir / "heartbeats" / f"generator-{generator}.json"
    try:
        progress = json.loads(beat.read_text())["progress"]
    except (OSError, ValueError, KeyError):
        return 0
    match = re.search(r"served_steps=(\d+)", progress)
    return int(match.group(1)) if match else 0


def test_async_simulator_names_a_silent_generator(tmp_path: Path) -> None:
    """generator[1] is frozen (SIGSTOP: alive, but silent) mid-run; the simulator's error names it
    within timeout_s, and the run fails instead of waiting forever."""
    # Filesystem weight sync: with a broadcast, the frozen rank would also stall the other generator's
    # weight receive, and the first error would be about that instead.
    spec = synthetic_spec("async", total_env_steps=10**6, max_staleness=1000, weight_sync="filesystem")
    spec["runtime"]["timeout_s"] = TIMEOUT_S
    spec["resources"] = {"simulator": {"max_restarts": 0}}  # fail fast: no restart of the failing simulator
    run_dir = tmp_path / "run"
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(
            run=run_spec(tmp_path, spec, ["runtime.local_ranks={simulator: 1, generator: 2, trainer: 1}"], timeout_s=60)
        )
    )
    runner.start()
    pid = wait_for(lambda: member_pid(run_dir, "generator", 1), 30, "generator[1] in the rendezvous")
    wait_for(lambda: (run_dir / "ledger.parquet").exists() or (run_dir / "metrics.jsonl").exists(), 30, "first update")
    # Until generator[1] has answered once, the simulator grants it the first meeting's deadline (60 s)
    wait_for(lambda: served_steps(run_dir, 1) > 0, 30, "a reply from generator[1]")
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        log = run_dir / "logs" / "simulator" / "0.log"
        wait_for(lambda: "generator[1] sent no actions" in log.read_text(), TIMEOUT_S + 10, "simulator error")
        named_after = time.monotonic() - frozen
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # let the launcher's SIGTERM in
        except ProcessLookupError:
            pass
        runner.join(60)
    assert result["run"].rc != 0
    assert named_after < TIMEOUT_S + 3, named_after


def test_a_simulator_stuck_in_a_step_does_not_hold_the_run_past_the_deadline(tmp_path: Path, monkeypatch) -> None:
    """Instance 1 never returns from its 101st step, late in the run; the other instances carry the run
    to its end, and simulator[0] waits half of runtime.timeout_s for the stuck step, says which instance hung,
    and ends: without that deadline its process would wait for the thread forever."""
    monkeypatch.setenv("VLASLURM_SYNTHETIC_HANG", "1:100")  # ~200 steps per instance in this run
    spec = synthetic_spec("async", total_env_steps=1600, max_staleness=1000, stale_policy="drop")
    spec["runtime"]["timeout_s"] = 10  # the rest of the run must end within it, on a loaded machine too
    started = time.monotonic()
    run = run_spec(tmp_path, spec, ["runtime.local_ranks={simulator: 2, generator: 2, trainer: 2}"], timeout_s=90)
    assert run.rc == 0, run.log("simulator", 0)[-2000:]
    assert time.monotonic() - started < 75
    assert re.search(r"1 instance\(s\) \(local \[1\]\) still in env\.step", run.log("simulator", 0))
    assert "still in env.step" not in run.log("simulator", 1)
    metrics = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["env_steps"] >= 1600
    assert set(run.ledger["env_id"]) >= {0, 1, 2, 3}  # instance 1's steps before it hung are in too


def test_a_step_that_never_returns_fails_its_rank_within_the_deadline(tmp_path: Path, monkeypatch) -> None:
    """Sync: a phase cannot end while instance 1 hangs in its step, and the simulator's main loop, still
    alive and beating, would wait for it forever; instead the rank fails after runtime.timeout_s, naming
    the environments (a restart, with resources.simulator.max_restarts, would take over from there). One
    simulator rank: another one's wait for the next phase would time out as soon, and might speak first."""
    monkeypatch.setenv("VLASLURM_SYNTHETIC_HANG", "1:5")
    spec = synthetic_spec("sync", total_env_steps=2000)
    spec["runtime"]["timeout_s"] = TIMEOUT_S
    spec["resources"] = {"simulator": {"max_restarts": 0}}  # fail fast: a restart would hang the same way
    started = time.monotonic()
    run = run_spec(tmp_path, spec, ["runtime.local_ranks={simulator: 1, generator: 2, trainer: 2}"], timeout_s=90)
    assert run.rc != 0
    assert time.monotonic() - started < 60
    # Sync steps the rank's eight instances in one vectorised call: the stuck call names all of them.
    assert re.search(
        r"simulator\[0\]: environment\(s\) \[0, 1, 2, 3, 4, 5, 6, 7\] "
        r"\(local \[0, 1, 2, 3, 4, 5, 6, 7\]\) "
        r"have been in env\.step for \d+ s \(runtime\.timeout_s=3\)",
        run.log("simulator", 0),
    ), run.log("simulator", 0)[-2000:]
