"""What each rank writes about itself: an event log, counters and a heartbeat.

All three are small enough to keep on for every run. Times are on the run's
clock (seconds since the run was created), so events of different hosts line up.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from vlaslurm.rundir.checked import DamagedRunDir, Shape, read_json, read_json_object, read_text, records
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
        self._gauges: List[Callable[[], Dict[str, float]]] = []

    def busy(self, seconds: float) -> None:
        self.busy_s += seconds

    def add(self, name: str, amount: float = 1.0) -> None:
        self.values[name] = self.values.get(name, 0.0) + amount

    def set(self, name: str, value: float) -> None:
        self.values[name] = value

    def gauge(self, read: Callable[[], Dict[str, float]]) -> None:
        """Counters that `read` returns, read when the counters are written rather than set on every turn of a
        role's loop (e.g. what its sockets rejected)."""
        self._gauges.append(read)

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
        for read in self._gauges:
            out.update(read())
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

    @contextlib.contextmanager
    def during(self, version: Optional[int], progress: str) -> Iterator[None]:
        """Beat from a thread while the block runs: work that holds the rank's loop for longer than others wait
        for it (a large model's update) still shows the rank alive (`beat_age_s`)."""
        done = threading.Event()

        def keep_beating() -> None:
            while not done.wait(self.every_s):
                self.beat(version, progress, force=True)

        self.beat(version, progress, force=True)
        thread = threading.Thread(target=keep_beating, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


def beat_age_s(run_dir: Path, role: str, rank: int) -> Optional[float]:
    """Seconds since a rank's last heartbeat (wall clocks: across nodes, as far as they agree); None if it has
    none, or a damaged one."""
    try:
        beat = read_heartbeat(RunDir(run_dir).heartbeat(role, rank))
    except DamagedRunDir:
        return None
    return None if beat is None else time.time() - float(beat["time"])


HEARTBEAT_KEYS: Shape = {"time": (int, float), "progress": str}
EXIT_KEYS: Shape = {"step": str, "exit_code": int, "start": (int, float), "end": (int, float)}
RESTART_KEYS: Shape = {"role": str, "rank": int, "restart": int, "exit_code": int}
EVAL_KEYS: Shape = {"success": dict, "outcomes": dict, "episodes_per_task": dict}


def write_final_summary(run_dir: Path, versions: int, env_steps: int, ended_by: str, checksum: str) -> None:
    """The trainer's last word on a finished run (what `final_env_steps` reads), written atomically."""
    summary = {"versions": versions, "env_steps": env_steps, "ended_by": ended_by, "checksum": checksum}
    write_atomic(RunDir(run_dir).final, json.dumps(summary).encode(), mode=0o644)


def final_env_steps(run_dir: Path) -> int:
    """The env steps a run's final summary (its trainer's last word) says it ended at; -1 without one, or with
    one that is damaged or does not say (summaries written before they recorded it)."""
    try:
        summary = read_json(RunDir(run_dir).final)
    except DamagedRunDir:
        return -1
    steps = summary.get("env_steps") if isinstance(summary, dict) else None
    return int(steps) if isinstance(steps, (int, float)) and not isinstance(steps, bool) else -1


def read_heartbeat(path: Path) -> Optional[Dict[str, Any]]:
    """One heartbeat file ({time, version, progress}), None if it is missing (written atomically, so never
    half written); DamagedRunDir if it is there but not a heartbeat."""
    return read_json_object(Path(path), HEARTBEAT_KEYS)


def read_heartbeats(run_dir: Path, role: str = "*") -> Dict[str, Dict[str, Any]]:
    """`<role>-<rank>` -> its last heartbeat, for every readable heartbeat of `role` (all roles by default);
    missing or damaged ones are left out (readers that must name a damaged one use `read_heartbeat`)."""
    beats = {}
    for path in RunDir(run_dir).heartbeat_files(role):
        try:
            beat = read_heartbeat(path)
        except DamagedRunDir:
            continue
        if beat is not None:
            beats[path.stem] = beat
    return beats


def exit_records(run_dir: Path) -> List[dict]:
    """The steps' exit lines (batch script or local launcher; torn lines from a killed job are skipped,
    a line of the wrong shape raises DamagedRunDir)."""
    return records(RunDir(run_dir).exit_record, EXIT_KEYS)


def append_exit_record(run_dir: Path, record: Dict[str, Any]) -> None:
    append_line(RunDir(run_dir).exit_record, json.dumps(record))


def job_outcome(run_dir: Path) -> Optional[int]:
    """The job's exit code from the exit record of its latest restart, or None if it has not ended."""
    jobs = [r for r in exit_records(run_dir) if r.get("step") == "job"]
    return jobs[-1]["exit_code"] if jobs else None


def restart_records(run_dir: Path) -> List[dict]:
    """One line per worker restart (`runtime.worker`'s supervisor; torn lines skipped, DamagedRunDir for a line of
    the wrong shape)."""
    return records(RunDir(run_dir).restarts, RESTART_KEYS)


def append_restart(run_dir: Path, record: Dict[str, Any]) -> None:
    append_line(RunDir(run_dir).restarts, json.dumps(record))


def checkpoint_fallbacks(run_dir: Path) -> List[dict]:
    """Resumes that skipped checkpoints which did not verify, oldest first (`runtime.checkpoint.resume_point`):
    each {"time", "resumed_from": "v<version>" or None, "skipped": [{"checkpoint": "v<version>", "reason"}]}."""
    return read_jsonl(RunDir(run_dir).checkpoint_fallbacks)


def append_checkpoint_fallback(run_dir: Path, resumed_from: Optional[str], skipped: Dict[str, str]) -> None:
    """Record that a resume skipped `skipped` ({checkpoint folder name: why}) and took `resumed_from`."""
    path = RunDir(run_dir).checkpoint_fallbacks
    path.parent.mkdir(mode=0o700, exist_ok=True)
    reasons = [{"checkpoint": name, "reason": why} for name, why in skipped.items()]
    append_line(path, json.dumps({"time": time.time(), "resumed_from": resumed_from, "skipped": reasons}))


def checkpoint_fallback_line(run_dir: Path) -> Optional[str]:
    """The latest fallback in one line (for `status`), None if no resume ever skipped a checkpoint."""
    records = checkpoint_fallbacks(run_dir)
    if not records:
        return None
    last = records[-1]
    skipped = "; ".join(f"{s['checkpoint']} skipped: {s['reason']}" for s in last["skipped"])
    return f"resumed from {last['resumed_from'] or 'nothing'} ({skipped})"


def read_metrics(run_dir: Path) -> List[dict]:
    """The trainer's metric lines, one per update (torn lines skipped, DamagedRunDir for a line that is no object)."""
    return records(RunDir(run_dir).metrics, {})


def append_metrics(run_dir: Path, record: Dict[str, Any]) -> None:
    append_line(RunDir(run_dir).metrics, json.dumps(record))


def keep_metrics_through(run_dir: Path, version: int) -> List[Dict[str, Any]]:
    """Forget the metric lines past policy `version` (a resume from its checkpoint redoes them); a line that a crash
    tore goes too. Rewritten atomically: a crash now leaves the old lines or the kept ones. Returns the kept lines."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return []
    kept = [r for r in read_metrics(run_dir) if r.get("version", 0) <= version]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode(), mode=0o644)
    return kept


def write_table(path: Path, frame: Any) -> None:
    """Write a pandas frame as parquet atomically (a reader never sees half a file)."""
    import io

    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    write_atomic(Path(path), buffer.getvalue(), mode=0o644)


def read_ledger(run_dir: Path) -> Any:
    """The version-lag ledger of a run (a pandas frame; one row per segment the trainer received)."""
    import pandas as pd

    path = RunDir(run_dir).ledger
    if path.is_dir():
        raise DamagedRunDir(path, "is a directory, not a file")
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        if isinstance(exc, FileNotFoundError):
            raise
        raise DamagedRunDir(path, f"not a parquet table ({type(exc).__name__})") from None


def read_resolved_spec(run_dir: Path) -> Dict[str, Any]:
    """The resolved spec a run used (`spec.yaml`) as a plain mapping, {} if absent: for flattening into
    tracking params and tags. Code that acts on the spec loads it typed (`spec.load_spec(RunDir(d).spec)`)."""
    import yaml

    path = RunDir(run_dir).spec
    text = read_text(path)
    try:
        spec = yaml.safe_load(text or "") or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise DamagedRunDir(path, "not YAML" + (f" (line {mark.line + 1})" if mark else "")) from None
    if not isinstance(spec, dict):
        raise DamagedRunDir(path, f"not a mapping of spec sections (a {type(spec).__name__})")
    return spec


def read_eval(run_dir: Path) -> Optional[Dict[str, Any]]:
    """An eval run's result (`RunDir.eval`: success and episodes per task, each episode's outcome), None before
    it is written; DamagedRunDir if it is there but not such a result."""
    path = RunDir(run_dir).eval
    summary = read_json_object(path, EVAL_KEYS)
    if summary is None:
        return None
    for task, episodes in summary["outcomes"].items():
        if not isinstance(episodes, dict):
            raise DamagedRunDir(path, f"outcomes of {task!r} are not episode: success")
    for task, rate in summary["success"].items():
        if not isinstance(rate, (int, float)) or task not in summary["episodes_per_task"]:
            raise DamagedRunDir(path, f"success of {task!r} is {rate!r} (or it has no episodes_per_task)")
    return summary
