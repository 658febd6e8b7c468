"""`vlaslurm clean` and `vlaslurm runs` filters, on run directories built by hand (local runs: no Slurm)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import vlaslurm

from vlaslurm import rundir
from vlaslurm.cli.clean import parse_age

KEPT = ("run.json", "spec.yaml", "ledger.parquet", "metrics.jsonl", "exit_record.jsonl", "logs/trainer/0.log")


def make_run(
    root: Path,
    name: str,
    stamp: str,
    exit_code: Optional[int] = 0,
    ended_ago_s: float = 60,
    checkpoints: int = 4,
    sweep: Optional[str] = None,
    beating: bool = False,
) -> Path:
    """A finished (or, with exit_code None and a fresh heartbeat, running) local run with bulky folders."""
    run_dir = rundir.new_run_dir(root, name, stamp)
    info = rundir.RunInfo(
        name=name, run_dir=str(run_dir), kind="local", created=time.time() - ended_ago_s - 10, sweep=sweep
    )
    rundir.write_info(info)
    rundir.append_index(root, info)
    (run_dir / "spec.yaml").write_text("name: x\n")
    (run_dir / "ledger.parquet").write_bytes(b"L" * 100)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "logs" / "trainer").mkdir(parents=True)
    (run_dir / "logs" / "trainer" / "0.log").write_text("log\n")
    for folder, size in (("weights/v3", 5000), ("events", 700), ("rendezvous/42-r0", 50)):
        (run_dir / folder).mkdir(parents=True)
        (run_dir / folder / "data.bin").write_bytes(b"x" * size)
    for version in range(1, checkpoints + 1):
        ckpt = run_dir / "checkpoints" / f"v{version:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text("{}")
        (ckpt / "model.safetensors").write_bytes(b"m" * 1000)
    (run_dir / "checkpoints" / ".tmp-crashed").mkdir(parents=True)
    if exit_code is not None:
        end = time.time() - ended_ago_s
        (run_dir / "exit_record.jsonl").write_text(
            json.dumps({"step": "job", "exit_code": exit_code, "start": 0, "end": end, "restart": 0}) + "\n"
        )
    else:
        (run_dir / "exit_record.jsonl").write_text("")
    if beating:
        (run_dir / "heartbeats").mkdir()
        (run_dir / "heartbeats" / "trainer-0.json").write_text(json.dumps({"time": time.time()}))
    return run_dir


def test_parse_age() -> None:
    assert parse_age("90") == 90 and parse_age("30m") == 1800 and parse_age("7d") == 7 * 86400
    with pytest.raises(ValueError, match="7d"):
        parse_age("a week")


def test_clean_one_run_keeps_what_status_and_compare_need(tmp_path: Path) -> None:
    run = make_run(tmp_path, "exp", "20260101-000000")
    dry = vlaslurm("clean", str(run), "--keep-checkpoints", "1", "--dry-run", runs_root=tmp_path)
    assert dry.returncode == 0, dry.stderr
    for shown in ("weights", "events", "rendezvous", "checkpoints/v00000001", "checkpoints/.tmp-crashed", "would free"):
        assert shown in dry.stdout
    assert "checkpoints/v00000004" not in dry.stdout and (run / "weights").exists()  # a dry run deletes nothing
    proc = vlaslurm("clean", str(run), "--keep-checkpoints", "1", "--yes", runs_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not any((run / d).exists() for d in ("weights", "events", "rendezvous", "checkpoints/.tmp-crashed"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v00000004"]
    assert all((run / k).exists() for k in KEPT)
    assert "freed" in proc.stdout


def test_without_keep_checkpoints_every_checkpoint_stays_and_logs_only_when_told(tmp_path: Path) -> None:
    run = make_run(tmp_path, "exp", "20260101-000000")
    assert vlaslurm("clean", "exp", "--yes", runs_root=tmp_path).returncode == 0  # RUN by name
    assert len(list((run / "checkpoints").glob("v*"))) == 4 and (run / "logs").exists()
    assert vlaslurm("clean", "exp", "--logs", "--yes", runs_root=tmp_path).returncode == 0
    assert not (run / "logs").exists()


def test_clean_asks_first_and_refuses_without_a_terminal(tmp_path: Path) -> None:
    run = make_run(tmp_path, "exp", "20260101-000000")
    proc = vlaslurm("clean", str(run), runs_root=tmp_path)  # stdin is not a terminal here
    assert proc.returncode == 2 and "--yes" in proc.stderr
    assert (run / "weights").exists()


def test_running_runs_are_never_cleaned(tmp_path: Path) -> None:
    running = make_run(tmp_path, "live", "20260101-000000", exit_code=None, beating=True)
    proc = vlaslurm("clean", str(running), "--keep-checkpoints", "0", "--yes", runs_root=tmp_path)
    assert proc.returncode == 0 and "RUNNING" in proc.stdout and "nothing to clean" in proc.stdout
    assert (running / "weights").exists() and len(list((running / "checkpoints").glob("v*"))) == 4


def test_older_than_picks_finished_runs_that_ended_long_ago(tmp_path: Path) -> None:
    old = make_run(tmp_path, "a", "20260101-000000", ended_ago_s=10 * 86400)
    failed = make_run(tmp_path, "b", "20260101-000000", exit_code=3, ended_ago_s=8 * 86400)
    new = make_run(tmp_path, "c", "20260101-000000", ended_ago_s=3600)
    live = make_run(tmp_path, "d", "20260101-000000", exit_code=None, beating=True)
    proc = vlaslurm("clean", "--older-than", "7d", "--yes", runs_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (old / "weights").exists() and not (failed / "weights").exists()
    assert (new / "weights").exists() and (live / "weights").exists()
    both = vlaslurm("clean", "a", "--older-than", "7d", runs_root=tmp_path)
    assert both.returncode == 2 and "not both" in both.stderr


def test_runs_filters_by_state_name_and_sweep(tmp_path: Path) -> None:
    make_run(tmp_path, "exp", "20260101-000000", sweep="exp-sweep-1")
    make_run(tmp_path, "exp", "20260101-000001", exit_code=2, sweep="exp-sweep-1")
    make_run(tmp_path, "other", "20260101-000000")

    def listed(*args: str) -> int:
        proc = vlaslurm("runs", *args, runs_root=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return sum(" local " in line for line in proc.stdout.splitlines())  # one row per run (kind column)

    assert listed() == 3
    assert listed("--sweep", "exp-sweep-1") == 2
    assert listed("--state", "failed") == 1 and listed("--state", "COMPLETED") == 2
    assert listed("--name", "other") == 1 and listed("--name", "exp", "--state", "completed") == 1
    status = vlaslurm("status", "exp-sweep-1", runs_root=tmp_path)  # a sweep name: every run of it
    assert status.returncode == 0 and status.stdout.count("state    ") == 2
    clean = vlaslurm("clean", "exp-sweep-1", "--dry-run", runs_root=tmp_path)
    assert clean.returncode == 0 and "in 2 run(s)" in clean.stdout
