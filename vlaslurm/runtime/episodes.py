"""Simulator-side bookkeeping: execute action chunks, and cut each environment's
stream of steps into `Segment`s of one behaviour version.

A segment ends when its episode ends, when the policy version of the next reply
differs (so every sample has exactly one behaviour version), or at a length cap
(long episodes travel in pieces). Partial reset: a finished instance resets
alone, at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from vlaslurm.envs.base import Observation, VecEnv
from vlaslurm.runtime.messages import Segment

EnvObs = Tuple[Optional[np.ndarray], Optional[np.ndarray], str]  # (image [cams,H,W,3], state [D], instruction)


def split_obs(obs: Observation) -> List[EnvObs]:
    """One (image, state, instruction) per instance."""
    return [
        (
            None if obs.images is None else obs.images[i],
            None if obs.state is None else obs.state[i],
            obs.instructions[i],
        )
        for i in range(len(obs))
    ]


def stack_obs(items: Sequence[EnvObs]) -> Observation:
    """The inverse of `split_obs`."""
    images = None if items[0][0] is None else np.stack([cast(np.ndarray, it[0]) for it in items])
    state = None if items[0][1] is None else np.stack([cast(np.ndarray, it[1]) for it in items])
    return Observation(images, state, [it[2] for it in items])


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's finaliser: every input bit moves about half the output bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """A 31-bit seed from integers (stable across runs and machines). SplitMix64 absorbing one part per round:
    ~1 us, where numpy's SeedSequence took ~15 us, and a simulator draws one per environment per decision."""
    z = 0
    for part in parts:
        z = _splitmix64((z + 0x9E3779B97F4A7C15 + (abs(int(part)) & _MASK64)) & _MASK64)
    return z & 0x7FFFFFFF


@dataclass
class ChunkResult:
    """What executing one action chunk did to each instance."""

    rewards: np.ndarray  # [n, C]
    mask: np.ndarray  # [n, C] bool
    terminated: np.ndarray  # [n]
    truncated: np.ndarray  # [n]
    success: np.ndarray  # [n]
    last_obs: List[EnvObs]  # after the chunk (the final observation where the episode ended)


def run_chunk(
    env: VecEnv,
    ids: np.ndarray,
    actions: np.ndarray,
    cancel: Optional[threading.Event] = None,
    on_step: Optional[Callable[[], None]] = None,
    to_env: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    executed: Optional[int] = None,
) -> ChunkResult:
    """Execute `actions` [n, C, A] open-loop, the first `executed` of each chunk (`model.execute_actions`; None:
    all C, the rest stay unmasked); an instance stops at the end of its episode. Once `cancel` is
    set the chunk ends after the step under way (the mask says which steps ran; at least one always does).
    `on_step` is called as each step starts (the simulator times its steps from it). `to_env` maps the
    policy's actions to the environment's (`vlaslurm.models.env_action_transform`: de-normalisation, gripper
    post-processing) right before stepping; the caller keeps the policy's own actions for its records."""
    n, chunk = actions.shape[:2]
    if to_env is not None:
        actions = to_env(actions)
    rewards = np.zeros((n, chunk), np.float32)
    mask = np.zeros((n, chunk), bool)
    terminated, truncated, success = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    last: List[Optional[EnvObs]] = [None] * n
    active = np.ones(n, bool)
    for k in range(chunk if executed is None else min(executed, chunk)):
        rows = np.flatnonzero(active)
        if on_step is not None:
            on_step()
        res = env.step(ids[rows], np.ascontiguousarray(actions[rows, k, : env.action_dim], dtype=np.float32))
        rewards[rows, k] = res.reward
        mask[rows, k] = True
        for j, row in enumerate(rows):
            last[row] = (
                None if res.obs.images is None else res.obs.images[j],
                None if res.obs.state is None else res.obs.state[j],
                res.obs.instructions[j],
            )
        terminated[rows] |= res.terminated
        truncated[rows] |= res.truncated & ~res.terminated
        success[rows] |= res.success
        active[rows] &= ~(res.terminated | res.truncated)
        if not active.any() or (cancel is not None and cancel.is_set()):
            break
    return ChunkResult(rewards, mask, terminated, truncated, success, last)  # type: ignore[arg-type]


def _stacked_replay(rows: List[Optional[Dict[str, np.ndarray]]]) -> Optional[Dict[str, np.ndarray]]:
    """A segment's replay tensors [T, ...] from its decision steps' (None unless every step has them)."""
    if not rows or any(r is None for r in rows):
        return None
    return {k: np.stack([cast(Dict[str, np.ndarray], r)[k] for r in rows]) for k in cast(Dict, rows[0])}


class EnvTrack:
    """One environment instance: its episode, its current observation and its open segment."""

    def __init__(
        self,
        gid: int,
        local: int,
        task: str,
        max_len: int,
        clock: Callable[[], float],
        sim_rank: int,
        incarnation: int = 0,
    ) -> None:
        self.gid, self.local, self.task = gid, local, task
        self.max_len, self.clock, self.sim_rank, self.incarnation = max_len, clock, sim_rank, incarnation
        self.episode = -1
        self.step = 0
        self.obs: Optional[EnvObs] = None
        self.scored = True
        self._reset_segment(index=0)

    def start_episode(self, obs: EnvObs, scored: bool = True) -> None:
        """`scored`: whether the episode's outcome counts in success rates (`Segment.scored`)."""
        self.episode += 1
        self.step = 0
        self.obs = obs
        self.scored = scored
        self._reset_segment(index=0)

    def _reset_segment(self, index: int) -> None:
        self.seg_index = index
        self.version: Optional[int] = None
        self.t_start = self.clock()
        self.rows: List[tuple] = []

    def record(
        self,
        version: int,
        actions: np.ndarray,
        logprob: np.ndarray,
        value: float,
        rewards: np.ndarray,
        mask: np.ndarray,
        after: EnvObs,
        terminated: bool,
        truncated: bool,
        success: bool,
        token_logprob: Optional[np.ndarray] = None,
        replay: Optional[Dict[str, np.ndarray]] = None,
    ) -> List[Segment]:
        """Append one decision step; return the segments it completed (0, 1 or 2). `token_logprob` [C, A]: the
        behaviour log-prob of each action token, from policies that give them (logprob_level: token); `replay`:
        what the policy needs to evaluate the actions again (ActReply.replay, this environment's row)."""
        done: List[Segment] = []
        if self.rows and version != self.version:
            done.append(self.cut())  # never mix behaviour versions in one segment
        if not self.rows:
            self.version = version
            self.t_start = self.clock()
        self.rows.append((self.obs, actions, logprob, value, rewards, mask, self.step, version, token_logprob, replay))
        self.step += int(mask.sum())
        self.obs = after
        if terminated or truncated:
            done.append(self._finish(terminated, truncated, success))
        elif len(self.rows) >= self.max_len:
            done.append(self.cut())
        return done

    def cut(self) -> Segment:
        """Close the open segment mid-episode; the current observation bootstraps it."""
        return self._finish(False, False, False)

    def has_steps(self) -> bool:
        return bool(self.rows)

    def _finish(self, terminated: bool, truncated: bool, success: bool) -> Segment:
        assert self.version is not None, "a segment is finished only once it has a step"
        obs = [r[0] for r in self.rows] + [self.obs]
        seg = Segment(
            traj_id=f"{self.gid}-{self.episode}-{self.seg_index}",
            env_id=self.gid,
            episode=self.episode,
            index=self.seg_index,
            task=self.task,
            instruction=obs[0][2],
            version=int(self.version),
            images=None if obs[0][0] is None else np.stack([o[0] for o in obs]),
            state=None if obs[0][1] is None else np.stack([o[1] for o in obs]).astype(np.float32),
            actions=np.stack([r[1] for r in self.rows]).astype(np.float32),
            logprob=np.stack([r[2] for r in self.rows]).astype(np.float32),
            value=np.asarray([r[3] for r in self.rows], np.float32),
            rewards=np.stack([r[4] for r in self.rows]).astype(np.float32),
            mask=np.stack([r[5] for r in self.rows]),
            step_ids=np.asarray([r[6] for r in self.rows], np.int64),
            versions=np.asarray([r[7] for r in self.rows], np.int64),
            token_logprob=(
                np.stack([r[8] for r in self.rows]).astype(np.float32)
                if all(r[8] is not None for r in self.rows)
                else None
            ),
            replay=_stacked_replay([r[9] for r in self.rows]),
            terminated=terminated,
            truncated=truncated,
            success=success,
            t_start=self.t_start,
            t_end=self.clock(),
            sim_rank=self.sim_rank,
            incarnation=self.incarnation,
            scored=self.scored,
        )
        self._reset_segment(self.seg_index + 1)
        return seg
