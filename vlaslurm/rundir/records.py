"""What each rank writes about itself: an event log, counters and a heartbeat.

All three are small enough to keep on for every run. Times are on the run's
clock (seconds since the run was created), so events of different hosts line up.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from vlaslurm.runtime.rendezvous import write_atomic


class EventLog:
    """Buffered JSON lines in `<run>/events/<role>-<rank>.jsonl` (appended, so restarts keep history)."""

    def __init__(self, run_dir: Path, role: str, rank: int, flush_every: int = 512) -> None:
        directory = Path(run_dir) / "events"
        directory.mkdir(exist_ok=True)
        self.path = directory / f"{role}-{rank}.jsonl"
        self.role, self.rank = role, rank
        self.flush_every = flush_every
        self._lines: List[str] = []

    def add(self, kind: str, **fields: Any) -> None:
        self._lines.append(json.dumps({"ev": kind, "role": self.role, "rank": self.rank, **fields}))
        if len(self._lines) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            with self.path.open("a") as handle:
                handle.write("\n".join(self._lines) + "\n")
            self._lines.clear()


def read_jsonl(path: Path) -> List[dict]:
    """The records of a JSON-lines file, [] if it does not exist (lines torn by a crash are skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_events(run_dir: Path, pattern: str = "*.jsonl") -> List[dict]:
    """Every event of a run (lines torn by a crash are skipped)."""
    return [event for path in sorted((Path(run_dir) / "events").glob(pattern)) for event in read_jsonl(path)]


class Counters:
    """Per-rank counters: utilisation (busy over wall time), queue lengths, batch sizes, latency."""

    def __init__(self, run_dir: Path, role: str, rank: int, every_s: float = 2.0) -> None:
        directory = Path(run_dir) / "counters"
        directory.mkdir(exist_ok=True)
        self.path = directory / f"{role}-{rank}.json"
        self.started = time.monotonic()
        self.every_s = every_s
        self._last_write = 0.0
        self.busy_s = 0.0
        self.values: Dict[str, float] = {}
        self._samples: Dict[str, List[float]] = {}

    def busy(self, seconds: float) -> None:
        self.busy_s += seconds

    def add(self, name: str, amount: float = 1.0) -> None:
        self.values[name] = self.values.get(name, 0.0) + amount

    def set(self, name: str, value: float) -> None:
        self.values[name] = value

    def sample(self, name: str, value: float, keep: int = 20000) -> None:
        samples = self._samples.setdefault(name, [])
        if len(samples) >= keep:
            samples.pop(0)
        samples.append(value)

    def snapshot(self) -> Dict[str, float]:
        wall = time.monotonic() - self.started
        out = {"wall_s": wall, "busy_s": self.busy_s, "utilisation": self.busy_s / wall if wall > 0 else 0.0}
        out.update(self.values)
        for name, samples in self._samples.items():
            if samples:
                arr = np.asarray(samples)
                out[f"{name}_mean"] = float(arr.mean())
                out[f"{name}_p50"] = float(np.percentile(arr, 50))
                out[f"{name}_p99"] = float(np.percentile(arr, 99))
        return out

    def maybe_write(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_write >= self.every_s:
            write_atomic(self.path, json.dumps(self.snapshot()).encode(), mode=0o644)
            self._last_write = now


class Heartbeat:
    """`<run>/heartbeats/<role>-<rank>.json`: last sign of life, version and progress."""

    def __init__(self, run_dir: Path, role: str, rank: int, every_s: float = 2.0) -> None:
        directory = Path(run_dir) / "heartbeats"
        directory.mkdir(exist_ok=True)
        self.path = directory / f"{role}-{rank}.json"
        self.every_s = every_s
        self._last = 0.0

    def beat(self, version: Optional[int], progress: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            write_atomic(self.path, json.dumps({"time": time.time(), "version": version,
                                                "progress": progress}).encode(), mode=0o644)
            self._last = now
