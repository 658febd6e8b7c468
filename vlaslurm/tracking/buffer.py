"""The tracker's bounded buffer of metric rows.

A row is what one MLflow `log_batch` call can carry for one step: a dict of
values, the step (env steps) and a timestamp. The buffer never grows past its
capacity: when it is full the oldest row is dropped, and the drop is counted so
the loss is visible (the tracker logs the count as `tracking/dropped_rows`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional


@dataclass
class Row:
    """Metric values of one step."""

    metrics: Dict[str, float]
    step: int
    timestamp_ms: int
    line: Optional[int] = None  # its line in the metrics file, when it came from there
    eval_line: Optional[int] = None  # its line in the evals log, when it came from there


class RowBuffer:
    """A thread-safe FIFO of rows, bounded at `capacity` rows (the oldest are dropped first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.dropped_rows = 0
        self.dropped_values = 0
        self._rows: Deque[Row] = deque()
        self._lock = threading.Lock()

    def put(self, row: Row) -> None:
        """Add a row; never blocks longer than a lock, never grows past capacity."""
        with self._lock:
            if len(self._rows) >= self.capacity:
                old = self._rows.popleft()
                self.dropped_rows += 1
                self.dropped_values += len(old.metrics)
            self._rows.append(row)

    def head(self, max_values: int) -> List[Row]:
        """The oldest rows holding at most `max_values` values together (at least one row if any)."""
        out: List[Row] = []
        total = 0
        with self._lock:
            for row in self._rows:
                if out and total + len(row.metrics) > max_values:
                    break
                out.append(row)
                total += len(row.metrics)
        return out

    def pop(self, rows: List[Row]) -> None:
        """Remove rows returned by `head` once sent (those dropped meanwhile are already gone)."""
        sent = {id(r) for r in rows}
        with self._lock:
            while self._rows and id(self._rows[0]) in sent:
                self._rows.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)
