"""Faults survived by default: a stateless role comes back without the spec asking.

Simulators restart 3 times by default, and generators too when weights travel by file; the supervisor
waits 1 s, 2 s, 4 s ... before each restart; `max_restarts: 0` keeps fail-fast. The runs are real local
runs (`vlaslurm run`), a worker killed by SIGKILL mid-run, and every claim is read from what the run
recorded: `restarts.jsonl`, the exit record, `vlaslurm status`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import yaml
from conftest import vlaslurm
from runtime_helpers import Run, member_pid, run_spec, synthetic_spec, wait_for

from vlaslurm.runtime.local import prepare_local_run
from vlaslurm.runtime.worker import backoff_s
from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.schema import default_max_restarts

RANKS = "runtime.local_ranks={simulator: 2, generator: 1, trainer: 1}"
PROGRESS_S = 60  # the longest a live run may go without a new version before the test gives up


def load(tmp_path: Path, resources: dict, weight_sync: str = "nccl"):
    spec = synthetic_spec("sync", weight_sync=weight_sync)
    spec["resources"] = resources
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_spec(path)


@pytest.mark.parametrize(
    "weight_sync, expected",
    [("nccl", {"simulator": 3, "generator": 0, "trainer": 0}), ("filesystem", {"simulator": 3, "generator": 3})],
)
def test_the_default_depends_on_the_role_and_the_weight_sync(tmp_path: Path, weight_sync: str, expected) -> None:
    loaded = load(tmp_path, {}, weight_sync)
    for role, restarts in expected.items():
        assert loaded.spec.role_resources(role).max_restarts == restarts  # resolved at load, in the spec itself
        assert default_max_restarts(role, weight_sync) == restarts
    assert yaml.safe_load(loaded.to_yaml())["resources"]["simulator"]["max_restarts"] == 3  # spec.yaml shows it


def test_an_explicit_value_wins_and_a_generator_restart_under_nccl_is_refused(tmp_path: Path) -> None:
    loaded = load(tmp_path, {"simulator": {"max_restarts": 0}, "generator": {"max_restarts": 0}})
    assert loaded.spec.max_restarts("simulator") == 0 and loaded.spec.max_restarts("generator") == 0
    assert load(tmp_path, {"generator": {"max_restarts": 5}}, "filesystem").spec.max_restarts("generator") == 5
    with pytest.raises(SpecError, match="cannot rejoin the NCCL broadcast group") as err:
        load(tmp_path, {"generator": {"max_restarts": 2}})
    assert err.value.key == "resources.generator.max_restarts"
    with pytest.raises(SpecError, match="the trainer holds the run's state"):
        load(tmp_path, {"trainer": {"max_restarts": 1}})


def test_plan_shows_the_resolved_restarts(tmp_path: Path) -> None:
    spec = synthetic_spec("sync", weight_sync="filesystem")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = vlaslurm("plan", str(tmp_path / "spec.yaml"), runs_root=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if "restarts" in line)
    table = [line.split() for line in proc.stdout.splitlines() if len(line.split()) == len(header.split())]
    rows = {cells[0]: cells[-1] for cells in table if cells[0][:5] in ROLE_HEADS}
    assert header.split()[-1] == "restarts"
    assert rows == {"simulator": "3", "generator": "3", "trainer": "0"}, proc.stdout


ROLE_HEADS = ("simul", "gener", "train")


def test_the_back_off_doubles_and_is_capped() -> None:
    assert [backoff_s(k) for k in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_the_supervisor_stays_small(tmp_path: Path) -> None:
    """A simulator's process is its supervisor by default now: it must not import torch (seconds and hundreds
    of MB per rank), only its child does."""
    info = prepare_local_run(load(tmp_path, {}), tmp_path / "runs", tmp_path / "run")
    script = (
        "import sys\n"
        "from vlaslurm.runtime import worker\n"
        "worker.supervise = lambda argv, role, rank, restarts, run_dir: print(role, rank, restarts, "
        "'torch' in sys.modules) or 0\n"
        f"sys.exit(worker.main(['--role', 'simulator', '--run-dir', {info.run_dir!r}]))\n"
    )
    env = {**os.environ, "VLASLURM_RANK": "1"}
    env.pop("VLASLURM_WORKER_RESTART", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["simulator", "1", "3", "False"], proc.stdout + proc.stderr


def versions_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    versions = []
    for line in lines:
        try:
            versions.append(json.loads(line)["version"])
        except ValueError:  # a line being written
            pass
    return max(versions, default=0)


def restarts(run_dir: Path) -> List[dict]:
    path = run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def wait_progress(run_dir: Path, condition: Callable[[], object], what: str):
    """Wait for `condition` while the run makes progress: the deadline moves with each new version."""
    seen, end = versions_done(run_dir), time.monotonic() + PROGRESS_S
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        now = versions_done(run_dir)
        if now > seen:
            seen, end = now, time.monotonic() + PROGRESS_S
        time.sleep(0.05)
    raise AssertionError(f"no {what} (the run is stuck at version {seen})")


def start(tmp_path: Path, spec: dict, name: str, timeout_s: float = 150) -> tuple:
    result: Dict[str, Run] = {}
    runner = threading.Thread(
        target=lambda: result.update(run=run_spec(tmp_path, spec, [RANKS], name=name, timeout_s=timeout_s))
    )
    runner.start()
    return runner, result, tmp_path / name


def kill(run_dir: Path, role: str, rank: int) -> tuple:
    """SIGKILL role[rank]'s worker process (not its supervisor); (the pid, when)."""
    pid = wait_for(lambda: member_pid(run_dir, role, rank), 60, f"{role}[{rank}] in the rendezvous")
    when = time.time()
    os.kill(pid, signal.SIGKILL)
    return pid, when


def check_back_off(record: dict, killed_at: float) -> None:
    """The restart came no sooner than its back-off after the kill (the supervisor's own clock, and ours)."""
    wait = backoff_s(record["restart"])
    assert record["backoff_s"] == wait
    assert record["time"] - record["died"] >= wait - 0.01, record
    assert record["time"] - killed_at >= wait, (record, killed_at)
    assert record["time"] - killed_at < wait + 30, (record, killed_at)  # and it did come (loaded machine: loose)


def test_a_killed_simulator_comes_back_twice_without_max_restarts(tmp_path: Path) -> None:
    """No resources section at all: simulator[1] is killed, comes back after 1 s, is killed again once it
    rejoined and the run moved on, comes back after 2 s, and the run completes; `status` lists both."""
    spec = synthetic_spec("sync", total_env_steps=64 * 24, update_ms=20)
    runner, result, run_dir = start(tmp_path, spec, "sim")
    try:
        wait_progress(run_dir, lambda: versions_done(run_dir) >= 3, "version 3")
        first, killed_1 = kill(run_dir, "simulator", 1)
        wait_progress(run_dir, lambda: member_pid(run_dir, "simulator", 1) not in (0, first), "restarted simulator")
        after = versions_done(run_dir)
        wait_progress(run_dir, lambda: versions_done(run_dir) > after, "a version after the restart")
        _, killed_2 = kill(run_dir, "simulator", 1)
    finally:
        runner.join(200)
    run = result["run"]
    assert run.rc == 0, run.log("simulator", 1)[-3000:]
    records = restarts(run_dir)
    assert [(r["role"], r["rank"], r["restart"], r["max_restarts"], r["exit_code"]) for r in records] == [
        ("simulator", 1, 1, 3, -9),
        ("simulator", 1, 2, 3, -9),
    ]
    check_back_off(records[0], killed_1)
    check_back_off(records[1], killed_2)
    (trainer,) = run.counters("trainer")
    assert trainer["simulator_restarts"] == 2
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["env_steps"] >= 64 * 24
    status = vlaslurm("status", str(run_dir), runs_root=tmp_path / "runs")
    assert status.returncode == 0, status.stderr
    lines = [line for line in status.stdout.splitlines() if line.startswith("restart ")]
    assert len(lines) == 2, status.stdout
    assert "simulator[1] restart 1 of 3 after signal SIGKILL, back-off 1 s" in lines[0]
    assert "simulator[1] restart 2 of 3 after signal SIGKILL, back-off 2 s" in lines[1]


def test_a_killed_generator_comes_back_by_default_with_filesystem_weights(tmp_path: Path) -> None:
    spec = synthetic_spec("async", total_env_steps=64 * 20, max_staleness=2, weight_sync="filesystem")
    runner, result, run_dir = start(tmp_path, spec, "gen")
    try:
        wait_progress(run_dir, lambda: versions_done(run_dir) >= 3, "version 3")
        _, killed = kill(run_dir, "generator", 0)
    finally:
        runner.join(200)
    run = result["run"]
    assert run.rc == 0, run.log("simulator", 0)[-3000:]
    (record,) = restarts(run_dir)
    assert (record["role"], record["rank"], record["restart"], record["max_restarts"]) == ("generator", 0, 1, 3)
    check_back_off(record, killed)
    assert "reconnecting and resending" in run.log("simulator", 0) + run.log("simulator", 1)
    status = vlaslurm("status", str(run_dir), runs_root=tmp_path / "runs")
    assert "generator[0] restart 1 of 3 after signal SIGKILL, back-off 1 s" in status.stdout, status.stdout


def test_max_restarts_0_still_fails_fast(tmp_path: Path) -> None:
    spec = synthetic_spec("sync", total_env_steps=64 * 200, update_ms=20)
    spec["resources"] = {"simulator": {"max_restarts": 0}}
    runner, result, run_dir = start(tmp_path, spec, "fast")
    try:
        wait_progress(run_dir, lambda: versions_done(run_dir) >= 2, "version 2")
        _, killed = kill(run_dir, "simulator", 1)
    finally:
        runner.join(200)
    run = result["run"]
    assert run.rc != 0 and not restarts(run_dir)
    assert run.exits()["simulator[1]"]["exit_code"] == -9  # no supervisor between the launcher and the worker
    assert run.exits()["simulator[1]"]["end"] - killed < 5, "the launcher saw the death at once"
    assert versions_done(run_dir) < 200
