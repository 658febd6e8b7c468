"""A simulator that sleeps instead of simulating (`env.type: synthetic`).

It measures the runtime's scheduling on a machine with few cores: stepping a set of instances
sleeps for the slowest of their step times, disjoint sets step from different threads, and each
instance makes up for the OS's late wake-ups. `step_ms.per_env` adds a part proportional to the
instances stepped that one shared device serves in turn (a GPU simulator).
`VLASLURM_SYNTHETIC_HANG=GID:N` makes instance GID hang after N steps, for tests.
Details: docs/simulators.md
"""

from __future__ import annotations

import os
import threading
import time
from typing import List, Optional, Sequence

import numpy as np

from vlaslurm.envs.base import EnvIds, Observation, StepResult, tasks_of
from vlaslurm.spec.env_types import SyntheticEnvConfig


class SyntheticVecEnv:
    """`num_envs` sleeping instances with heavy-tailed, per-instance step times."""

    thread_safe = True

    def __init__(self, cfg: SyntheticEnvConfig, num_envs: int, rank: int, seed: int, group_size: int = 1) -> None:
        self.cfg = cfg
        self.num_envs = num_envs
        self.action_dim = 2
        self.state_dim = cfg.state_dim
        first = rank * num_envs
        self.global_ids = np.arange(first, first + num_envs)
        self.tasks: List[str] = tasks_of(cfg.tasks, first, num_envs, group_size)
        slow_count = int(round(cfg.slow_fraction * num_envs))
        self.slowdown = np.ones(num_envs)
        self.slowdown[num_envs - slow_count :] = cfg.slow_factor  # the last instances of each rank are slow
        self._rngs = [np.random.default_rng([seed, int(g)]) for g in self.global_ids]
        self._t = np.zeros(num_envs, dtype=np.int64)
        self._will_succeed = np.zeros(num_envs, dtype=bool)
        self._late = np.zeros(num_envs)  # seconds the last wake-up of each instance came after its deadline
        self._hang = _hang_hook(self.global_ids)
        self._steps = np.zeros(num_envs, dtype=np.int64)  # since creation (the hang hook counts them)
        self.device = SharedDevice()
        self.shared_device = cfg.step_ms.per_env > 0

    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        ids = np.asarray(env_ids, dtype=np.int64)
        for k, i in enumerate(ids):
            if seeds is not None:
                self._rngs[i] = np.random.default_rng([int(seeds[k]), int(self.global_ids[i])])
            self._t[i] = 0
            self._will_succeed[i] = self._rngs[i].random() < self.cfg.success_prob
        return self._observe(ids)

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        ids = np.asarray(env_ids, dtype=np.int64)
        if self._hang is not None:
            local, after = self._hang
            if local in ids and self._steps[local] >= after:
                while True:  # a simulator stuck in its step: nothing comes back
                    time.sleep(60)
            self._steps[ids] += 1
        if len(ids):
            self._sleep(ids)
        self._t[ids] += 1
        ended = self._t[ids] >= self.cfg.episode_steps
        success = ended & self._will_succeed[ids]
        truncated = self._t[ids] >= self.cfg.max_episode_steps
        reward = success.astype(np.float32)
        return StepResult(self._observe(ids), reward, ended, truncated & ~ended, success)

    def close(self) -> None:
        pass

    def _sleep(self, ids: np.ndarray) -> None:
        """Sleep for the device's turn (`per_env` per instance, after the calls queued before this one),
        then for the slowest instance's step time; less the lateness these instances already took (the
        smallest of theirs: never credit an instance more than it lost), at most this call's own work."""
        start = time.perf_counter()
        seconds = max(self._step_seconds(i) for i in ids)
        on_device = self.cfg.step_ms.per_env * len(ids) / 1000.0
        device_done = self.device.serve(start, on_device)
        deadline = device_done + seconds - min(float(self._late[ids].min()), on_device + seconds)
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        self._late[ids] = time.perf_counter() - deadline

    def _step_seconds(self, i: int) -> float:
        return self.slowdown[i] * sample_ms(self.cfg.step_ms, self._rngs[i]) / 1000.0

    def _observe(self, ids: np.ndarray) -> Observation:
        state = np.zeros((len(ids), self.state_dim), dtype=np.float32)
        state[:, 0] = self._t[ids] / max(1, self.cfg.episode_steps)
        state[:, 1] = ids
        return Observation(images=None, state=state, instructions=[f"do {self.tasks[i]}" for i in ids])


class SharedDevice:
    """One device that serves calls in turn, first come first served. Its queue is kept as the time it is
    next free rather than as a lock held while sleeping: a late wake-up of one caller then delays only that
    caller, as the OS's lateness is not the modelled device's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def serve(self, now: float, seconds: float) -> float:
        """When work of `seconds` that arrives at `now` is done."""
        if seconds <= 0:
            return now
        with self._lock:
            self._free_at = max(now, self._free_at) + seconds
            return self._free_at


def _hang_hook(global_ids: np.ndarray) -> Optional[tuple]:
    """(local index, steps) from VLASLURM_SYNTHETIC_HANG when it names one of these instances, else None."""
    raw = os.environ.get("VLASLURM_SYNTHETIC_HANG")
    if not raw:
        return None
    gid, after = (int(x) for x in raw.split(":"))
    hits = np.flatnonzero(global_ids == gid)
    return (int(hits[0]), after) if hits.size else None


def sample_ms(dist, rng: np.random.Generator) -> float:
    """One draw of a step time in ms with the configured mean (lognormal and pareto are mean-matched)."""
    if dist.dist == "constant":
        return dist.mean
    if dist.dist == "lognormal":
        # E[exp(N(mu, s^2))] = exp(mu + s^2/2): pick mu so the mean is `mean`.
        mu = np.log(dist.mean) - dist.sigma**2 / 2
        return float(rng.lognormal(mu, dist.sigma))
    # Pareto with x_m chosen so that alpha * x_m / (alpha - 1) = mean.
    x_m = dist.mean * (dist.alpha - 1) / dist.alpha
    return float(x_m * (1 + rng.pareto(dist.alpha)))


def make(cfg: SyntheticEnvConfig, num_envs: int, rank: int, seed: int, group_size: int = 1) -> SyntheticVecEnv:
    """Build the synthetic simulator of one rank."""
    return SyntheticVecEnv(cfg, num_envs, rank, seed, group_size)
