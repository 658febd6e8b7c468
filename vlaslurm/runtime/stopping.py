"""When a run may end before `rollout.total_env_steps`: its success rate reached `rollout.stop_at_success`."""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, Iterable, Mapping, Optional, Tuple

SUCCESS_KEY, EPISODES_KEY = "rollout/success_rate", "rollout/episodes"  # of the trainer's progress reports


class SuccessTarget:
    """The success rate over the episodes of the last `window` progress reports that saw any, against `target`.

    Weighted by episodes, not a mean of the reports' rates: a report over 3 episodes weighs what 3 episodes do.
    """

    def __init__(self, target: Optional[float], window: int = 3) -> None:
        self.target, self.window = target, window
        self.reports: Deque[Tuple[int, int]] = deque(maxlen=window)  # (successes, episodes)

    def add(self, successes: int, episodes: int) -> None:
        if episodes > 0:
            self.reports.append((successes, episodes))

    def add_reports(self, rows: Iterable[Mapping]) -> None:
        """Add the trainer's progress reports as the run's metric lines hold them (`SUCCESS_KEY`, `EPISODES_KEY`):
        a resumed run's window goes on from the reports before its checkpoint instead of starting empty."""
        for row in rows:
            episodes, rate = int(row.get(EPISODES_KEY) or 0), row.get(SUCCESS_KEY)
            if episodes > 0 and isinstance(rate, (int, float)) and math.isfinite(rate):
                self.add(round(rate * episodes), episodes)

    @property
    def rate(self) -> Optional[float]:
        """The success rate over the window, once it is full."""
        if len(self.reports) < self.window:
            return None
        return sum(s for s, _ in self.reports) / sum(e for _, e in self.reports)

    @property
    def reached(self) -> bool:
        rate = self.rate
        return self.target is not None and rate is not None and rate >= self.target

    def describe(self) -> str:
        episodes = sum(e for _, e in self.reports)
        return (
            f"success {self.rate:.3f} over the {episodes} episodes of the last {self.window} reports reached "
            f"rollout.stop_at_success {self.target}"
        )
