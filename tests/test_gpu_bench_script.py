"""benchmarks/gpu_vla_forward.py, the GPU benchmark of the full-size VLAs, tested here on its `--tiny` path (the same
code over the tiny release config, on the CPU): it runs as a script, writes the JSON and the table with every field,
respects its time budget, and refuses to run without CUDA (code 2) rather than build 7B on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_vla_forward.py"
ROW_FIELDS = {
    "model",
    "batch",
    "status",
    "seq_len",
    "prefill_ms",
    "decision_ms",
    "decision_ms_all",
    "decisions_per_s",
    "env_actions_per_s",
    "prefill_tokens_per_s",
    "llm_tflops",
    "peak_gib",
    "wall_s",
}


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_vla_forward", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_results(tmp_path):
    args = ["--tiny", "--batches", "2", "1", "--warmup", "0", "--iters", "2", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_vla_forward_tiny.json").read_text())
    meta = results["meta"]
    assert meta["tiny"] and meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["gpu"] is None
    assert meta["batches"] == [1, 2] and meta["iters"] == 2 and meta["attn_implementation"] == "sdpa"
    assert meta["oft_shape"] == {"chunk": 8, "action_dim": 7, "proprio_dim": 8} and meta["oft_cameras"] == 2
    params = meta["parameters"]
    assert params["openvla-oft"] == params["openvla"] + params["l1_head"] + params["proprio_projector"]
    rows = results["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("openvla", 1),
        ("openvla-oft", 1),
        ("openvla", 2),
        ("openvla-oft", 2),
    ]
    for row in rows:
        assert set(row) == ROW_FIELDS and row["status"] == "ok" and row["peak_gib"] is None
        assert len(row["decision_ms_all"]) == 2 and row["decision_ms"] > 0
        per_decision = 1 if row["model"] == "openvla" else 8
        assert row["env_actions_per_s"] == pytest.approx(row["decisions_per_s"] * per_decision)
        assert row["decisions_per_s"] == pytest.approx(row["batch"] * 1000 / row["decision_ms"])
    openvla, oft = rows[0], rows[1]
    assert openvla["prefill_ms"] <= openvla["decision_ms"]  # the decode steps come on top of the prefill
    # <bos> + 256 patches + the prompt; OFT: + a second camera, the proprio token, 56 action slots and </s>
    assert openvla["seq_len"] == 32 + 256 and oft["seq_len"] == 32 + 2 * 256 + 1 + 56 + 1
    assert not results["stopped_early"] and results["total_s"] > 0
    table = (tmp_path / "gpu_vla_forward_tiny.md").read_text()
    assert "| model | batch | seq |" in table and table.count("| ok |") == 4
    assert "| openvla-oft | 2 | 602 |" in table
    assert table in done.stdout  # the table is printed as well


def test_budget_stops_early(tmp_path):
    script = load_script()
    assert script.main(["--tiny", "--batches", "1", "8", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_vla_forward_tiny.json").read_text())
    assert results["stopped_early"]
    assert {r["status"] for r in results["rows"]} == {"skipped: budget"} and len(results["rows"]) == 4
    assert "skipped: budget" in (tmp_path / "gpu_vla_forward_tiny.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the full-size run would start")
def test_without_cuda_exits_2(tmp_path, capsys):
    assert load_script().main(["--batches", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--tiny" in err
    assert not list(tmp_path.iterdir())  # nothing built, nothing written
