"""`vlaslurm status RUN`: each rank's last heartbeat, version and progress, and which role stalled."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from conftest import vlaslurm

from vlaslurm import rundir
from vlaslurm.cli.runs import describe_run, stalled_ranks


def fake_run(tmp_path: Path, beats: dict) -> rundir.RunInfo:
    """A local run directory as the ranks leave it while running (no processes needed)."""
    directory = rundir.new_run_dir(tmp_path / "runs", "st")
    (directory / "spec.yaml").write_text(yaml.safe_dump({"runtime": {"timeout_s": 20}}))
    (directory / "heartbeats").mkdir()
    for name, (age, version, progress) in beats.items():
        (directory / "heartbeats" / f"{name}.json").write_text(
            json.dumps({"time": time.time() - age, "version": version, "progress": progress})
        )
    (directory / "restarts.jsonl").write_text(
        json.dumps({"role": "simulator", "rank": 1, "restart": 1, "exit_code": -9}) + "\n"
    )
    info = rundir.RunInfo(
        name="st", run_dir=str(directory), kind="local", ranks={"trainer": 1, "generator": 1, "simulator": 2}
    )
    rundir.write_info(info)
    rundir.append_index(tmp_path / "runs", info)
    return info


def test_status_names_the_stalled_role(tmp_path: Path) -> None:
    info = fake_run(
        tmp_path,
        {
            "trainer-0": (1, 7, "env_steps=900 waiting for data"),
            "generator-0": (2, 7, "served_steps=950"),
            "simulator-0": (1, 7, "env_steps=450"),
            "simulator-1": (95, 6, "env_steps=400"),
        },
    )
    text = describe_run(info)
    assert "state    RUNNING" in text
    assert "simulator-1" in text and "v6" in text and "env_steps=400" in text
    stalled = [line for line in text.splitlines() if line.startswith("STALLED")]
    assert len(stalled) == 1 and "simulator-1: no heartbeat for " in stalled[0], text
    assert "restart  simulator[1] restart 1 after signal SIGKILL" in text
    proc = vlaslurm("status", "st", runs_root=tmp_path / "runs")  # the real command line
    assert proc.returncode == 0 and "STALLED  simulator-1" in proc.stdout, proc.stdout + proc.stderr


def test_no_stall_when_everyone_beats_or_everyone_is_silent() -> None:
    now = time.time()
    alive = {"trainer-0": {"time": now - 1}, "simulator-0": {"time": now - 3}}
    assert stalled_ranks(alive, 20, now) == []
    dead = {"trainer-0": {"time": now - 500}, "simulator-0": {"time": now - 400}}
    assert stalled_ranks(dead, 20, now) == []  # over or killed: the state says which
    finished = {"trainer-0": {"time": now - 1}, "simulator-0": {"time": now - 400, "progress": "finished env_steps=9"}}
    assert stalled_ranks(finished, 20, now) == []


def test_status_shows_an_eval_runs_result(tmp_path: Path) -> None:
    from vlaslurm.runtime.evaluate import EvalConfig, write_summary

    info = fake_run(tmp_path, {"simulator-0": (500, 0, "finished env_steps=90")})
    assert "eval " not in describe_run(info)  # a training run, or an eval not done yet
    parts = [{"pick": {"0": True, "1": False}}, {"pick": {"2": True}, "push": {"3": True}}]
    write_summary(Path(info.run_dir), "spec.yaml", EvalConfig(episodes=4), parts)
    line = next(x for x in describe_run(info).splitlines() if x.startswith("eval "))
    assert "success 0.75 over 4 episodes" in line and "pick 0.67" in line and "push 1.00" in line, line


def test_status_says_when_a_resume_skipped_a_checkpoint(tmp_path: Path) -> None:
    info = fake_run(tmp_path, {})
    assert "fallback" not in describe_run(info)
    rundir.append_checkpoint_fallback(
        Path(info.run_dir), "v00000002", {"v00000004": "model.safetensors: 4 bytes, the manifest says 1234"}
    )
    text = describe_run(info)
    assert "fallback resumed from v00000002 (v00000004 skipped: model.safetensors: 4 bytes" in text, text
