"""Follow what a run already writes, off the training path.

The trainer appends one row per update to its metrics file, evaluations while
training one line each to the evals log, and every rank rewrites its counters
file every few seconds. The follower turns new metrics and evals lines and
changed counter files into rows for the tracker (evaluations as `eval/...` at
the env steps of the version evaluated), and names the new failure GIFs under
`failures/<task>/` and `evals/v<version>/failures/<task>/` (each once) for
upload, so tracking needs no hook in any training loop.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from vlaslurm.rundir import RunDir
from vlaslurm.tracking.buffer import Row

SYSTEM_PREFIX = "system/"  # MLflow's UI shows these keys in its "System metrics" tab
EVAL_PREFIX = "eval/"  # evaluations while training


def numeric(values: Mapping[str, object], prefix: str = "") -> Dict[str, float]:
    """The finite numbers of a dict, keyed `prefix + key` (MLflow keeps no NaN, text or None)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[prefix + key] = float(value)
    return out


class RunFollower:
    """Reads new metric lines and changed counter files of one run directory."""

    def __init__(self, run_dir: Path, start_line: int = 0, start_eval_line: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.line = 0  # lines of the metrics file read so far
        # Lines an earlier tracker of this run sent. A trainer resumed from a checkpoint cuts the file
        # back to the checkpoint's rows (a prefix of what was sent): those stay skipped, new ones are sent.
        self.skip = min(start_line, _count_lines(RunDir(self.run_dir).metrics))
        self.env_steps = 0  # the newest env step count seen: the step of system metrics
        self._offset = 0
        self._counter_mtimes: Dict[Path, float] = {}
        self._failures_seen: Set[Path] = set()
        self._evals_offset = 0
        self.eval_line = 0  # lines of the evals log read so far; the first `eval_skip` an earlier tracker sent
        self.eval_skip = start_eval_line

    def poll(self) -> List[Row]:
        """Rows for everything new since the last poll."""
        return self.metrics_rows() + self.eval_rows() + self.counter_rows()

    def eval_rows(self) -> List[Row]:
        """One row per finished evaluation while training, at the env steps its version was trained on."""
        lines, self._evals_offset, mtime = _new_lines(RunDir(self.run_dir).evals_log, self._evals_offset)
        rows = []
        for line, values in _numbered(lines, self.eval_line):
            if isinstance(values, dict) and line > self.eval_skip:
                when, step = int(mtime * 1000), int(values.get("env_steps", 0))
                rows.append(Row(numeric(values, EVAL_PREFIX), step, when, eval_line=line))
        self.eval_line += len(lines)
        return rows

    def metrics_rows(self) -> List[Row]:
        lines, self._offset, mtime = _new_lines(RunDir(self.run_dir).metrics, self._offset)
        parsed = _numbered(lines, self.line)
        self.line += len(lines)
        return self._rows(parsed, mtime)

    def _rows(self, parsed: List[tuple], mtime: float) -> List[Row]:
        """Timestamps from the file's mtime (the newest row) minus each row's wall-time distance to it."""
        if not parsed:
            return []
        last_wall = _float(parsed[-1][1].get("wall_s"))
        rows = []
        for line, values in parsed:
            self.env_steps = int(values.get("env_steps", self.env_steps))
            if line <= self.skip:
                continue
            wall = _float(values.get("wall_s"))
            when = mtime - (last_wall - wall if last_wall is not None and wall is not None else 0.0)
            rows.append(Row(numeric(values), self.env_steps, int(when * 1000), line=line))
        return rows

    def new_failures(self) -> List[Path]:
        """Failure GIFs that appeared since the last call (written whole: a temporary name, then renamed)."""
        layout = RunDir(self.run_dir)
        found = set(layout.failures.glob("*/*.gif")) | set(layout.evals.glob(f"*/{layout.failures.name}/*/*.gif"))
        found -= self._failures_seen
        self._failures_seen |= found
        return sorted(found)

    def counter_rows(self) -> List[Row]:
        rows = []
        for path in sorted(RunDir(self.run_dir).counters.glob("*.json")):
            try:
                mtime = path.stat().st_mtime
                if self._counter_mtimes.get(path) == mtime:
                    continue
                values = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # replaced or half-visible: read it on the next poll
            self._counter_mtimes[path] = mtime
            metrics = numeric(values, f"{SYSTEM_PREFIX}{path.stem}/")
            if metrics:
                rows.append(Row(metrics, self.env_steps, int(mtime * 1000)))
        return rows


def _numbered(lines: List[bytes], before: int) -> List[Tuple[int, Any]]:
    """(line number, value) of each of `lines` that parses as JSON, numbered on from `before` lines (a line being
    written, or damaged, keeps its number and is left out)."""
    out = []
    for number, raw in enumerate(lines, before + 1):
        try:
            out.append((number, json.loads(raw)))
        except json.JSONDecodeError:
            continue
    return out


def _new_lines(path: Path, offset: int) -> Tuple[List[bytes], int, float]:
    """The complete lines of `path` after byte `offset`, the offset after them, and the file's mtime (a line still
    being written is read next time; no file: nothing)."""
    if not path.exists():
        return [], offset, 0.0
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
        mtime = path.stat().st_mtime
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), offset + end, mtime


def _float(value: object) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) else None


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0
