"""benchmarks/runtime_overhead.py's per-decision breakdown from the records the roles write: a hand-made lock-step
trace of two decisions of one sub-group, each part a known number of milliseconds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "runtime_overhead.py"


def load_script():
    spec = importlib.util.spec_from_file_location("runtime_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_request_and_reply_split_into_their_parts():
    ms = 1e-3
    # batch 1 [0, 8 ms], replies sent at 8.2, received at 8.5, chunk 1 [8.6, 16.6]; the next request stamped at
    # 16.9, arrives at 17.3, batch 2 starts at 17.4 (its record holds batch 1's reply time)
    batches = [
        {"t0": 0.0, "t1": 8 * ms, "v": 0, "g": [0], "req": [[0, 0, -1.0, -0.5 * ms]], "replied": [-1.0, -1.0]},
        {
            "t0": 17.4 * ms,
            "t1": 25 * ms,
            "v": 0,
            "g": [0],
            "req": [[0, 0, 16.9 * ms, 17.3 * ms]],
            "replied": [0.0, 8.2 * ms],
        },
    ]
    chunks = [
        {"t0": 8.6 * ms, "t1": 16.6 * ms, "g": 0, "rx": 8.5 * ms},
        {"t0": 25.5 * ms, "t1": 33.5 * ms, "g": 0, "rx": -1.0},  # its reply time is in no later record
    ]
    parts = load_script().breakdown(chunks, batches, lockstep=True)
    expected = {"request": 0.8, "sim": 0.3, "to gen": 0.4, "wait": 0.1, "out": 0.2, "to sim": 0.3, "hand": 0.1}
    for name, value in expected.items():
        assert parts[name] == pytest.approx(value, abs=1e-6), name
    assert parts["reply"] == pytest.approx((0.6 + 0.5) / 2) and parts["forward"] == pytest.approx((8 + 7.6) / 2)
