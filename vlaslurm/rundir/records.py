"""What each rank writes about itself: an event log, counters and a heartbeat.

All three are small enough to keep on for every run. Times are on the run's
clock (seconds since the run was created), so events of different hosts line up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from vlaslurm.rundir.files import append_line, read_jsonl, write_atomic
from vlaslurm.rundir.layout import RunDir


class EventLog:
    """Buffered JSON lines in `<run>/events/<role>-<rank>.jsonl` (appended, so restarts keep history)."""

    def __init__(self, run_dir: Path, role: str, rank: int, flush_every: int = 512) -> None:
        self.path = RunDir(run_dir).event_log(role, rank)
        self.path.parent.mkdir(exist_ok=True)
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


def read_events(run_dir: Path, pattern: str = "*.jsonl") -> List[dict]:
    """Every event of a run (lines torn by a crash are skipped)."""
    return [event for path in sorted(RunDir(run_dir).events.glob(pattern)) for event in read_jsonl(path)]


class Counters:
    """Per-rank counters: utilisation (busy over wall time), queue lengths, batch sizes, latency."""

    def __init__(self, run_dir: Path, role: str, rank: int, every_s: float = 2.0) -> None:
        self.path = RunDir(run_dir).counter(role, rank)
        self.path.parent.mkdir(exist_ok=True)
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
        import numpy as np  # the CLI reads run directories without loading numpy

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
        self.path = RunDir(run_dir).heartbeat(role, rank)
        self.path.parent.mkdir(exist_ok=True)
        self.every_s = every_s
        self._last = 0.0

    def beat(self, version: Optional[int], progress: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            write_atomic(
                self.path,
                json.dumps({"time": time.time(), "version": version, "progress": progress}).encode(),
                mode=0o644,
            )
            self._last = now


def read_heartbeat(path: Path) -> Optional[Dict[str, Any]]:
    """One heartbeat file ({time, version, progress}), None if it is missing or half written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def exit_records(run_dir: Path) -> List[dict]:
    """The steps' exit lines (batch script or local launcher; torn lines from a killed job are skipped)."""
    return read_jsonl(RunDir(run_dir).exit_record)


def append_exit_record(run_dir: Path, record: Dict[str, Any]) -> None:
    append_line(RunDir(run_dir).exit_record, json.dumps(record))


def job_outcome(run_dir: Path) -> Optional[int]:
    """The job's exit code from the exit record of its latest restart, or None if it has not ended."""
    jobs = [r for r in exit_records(run_dir) if r.get("step") == "job"]
    return jobs[-1]["exit_code"] if jobs else None


def restart_records(run_dir: Path) -> List[dict]:
    """One line per worker restart (`runtime.worker`'s supervisor)."""
    return read_jsonl(RunDir(run_dir).restarts)


def append_restart(run_dir: Path, record: Dict[str, Any]) -> None:
    append_line(RunDir(run_dir).restarts, json.dumps(record))


def read_metrics(run_dir: Path) -> List[dict]:
    """The trainer's metric lines, one per update."""
    return read_jsonl(RunDir(run_dir).metrics)


def append_metrics(run_dir: Path, record: Dict[str, Any]) -> None:
    append_line(RunDir(run_dir).metrics, json.dumps(record))


def write_table(path: Path, frame: Any) -> None:
    """Write a pandas frame as parquet atomically (a reader never sees half a file)."""
    import io

    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    write_atomic(Path(path), buffer.getvalue(), mode=0o644)


def read_ledger(run_dir: Path) -> Any:
    """The version-lag ledger of a run (a pandas frame; one row per segment the trainer received)."""
    import pandas as pd

    return pd.read_parquet(RunDir(run_dir).ledger)


def read_resolved_spec(run_dir: Path) -> Dict[str, Any]:
    """The resolved spec a run used (`spec.yaml`) as a plain mapping, {} if absent: for flattening into
    tracking params and tags. Code that acts on the spec loads it typed (`spec.load_spec(RunDir(d).spec)`)."""
    import yaml

    path = RunDir(run_dir).spec
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
