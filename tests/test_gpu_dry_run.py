"""The GPU verification script (benchmarks/gpu/run.sh, issue 21) rehearsed on the CPU: `--dry-run` runs every step
at toy size, each in its own process under its own time limit, and leaves gpu.json and gpu.md with every step's
figures. On a GPU machine the same steps run at full size (benchmarks/gpu/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "benchmarks" / "gpu" / "run.sh"
STEPS = ("environment", "weight_sync", "offload", "models", "trainer", "maniskill", "pi0")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dry_run_writes_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(RUN), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=230
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["meta"]["dry_run"] is True and results["meta"]["commit"] and results["meta"]["date"]
    steps = results["steps"]
    assert list(steps) == list(STEPS)
    for name, step in steps.items():
        assert step["status"] in ("ok", "skipped"), (name, step)
        assert step["dry_run"] is True and step["elapsed_s"] <= step["budget_s"] + 3
        assert "mlflow" not in step["imported"], name  # MLflow stays out of every step
    assert set(steps["environment"]["torch"]) >= {"torch", "cuda_build", "device_count", "nccl_available"}
    assert "nvml" in steps["environment"] and "nvidia_smi" in steps["environment"]
    assert "omegaconf" not in steps["environment"]["imported"] + steps["weight_sync"]["imported"]

    sync = steps["weight_sync"]
    assert set(sync["hardware"]) >= {"d2d_GBps", "d2h_GBps", "h2d_GBps"}
    assert "NCCL cannot put two ranks on one device" in sync["nccl_broadcast"]
    assert list(sync["sizes"]) == ["0.5B", "3B", "7.5B"]
    for row in sync["sizes"].values():
        assert row["pinned"]["goal"] == 0.8 and row["pinned"]["fraction_of_pinned"] > 0
        assert row["nccl_packing"]["fraction_of_d2d"] > 0 and row["filesystem"]["seconds"] > 0

    offload = steps["offload"]
    assert offload["parameters"] > 0 and {"peak_without_gib", "peak_with_gib"} <= set(offload)
    assert sorted((m["role"], m["kind"]) for m in offload["moves"]) == [
        ("generator", "offload"),
        ("generator", "onload"),
        ("trainer", "offload"),
        ("trainer", "onload"),
    ]

    models = steps["models"]
    assert "skipped" in models["towers"] or models["towers"]["equal"] is True
    assert [(r["model"], r["batch"], r["status"]) for r in models["forward"]["rows"]] == [
        ("openvla", 1, "ok"),
        ("openvla-oft", 1, "ok"),
        ("openvla", 2, "ok"),
        ("openvla-oft", 2, "ok"),
    ]
    assert (tmp_path / "gpu_vla_forward_tiny.json").exists()

    trainer = steps["trainer"]
    for key in ("checkpointing_off", "checkpointing_on"):
        assert trainer[key]["samples_per_s"] > 0 and trainer[key]["parameters"] > 0, trainer[key]
    assert trainer["group"]["world_size"] == 1
    assert "needs a GPU" in trainer["cpu_offload"]["skipped"]  # FSDP2's offload has no CPU rehearsal

    assert steps["maniskill"]["status"] == "ok" or "mani_skill is not importable" in steps["maniskill"]["reason"]

    pi0 = steps["pi0"]  # the tiny π0 here; the full-size one (3,501,372,176 parameters) on the GPU
    assert [(r["batch"], r["status"]) for r in pi0["rows"]] == [(1, "ok"), (8, "ok"), (32, "ok")], pi0
    assert all(r["chunk_ms"] > 0 for r in pi0["rows"]) and pi0["denoise_steps"] == 10

    md = (tmp_path / "gpu.md").read_text()
    assert md.startswith("# GPU verification (DRY RUN")
    for name in STEPS:
        assert f"## {name}: " in md
    assert "commit:" in md and "date:" in md and (tmp_path / "gpu.log").exists()
