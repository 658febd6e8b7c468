"""Toy language-conditioned visual reaching task (`env.type: toy`), pure numpy.

Each instance shows a top-down image with `num_objects` coloured squares and a white agent dot,
and an instruction such as "move to the red square"; continuous 2-D actions move the agent, which
succeeds within `SUCCESS_RADIUS` of the named square. Rewards are 'shaped' or 'sparse'. Only a
policy that reads the instruction does well (`python -m vlaslurm.envs.toy` measures baselines).
Details and baseline numbers: docs/simulators.md
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from vlaslurm.envs.base import EnvIds, Observation, StepResult, tasks_of
from vlaslurm.spec.env_types import ToyEnvConfig

MAX_STEP = 0.08  # arena fraction one full-scale action moves the agent
SUCCESS_RADIUS = 0.08  # distance to the target's centre that counts as reached
SHAPING_SCALE = 2.0  # a straight reach from ~0.5 away earns ~1, comparable to the bonus
SUCCESS_BONUS = 1.0
MIN_OBJECT_GAP = 0.3  # objects far enough apart that reaching one never reaches another
MIN_START_GAP = 0.25  # the agent never starts on an object
ARENA_MARGIN = 0.1  # objects stay this far from the border so they are fully drawn

# Name and RGB of each object colour; instructions name these words.
COLOURS = (
    ("red", (230, 40, 40)),
    ("green", (40, 200, 60)),
    ("blue", (50, 80, 240)),
    ("yellow", (235, 220, 40)),
    ("purple", (160, 60, 200)),
    ("orange", (250, 140, 20)),
)
AGENT_RGB = (255, 255, 255)
TASKS = ("reach",)


def instruction_for(colour: str) -> str:
    """The five-word instruction naming one object."""
    return f"move to the {colour} square"


class ToyReachVecEnv:
    """`num_envs` independent reaching instances held as numpy arrays.

    Instances only share arrays they index disjointly and each owns its own
    `np.random.Generator`, so disjoint subsets may be stepped from different
    threads (`thread_safe = True`).
    """

    action_dim = 2
    state_dim = 2
    thread_safe = True
    shared_device = False

    def __init__(self, cfg: ToyEnvConfig, num_envs: int, rank: int = 0, seed: int = 0, group_size: int = 1):
        _validate(cfg, num_envs)
        self.cfg = cfg
        self.num_envs = num_envs
        self.num_objects = cfg.num_objects
        self.max_episode_steps = cfg.max_episode_steps
        global_ids = [rank * num_envs + i for i in range(num_envs)]
        self.tasks: List[str] = tasks_of(cfg.tasks, rank * num_envs, num_envs, group_size)
        # One stream per instance keyed by (seed, global id): ranks never repeat each other.
        self._rngs = [np.random.default_rng([seed, g]) for g in global_ids]
        self.agent_pos = np.zeros((num_envs, 2), np.float32)
        self.object_pos = np.zeros((num_envs, cfg.num_objects, 2), np.float32)
        self.object_colour = np.zeros((num_envs, cfg.num_objects), np.int64)  # index into COLOURS
        self.target = np.zeros(num_envs, np.int64)  # index into the instance's objects
        self.elapsed = np.zeros(num_envs, np.int64)
        self._needs_reset = np.ones(num_envs, bool)

    # --- VecEnv interface -------------------------------------------------------------------
    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        """Start new episodes in `env_ids`; a given seed re-seeds that instance's stream."""
        ids = self._ids(env_ids)
        if seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"reset got {len(ids)} env_ids but {len(seeds)} seeds")
        for k, i in enumerate(ids):
            if seeds is not None:
                self._rngs[i] = np.random.default_rng(int(seeds[k]))
            self._sample_episode(i, self._rngs[i])
        self.elapsed[ids] = 0
        self._needs_reset[ids] = False
        return self._observe(ids)

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        """Move the agents of `env_ids` by `actions` (float [n, 2], clipped to [-1, 1])."""
        ids = self._ids(env_ids)
        actions = np.asarray(actions, np.float32)
        if actions.shape != (len(ids), 2):
            raise ValueError(f"actions must have shape ({len(ids)}, 2), got {actions.shape}")
        if self._needs_reset[ids].any():
            stale = ids[self._needs_reset[ids]].tolist()
            raise RuntimeError(f"toy env instances {stale} finished (or never started); reset them before stepping")
        before = self._target_distance(ids)
        moved = self.agent_pos[ids] + np.clip(actions, -1.0, 1.0) * MAX_STEP
        self.agent_pos[ids] = np.clip(moved, 0.0, 1.0)
        after = self._target_distance(ids)
        self.elapsed[ids] += 1
        success = after <= SUCCESS_RADIUS
        truncated = (self.elapsed[ids] >= self.max_episode_steps) & ~success
        reward = SUCCESS_BONUS * success.astype(np.float32)
        if self.cfg.reward == "shaped":
            reward += SHAPING_SCALE * (before - after)
        self._needs_reset[ids] = success | truncated
        return StepResult(
            obs=self._observe(ids),
            reward=reward.astype(np.float32),
            terminated=success,
            truncated=truncated,
            success=success.copy(),
        )

    def close(self) -> None:
        """Nothing to release: the task is plain arrays."""

    # --- privileged helpers for baselines and tests ------------------------------------------
    def target_pos(self, env_ids: EnvIds) -> np.ndarray:
        """Centre of each instance's named object, float32 [n, 2]."""
        ids = self._ids(env_ids)
        return self.object_pos[ids, self.target[ids]]

    # --- internals ---------------------------------------------------------------------------
    def _ids(self, env_ids: EnvIds) -> np.ndarray:
        ids = np.asarray(env_ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_envs):
            raise IndexError(f"env_ids must lie in [0, {self.num_envs}), got {ids.tolist()}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"env_ids must not repeat, got {ids.tolist()}")
        return ids

    def _sample_episode(self, i: int, rng: np.random.Generator) -> None:
        # Object j always has colour j (positions are random, so this loses nothing): with the
        # default 3 objects every image shows red, green and blue, and the instruction picks one.
        self.object_colour[i] = np.arange(self.num_objects)
        self.object_pos[i] = _spread_points(rng, self.num_objects)
        self.target[i] = rng.integers(self.num_objects)
        self.agent_pos[i] = _start_point(rng, self.object_pos[i])

    def _target_distance(self, ids: np.ndarray) -> np.ndarray:
        return np.linalg.norm(self.agent_pos[ids] - self.object_pos[ids, self.target[ids]], axis=-1)

    def _observe(self, ids: np.ndarray) -> Observation:
        names = [COLOURS[c][0] for c in self.object_colour[ids, self.target[ids]]]
        size = self.cfg.obs.image_size
        images = None
        if size > 0:
            images = render(self.agent_pos[ids], self.object_pos[ids], self.object_colour[ids], size)[:, None]
        state = self.agent_pos[ids].astype(np.float32) if self.cfg.obs.state else None
        return Observation(images=images, state=state, instructions=[instruction_for(n) for n in names])


def _spread_points(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` points at least MIN_OBJECT_GAP apart (rejection sampling; a few tries at most)."""
    for _ in range(1000):
        points = rng.uniform(ARENA_MARGIN, 1.0 - ARENA_MARGIN, size=(count, 2))
        gaps = np.linalg.norm(points[:, None] - points[None], axis=-1) + 10 * np.eye(count)
        if gaps.min() >= MIN_OBJECT_GAP:
            return points.astype(np.float32)
    raise RuntimeError(f"could not place {count} objects {MIN_OBJECT_GAP} apart; use fewer objects")


def _start_point(rng: np.random.Generator, objects: np.ndarray) -> np.ndarray:
    for _ in range(1000):
        point = rng.uniform(0.05, 0.95, size=2)
        if np.linalg.norm(objects - point, axis=-1).min() >= MIN_START_GAP:
            return point.astype(np.float32)
    raise RuntimeError("could not place the agent away from the objects")


def render(agent: np.ndarray, objects: np.ndarray, colours: np.ndarray, size: int) -> np.ndarray:
    """Draw squares and agent dots for n instances at once: uint8 [n, size, size, 3]."""
    n, k = colours.shape
    palette = np.array([rgb for _, rgb in COLOURS] + [AGENT_RGB], np.uint8)
    half = max(1, round(size * 0.07))  # 5-pixel squares at 32x32
    grid = np.arange(size)
    centres = np.rint(objects * (size - 1)).astype(np.int64)  # [n, k, 2] as (x, y)
    in_x = np.abs(grid[None, None, :] - centres[..., 0:1]) <= half  # [n, k, W]
    in_y = np.abs(grid[None, None, :] - centres[..., 1:2]) <= half  # [n, k, H]
    covered = in_y[..., :, None] & in_x[..., None, :]  # [n, k, H, W]
    # Later objects win overlaps (there are none by construction); -1 marks background.
    layer = np.where(covered, colours[:, :, None, None], -1).max(axis=1)  # [n, H, W]
    dot = np.rint(agent * (size - 1)).astype(np.int64)
    rows, cols = grid[None, :, None], grid[None, None, :]
    on_dot = (np.abs(rows - dot[:, 1, None, None]) <= 1) & (np.abs(cols - dot[:, 0, None, None]) <= 1)  # 3x3 dot
    layer = np.where(on_dot, len(COLOURS), layer)
    image = np.zeros((n, size, size, 3), np.uint8)
    mask = layer >= 0
    image[mask] = palette[layer[mask]]
    return image


def _validate(cfg: ToyEnvConfig, num_envs: int) -> None:
    if num_envs < 1:
        raise ValueError(f"toy env needs num_envs >= 1, got {num_envs}")
    unknown = [t for t in cfg.tasks if t not in TASKS]
    if not cfg.tasks or unknown:
        raise ValueError(f"env.tasks for the toy env must be from {list(TASKS)}, got {cfg.tasks}")
    if not 1 <= cfg.num_objects <= len(COLOURS):
        raise ValueError(f"env.num_objects must be in [1, {len(COLOURS)}], got {cfg.num_objects}")
    if cfg.reward not in ("shaped", "sparse"):
        raise ValueError(f"env.reward must be 'shaped' or 'sparse', got {cfg.reward!r}")
    if cfg.max_episode_steps < 1:
        raise ValueError(f"env.max_episode_steps must be >= 1, got {cfg.max_episode_steps}")
    size, cams = cfg.obs.image_size, cfg.obs.cameras
    if size and not 8 <= size <= 256:
        raise ValueError(f"env.obs.image_size must be 0 (no images) or in [8, 256], got {size}")
    if size and len(cams) != 1:
        raise ValueError(f"the toy env renders one top-down camera; set env.obs.cameras to one name, got {cams}")


def make(cfg: ToyEnvConfig, num_envs: int, rank: int = 0, seed: int = 0, group_size: int = 1) -> ToyReachVecEnv:
    """Registry entry point (`env.type: toy`)."""
    return ToyReachVecEnv(cfg, num_envs=num_envs, rank=rank, seed=seed, group_size=group_size)


# --- scripted baselines (privileged: they read the simulator state) --------------------------
def oracle_actions(env: ToyReachVecEnv, env_ids: EnvIds) -> np.ndarray:
    """Head straight for the named object."""
    ids = np.asarray(env_ids)
    return np.clip((env.target_pos(ids) - env.agent_pos[ids]) / MAX_STEP, -1.0, 1.0)


def nearest_object_actions(env: ToyReachVecEnv, env_ids: EnvIds) -> np.ndarray:
    """Head for the closest object, ignoring the instruction (the best language-blind policy)."""
    ids = np.asarray(env_ids)
    offsets = env.object_pos[ids] - env.agent_pos[ids, None]
    nearest = np.linalg.norm(offsets, axis=-1).argmin(axis=1)
    return np.clip(offsets[np.arange(len(ids)), nearest] / MAX_STEP, -1.0, 1.0)


def random_actions(env: ToyReachVecEnv, env_ids: EnvIds, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, size=(len(env_ids), env.action_dim)).astype(np.float32)


def baseline_success(
    policy: str, episodes: int = 1024, num_envs: int = 64, seed: int = 0, cfg: Optional[ToyEnvConfig] = None
) -> tuple[float, float]:
    """(success rate, mean episode length) of 'random', 'nearest' or 'oracle' over `episodes`."""
    cfg = cfg or ToyEnvConfig()
    env = make(cfg, num_envs=num_envs, seed=seed)
    rng = np.random.default_rng(seed)
    choose = {
        "random": lambda ids: random_actions(env, ids, rng),
        "nearest": lambda ids: nearest_object_actions(env, ids),
        "oracle": lambda ids: oracle_actions(env, ids),
    }[policy]
    rounds = -(-episodes // num_envs)  # whole rounds of num_envs parallel episodes
    successes, lengths = [], []
    for r in range(rounds):
        ids = np.arange(num_envs)
        env.reset(ids, seeds=[seed * 1_000_003 + r * num_envs + i for i in ids])
        while ids.size:
            result = env.step(ids, choose(ids))
            done = result.terminated | result.truncated
            successes += result.success[done].tolist()
            lengths += env.elapsed[ids[done]].tolist()
            ids = ids[~done]
    return float(np.mean(successes)), float(np.mean(lengths))


if __name__ == "__main__":
    for name in ("random", "nearest", "oracle"):
        rate, length = baseline_success(name)
        print(f"{name:8s} success {rate:.3f}  mean length {length:.1f}")
