"""The version-lag ledger: one row per segment the trainer received.

A segment is a trajectory, or a piece of one for long episodes or where the
policy version changed mid-episode. `lag = consumed_version - behavior_version`;
`used` says whether the segment went into an update (False: dropped as too
stale, or still buffered when the run ended, with consumed_version -1).
`step_ids` are the episode steps at which each of its decisions started (so a
row can be checked against what the generators recorded serving), and `digest`
a hash of its observations' state, actions, rewards and masks (equal digests:
the same trajectory).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List

import numpy as np
import pandas as pd

from vlaslurm.rundir import RunDir, read_ledger, write_table
from vlaslurm.runtime.messages import Segment

COLUMNS = [
    "traj_id",
    "env_id",
    "episode",
    "segment",
    "task",
    "behavior_version",
    "consumed_version",
    "lag",
    "steps",
    "success",
    "terminated",
    "truncated",
    "scored",
    "used",
    "dropped",
    "t_start",
    "t_end",
    "t_consumed",
    "sim_rank",
    "step_ids",
    "digest",
]


class Ledger:
    """Rows kept in memory and written atomically (a reader never sees half a file)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunDir(run_dir).ledger
        self.rows: List[Dict] = []

    def add(self, seg: Segment, consumed_version: int, used: bool, dropped: bool, t_consumed: float) -> None:
        self.rows.append(
            {
                "traj_id": seg.traj_id,
                "env_id": seg.env_id,
                "episode": seg.episode,
                "segment": seg.index,
                "task": seg.task,
                "behavior_version": seg.version,
                "consumed_version": consumed_version,
                "lag": consumed_version - seg.version if consumed_version >= 0 else -1,
                "steps": seg.steps,
                "success": bool(seg.success),
                "terminated": bool(seg.terminated),
                "truncated": bool(seg.truncated),
                "scored": bool(seg.scored),
                "used": used,
                "dropped": dropped,
                "t_start": seg.t_start,
                "t_end": seg.t_end,
                "t_consumed": t_consumed,
                "sim_rank": seg.sim_rank,
                "step_ids": [int(x) for x in seg.step_ids],
                "digest": digest(seg),
            }
        )

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=COLUMNS)

    def write(self) -> None:
        write_table(self.path, self.frame())


def digest(seg: Segment) -> str:
    """A short hash of what the segment holds (images left out: they cost time and follow from the rest)."""
    h = hashlib.blake2b(digest_size=8)
    for array in (seg.state, seg.actions, seg.rewards, seg.mask, seg.step_ids):
        if array is not None:
            h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


__all__ = ["COLUMNS", "Ledger", "digest", "read_ledger"]
