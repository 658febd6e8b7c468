"""Pure functions over a run's metrics table and its ledger, shared by the tracker, `compare` and the notebooks.

Metrics table: one row per update (the run's metrics file, or MLflow's history), with
`env_steps`, `wall_s`, `charts/SPS`, `rollout/success_rate`, `rollout/episodes`.
Ledger: one row per segment (`vlaslurm.runtime.ledger.COLUMNS`).
"""

from __future__ import annotations

import json
from typing import Dict, List, Sequence, Union

import numpy as np
import pandas as pd

SUCCESS = "rollout/success_rate"
EPISODES = "rollout/episodes"


def success_curve(metrics: pd.DataFrame, window: int = 5) -> pd.Series:
    """Success rate over env steps: the episode-weighted mean of the last `window` updates.

    Each update's `rollout/success_rate` covers only the few episodes that ended
    since the previous one; weighting by `rollout/episodes` over a window gives a
    curve that can be read at any sample count.
    """
    episodes = metrics[EPISODES].fillna(0).astype(float)
    wins = (metrics[SUCCESS].fillna(0) * episodes).rolling(window, min_periods=1).sum()
    seen = episodes.rolling(window, min_periods=1).sum()
    curve = (wins / seen.where(seen > 0)).ffill()
    return pd.Series(curve.to_numpy(), index=metrics["env_steps"].to_numpy(), name="success")


def at_samples(x: np.ndarray, y: np.ndarray, samples: float) -> float:
    """`y` linearly interpolated at `samples` (NaN outside the run's range or without data)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(y)
    if not keep.any() or samples < x[keep][0] or samples > x[keep][-1]:
        return float("nan")
    return float(np.interp(samples, x[keep], y[keep]))


def consumed(ledger: pd.DataFrame) -> pd.DataFrame:
    """Segments the trainer consumed (used or dropped); the rest were still buffered at the end."""
    return ledger[ledger["consumed_version"] >= 0]


def lag_stats(ledger: pd.DataFrame) -> Dict[str, float]:
    """Δv of the used segments (mean, p50, p99, max) and how many segments were dropped."""
    lags = ledger.loc[ledger["used"], "lag"].to_numpy(float)
    total = len(ledger)
    out = {
        "segments": float(total),
        "used_segments": float(ledger["used"].sum()),
        "dropped_segments": float(ledger["dropped"].sum()),
        "dropped_frac": float(ledger["dropped"].sum() / total) if total else float("nan"),
    }
    for name, value in (
        ("lag_mean", np.mean),
        ("lag_p50", lambda a: np.percentile(a, 50)),
        ("lag_p99", lambda a: np.percentile(a, 99)),
        ("lag_max", np.max),
    ):
        out[name] = float(value(lags)) if len(lags) else float("nan")
    return out


def episode_ends(ledger: pd.DataFrame) -> pd.DataFrame:
    """Last segments of finished episodes (one row per episode, with its success)."""
    return ledger[ledger["terminated"] | ledger["truncated"]]


def scored_ends(ledger: pd.DataFrame) -> pd.DataFrame:
    """The finished episodes whose outcome counts in success rates (`scored`; a ledger written before that
    column existed counts every one): in sync mode only those begun at a phase's reset."""
    ends = episode_ends(ledger)
    return ends[ends["scored"].fillna(True).astype(bool)] if "scored" in ends else ends


def task_success_by_step(ledger: pd.DataFrame, steps: Union[Sequence[int], np.ndarray]) -> pd.DataFrame:
    """Success rate per task between consecutive update steps (`steps`: the metrics' env_steps).

    The ledger's segments, in the order they ended, add up to the env steps the
    trainer received; each finished episode counts at the first update at or after it.
    """
    if ledger.empty or len(steps) == 0:
        return pd.DataFrame(columns=["task", "step", "success_rate", "episodes"])
    order = ledger.sort_values("t_end")
    received = order["steps"].cumsum()
    ends = scored_ends(order)
    index = np.minimum(np.searchsorted(np.asarray(steps), received[ends.index].to_numpy()), len(steps) - 1)
    frame = pd.DataFrame(
        {"task": ends["task"].to_numpy(), "step": np.asarray(steps)[index], "success": ends["success"].to_numpy(float)}
    )
    out = frame.groupby(["task", "step"])["success"].agg(["mean", "size"]).reset_index()
    return out.rename(columns={"mean": "success_rate", "size": "episodes"})


def failed_trajectories(ledger: pd.DataFrame, per_task: int = 3) -> List[dict]:
    """A few failed episodes per task: every segment of each, so one can see where it went."""
    failed = episode_ends(ledger)
    failed = failed[~failed["success"]]
    keys = []
    for _, rows in failed.groupby("task"):
        keys += list(zip(rows["env_id"], rows["episode"], rows["sim_rank"]))[:per_task]
    out = []
    for env_id, episode, sim_rank in keys:
        segs = ledger[(ledger["env_id"] == env_id) & (ledger["episode"] == episode) & (ledger["sim_rank"] == sim_rank)]
        out.append(
            {
                "task": str(segs["task"].iloc[-1]),
                "env_id": int(env_id),
                "episode": int(episode),
                "sim_rank": int(sim_rank),
                "steps": int(segs["steps"].sum()),
                "segments": json.loads(segs.sort_values("segment").to_json(orient="records")),
            }
        )
    return out
