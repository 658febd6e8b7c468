"""ManiSkill3 tasks behind the `VecEnv` interface (`env.type: maniskill`).

`env.sim_backend`: `gpu` (one env of `num_envs` parallel scenes per rank, one task per rank, not
thread-safe) or `cpu` (each instance in its own process, `vlaslurm.envs._procs`; thread-safe).
Actions follow the VLA convention by default (7-D end-effector delta, +1 closes the gripper) or
pass through (`native`); the Vulkan driver comes from `vlaslurm.envs._vulkan`.
Details (subset stepping on gpu, actions, observations): docs/simulators.md
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vlaslurm.envs._procs import call_each, check_ids, reset_seeds, start_all
from vlaslurm.envs.base import EnvIds, Observation, StepResult, tasks_of
from vlaslurm.spec.env_types import ManiSkillEnvConfig

INSTRUCTIONS = {
    "PickCube-v1": "pick up the cube and move it to the goal position",
    "PushCube-v1": "push the cube to the goal",
    "PullCube-v1": "pull the cube to the goal",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "LiftPegUpright-v1": "lift the peg upright",
    "PegInsertionSide-v1": "insert the peg into the hole",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "PickSingleYCB-v1": "pick up the object and move it to the goal position",
    "RollBall-v1": "roll the ball to the goal",
    "PushT-v1": "push the T-shaped block onto the target",
    "PlaceSphere-v1": "place the sphere into the bin",
    "TurnFaucet-v1": "turn the faucet",
    "OpenCabinetDrawer-v1": "open the cabinet drawer",
}
VLA_CONTROL_MODES = ("pd_ee_delta_pose", "pd_ee_target_delta_pose")
STATE_MODES = ("state", "state_dict")
IMAGE_MODES = ("rgb", "rgbd", "rgb+depth", "rgb+segmentation", "rgb+depth+segmentation", "sensor_data")


def instruction_for(task: str, overrides: Dict[str, str]) -> str:
    """The language instruction of a task: the config's override, the table above, or the id in words."""
    if task in overrides:
        return overrides[task]
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    name = task.rsplit("-v", 1)[0]
    words = "".join(" " + c.lower() if c.isupper() else c for c in name).strip()
    return words


@dataclass
class Layout:
    """What to take out of a ManiSkill observation."""

    cameras: List[str]  # empty: no images
    state: bool

    @classmethod
    def of(cls, cfg: ManiSkillEnvConfig) -> Layout:
        wants_images = cfg.obs.image_size > 0 and bool(cfg.obs.cameras)
        return cls(list(cfg.obs.cameras) if wants_images else [], cfg.obs.state)


def extract(obs: Any, layout: Layout) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(images uint8 [n, cams, H, W, 3], state float32 [n, D]) from a batched numpy observation."""
    if not isinstance(obs, dict):  # state mode: one flat vector per scene
        return None, (np.asarray(obs, np.float32).reshape(len(obs), -1) if layout.state else None)
    images = None
    if layout.cameras:
        sensors = obs.get("sensor_data", {})
        missing = [c for c in layout.cameras if c not in sensors or "rgb" not in sensors[c]]
        if missing:
            raise ValueError(
                f"env.obs.cameras names {missing}, which this task does not render; its cameras: {sorted(sensors)}"
            )
        images = np.stack([np.asarray(sensors[c]["rgb"])[..., :3] for c in layout.cameras], axis=1).astype(np.uint8)
    state = None
    if layout.state:
        parts = _leaves({k: obs[k] for k in ("agent", "extra") if k in obs})
        n = len(next(iter(parts))) if parts else 0
        state = (
            np.concatenate([p.reshape(n, -1).astype(np.float32) for p in parts], axis=1)
            if parts
            else np.zeros((n, 0), np.float32)
        )
    return images, state


def _leaves(tree: Any) -> List[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for key in tree for leaf in _leaves(tree[key])]
    return [np.asarray(tree)]


def to_simulator_action(actions: np.ndarray, convention: str) -> np.ndarray:
    """VLA action (+1 closes) -> ManiSkill action (+1 opens); `native` is unchanged."""
    out = np.clip(np.asarray(actions, np.float32), -1.0, 1.0)
    if convention == "vla":
        out = out.copy()
        out[:, -1] = -out[:, -1]
    return out


def make_kwargs(cfg: ManiSkillEnvConfig, backend: str, num_envs: int) -> Dict[str, Any]:
    """`gym.make` keyword arguments (without the task id) for one ManiSkill env."""
    kwargs: Dict[str, Any] = dict(
        num_envs=num_envs,
        obs_mode=cfg.obs_mode,
        control_mode=cfg.control_mode,
        reward_mode=cfg.reward_mode,
        sim_backend="physx_cuda" if backend == "gpu" else "physx_cpu",
        render_backend=cfg.render_backend,
        max_episode_steps=cfg.max_episode_steps,
    )
    if cfg.obs.image_size > 0 and cfg.obs_mode not in STATE_MODES:
        kwargs["sensor_configs"] = dict(width=cfg.obs.image_size, height=cfg.obs.image_size)
    return kwargs


def import_maniskill(vulkan: str) -> Any:
    """Select the Vulkan driver, then import ManiSkill (registering its tasks); returns gymnasium."""
    from vlaslurm.envs import _vulkan

    _vulkan.activate(vulkan)
    import warnings

    warnings.filterwarnings("ignore", message=".*system libvulkan.*")
    import importlib

    import gymnasium as gym

    importlib.import_module("mani_skill.envs")  # registers the tasks

    return gym


# --- cpu backend: one process per instance --------------------------------------------------------
class CpuInstance:
    """One CPU ManiSkill scene; lives in its own process (see `vlaslurm.envs._procs`)."""

    def __init__(self, task: str, cfg: ManiSkillEnvConfig, layout: Layout) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        gym = import_maniskill(cfg.vulkan_icd)
        from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

        self.layout = layout
        self.env = CPUGymWrapper(gym.make(task, **make_kwargs(cfg, "cpu", 1)))
        _, state = extract(_batch(self.env.reset(seed=0)[0]), layout)
        self.dims = {
            "action_dim": int(np.prod(self.env.action_space.shape)),
            "state_dim": 0 if state is None else state.shape[1],
        }

    def info(self) -> Dict[str, int]:
        return self.dims

    def reset(self, seed: Optional[int]) -> Tuple[Any, Any]:
        obs, _ = self.env.reset(seed=seed)
        return extract(_batch(obs), self.layout)

    def step(self, action: np.ndarray) -> Tuple[Any, ...]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return (
            *extract(_batch(obs), self.layout),
            float(reward),
            bool(terminated),
            bool(truncated),
            bool(info.get("success", False)),
        )

    def close(self) -> None:
        self.env.close()


def _batch(obs: Any) -> Any:
    if isinstance(obs, dict):
        return {k: _batch(v) for k, v in obs.items()}
    return np.asarray(obs)[None]


class CpuManiSkillVecEnv:
    """`num_envs` CPU ManiSkill scenes, one worker process each."""

    thread_safe = True
    shared_device = False

    def __init__(self, cfg: ManiSkillEnvConfig, tasks: List[str]) -> None:
        self.cfg, self.tasks, self.num_envs = cfg, tasks, len(tasks)
        self.layout = Layout.of(cfg)
        self.instructions = [instruction_for(t, cfg.instructions) for t in tasks]
        self.workers, dims = start_all(
            "ManiSkill", self.num_envs, "vlaslurm.envs.maniskill:CpuInstance", lambda i: (tasks[i], cfg, self.layout)
        )
        self.action_dim = _check_same("action_dim", dims, tasks)
        self.state_dim = max(d["state_dim"] for d in dims) if cfg.obs.state else 0  # shorter ones are zero-padded
        _check_action_dim(cfg, self.action_dim)
        self._elapsed = np.zeros(self.num_envs, np.int64)

    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        ids = check_ids(env_ids, self.num_envs)
        rows = call_each(self.workers, ids, "reset", reset_seeds(ids, seeds))
        self._elapsed[ids] = 0
        return self._observation(ids, [r[0] for r in rows], [r[1] for r in rows])

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        ids = check_ids(env_ids, self.num_envs)
        acts = to_simulator_action(_actions(actions, len(ids), self.action_dim), self.cfg.action_convention)
        rows = call_each(self.workers, ids, "step", acts)
        self._elapsed[ids] += 1
        reward = np.array([r[2] for r in rows], np.float32)
        terminated = np.array([r[3] for r in rows], bool)
        truncated = np.array([r[4] for r in rows], bool) | (self._elapsed[ids] >= self.cfg.max_episode_steps)
        success = np.array([r[5] for r in rows], bool)
        obs = self._observation(ids, [r[0] for r in rows], [r[1] for r in rows])
        return StepResult(obs, reward, terminated, truncated & ~terminated, success)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers = []

    def _observation(self, ids: np.ndarray, images: List[Any], states: List[Any]) -> Observation:
        if not len(ids):  # an empty subset
            return Observation(images=None, state=None, instructions=[])
        return Observation(
            images=None if images[0] is None else np.concatenate(images),
            state=(None if states[0] is None else np.concatenate([_pad(s, self.state_dim) for s in states])),
            instructions=[self.instructions[i] for i in ids],
        )


# --- gpu backend: one batched env per task ---------------------------------------------------------
class GpuManiSkillVecEnv:
    """One `physx_cuda` ManiSkill env per task, each holding that task's instances."""

    thread_safe = False
    shared_device = False

    def __init__(self, cfg: ManiSkillEnvConfig, tasks: List[str], backend: str = "gpu") -> None:
        import torch

        gym = import_maniskill(cfg.vulkan_icd)
        self.torch = torch
        self.cfg, self.tasks, self.num_envs = cfg, tasks, len(tasks)
        self.layout = Layout.of(cfg)
        self.instructions = [instruction_for(t, cfg.instructions) for t in tasks]
        self.groups: Dict[str, np.ndarray] = {t: np.flatnonzero(np.array(tasks) == t) for t in dict.fromkeys(tasks)}
        self.where = np.zeros((self.num_envs, 2), np.int64)  # instance -> (task index, row in its env)
        self.envs = []
        for k, (task, members) in enumerate(self.groups.items()):
            self.envs.append(gym.make(task, **make_kwargs(cfg, backend, len(members))))
            self.where[members, 0], self.where[members, 1] = k, np.arange(len(members))
        base = self.envs[0].unwrapped
        self.action_dim = int(np.prod(base.single_action_space.shape))
        _check_action_dim(cfg, self.action_dim)
        # ManiSkill resets once while it builds, so each env already holds an observation
        states = [extract(self._numpy(env.unwrapped._last_obs), self.layout)[1] for env in self.envs]
        self.state_dim = 0 if states[0] is None else max(st.shape[1] for st in states if st is not None)
        self._elapsed = np.zeros(self.num_envs, np.int64)
        self._waiting = np.ones(self.num_envs, bool)  # ended or never started: needs a reset, not a freeze

    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        ids = check_ids(env_ids, self.num_envs)
        images, states = {}, {}
        for k, env in enumerate(self.envs):
            mine = ids[self.where[ids, 0] == k]
            if not len(mine):
                continue
            rows = self.where[mine, 1]
            torch = self.torch
            with torch.random.fork_rng(devices=[] if not torch.cuda.is_available() else None):
                if seeds is not None:
                    self._seed_rows(env.unwrapped, rows, [int(seeds[list(ids).index(i)]) for i in mine])
                obs, _ = env.reset(options={"env_idx": torch.as_tensor(rows, device=env.unwrapped.device)})
            im, st = extract(self._numpy(obs), self.layout)
            for j, i in enumerate(mine):
                images[i] = None if im is None else im[rows[j]]
                states[i] = None if st is None else st[rows[j]]
        self._elapsed[ids] = 0
        self._waiting[ids] = False
        return self._observation(ids, images, states)

    def _seed_rows(self, base: Any, rows: np.ndarray, seeds: List[int]) -> None:
        """Seed a partial reset ourselves: ManiSkill, given seeds, replaces every scene's episode seed and
        seeds torch from the first scene's, so resets of other rows would repeat. Its numpy episode RNG of
        the reset rows gets their seeds; torch (cube placement on the gpu) gets a mix of them."""
        from mani_skill.envs.utils.randomization.batched_rng import BatchedRNG

        base._episode_seed[rows] = seeds
        base._batched_episode_rng[rows] = BatchedRNG.from_seeds(seeds, backend=base._batched_rng_backend)
        base._episode_rng = base._batched_episode_rng[0]
        self.torch.manual_seed(int(np.random.SeedSequence(seeds).generate_state(1)[0]))

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        ids = check_ids(env_ids, self.num_envs)
        acts = to_simulator_action(_actions(actions, len(ids), self.action_dim), self.cfg.action_convention)
        n = len(ids)
        reward, terminated, truncated, success = (
            np.zeros(n, np.float32),
            np.zeros(n, bool),
            np.zeros(n, bool),
            np.zeros(n, bool),
        )
        images, states = {}, {}
        position = {int(i): p for p, i in enumerate(ids)}
        for k, env in enumerate(self.envs):
            mine = ids[self.where[ids, 0] == k]
            if not len(mine):
                continue
            out = self._step_env(k, env, mine, acts[[position[int(i)] for i in mine]])
            for j, i in enumerate(mine):
                p = position[int(i)]
                reward[p], terminated[p], success[p] = out["reward"][j], out["terminated"][j], out["success"][j]
                images[i] = None if out["images"] is None else out["images"][j]
                states[i] = None if out["state"] is None else out["state"][j]
        self._elapsed[ids] += 1
        truncated = (self._elapsed[ids] >= self.cfg.max_episode_steps) & ~terminated
        self._waiting[ids] = terminated | truncated
        return StepResult(self._observation(ids, images, states), reward, terminated, truncated, success)

    def _step_env(self, k: int, env: Any, mine: np.ndarray, acts: np.ndarray) -> Dict[str, Any]:
        torch, base = self.torch, env.unwrapped
        members = self.groups[self.tasks[mine[0]]]
        rows = self.where[mine, 1]
        full = np.zeros((len(members), self.action_dim), np.float32)
        full[rows] = acts
        frozen = self.where[members, 1][~np.isin(members, mine) & ~self._waiting[members]]
        snapshot = None
        if len(frozen):  # scenes mid-episode that were not asked to step: put them back afterwards
            idx = torch.as_tensor(frozen, device=base.device)
            snapshot = (_index_tree(base.get_state_dict(), idx), base._elapsed_steps[idx].clone(), idx)
        obs, reward, terminated, _, info = env.step(torch.as_tensor(full, device=base.device))
        if snapshot is not None:
            state, elapsed, idx = snapshot
            state.pop("controller", None)
            base.set_state_dict(state, idx)
            base._elapsed_steps[idx] = elapsed
        images, state = extract(self._numpy(obs), self.layout)
        take = lambda x: None if x is None else x[rows]  # noqa: E731
        success = self._numpy(info.get("success", torch.zeros_like(terminated)))
        return {
            "reward": self._numpy(reward)[rows],
            "terminated": self._numpy(terminated)[rows].astype(bool),
            "success": success[rows].astype(bool),
            "images": take(images),
            "state": take(state),
        }

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []

    def _numpy(self, tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: self._numpy(v) for k, v in tree.items()}
        if isinstance(tree, self.torch.Tensor):
            return tree.detach().cpu().numpy()
        return np.asarray(tree)

    def _observation(self, ids: np.ndarray, images: Dict[int, Any], states: Dict[int, Any]) -> Observation:
        first = int(ids[0]) if len(ids) else None
        return Observation(
            images=None if first is None or images[first] is None else np.stack([images[int(i)] for i in ids]),
            state=None
            if first is None or states[first] is None
            else _pad(np.stack([_pad(states[int(i)][None], self.state_dim)[0] for i in ids]), self.state_dim),
            instructions=[self.instructions[i] for i in ids],
        )


def _index_tree(tree: Any, idx: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _index_tree(v, idx) for k, v in tree.items()}
    return tree[idx].clone()


# --- shared helpers --------------------------------------------------------------------------------


def _actions(actions: np.ndarray, n: int, dim: int) -> np.ndarray:
    actions = np.asarray(actions, np.float32)
    if actions.shape != (n, dim):
        raise ValueError(f"actions must have shape ({n}, {dim}), got {actions.shape}")
    return actions


def _pad(state: np.ndarray, dim: int) -> np.ndarray:
    """Zero-pad [n, d] states to [n, dim]: tasks of one section may observe different extras."""
    return state if state.shape[1] == dim else np.pad(state, ((0, 0), (0, dim - state.shape[1])))


def _check_same(key: str, dims: List[Dict[str, int]], tasks: List[str]) -> int:
    values = {t: d[key] for t, d in zip(tasks, dims)}
    if len(set(values.values())) > 1:
        raise ValueError(f"the tasks of one env section must share {key}; got {values}")
    return next(iter(values.values()))


def _check_action_dim(cfg: ManiSkillEnvConfig, action_dim: int) -> None:
    if cfg.action_convention == "vla" and action_dim != 7:
        raise ValueError(
            f"env.action_convention 'vla' needs a 7-D end-effector controller such as "
            f"{' or '.join(VLA_CONTROL_MODES)}; env.control_mode {cfg.control_mode!r} has "
            f"{action_dim} action dimensions (set env.action_convention: native to pass them through)"
        )


def validate(cfg: ManiSkillEnvConfig) -> None:
    """Check the fields this adapter reads; errors name the field and how to fix it."""
    if cfg.sim_backend not in ("auto", "cpu", "gpu"):
        raise ValueError(f"env.sim_backend must be auto, cpu or gpu, got {cfg.sim_backend!r}")
    if cfg.action_convention not in ("vla", "native"):
        raise ValueError(f"env.action_convention must be vla or native, got {cfg.action_convention!r}")
    wants_images = cfg.obs.image_size > 0 and bool(cfg.obs.cameras)
    if cfg.obs_mode in STATE_MODES and wants_images:
        raise ValueError(
            f"env.obs_mode {cfg.obs_mode!r} renders no cameras but env.obs asks for images "
            f"{cfg.obs.cameras} at {cfg.obs.image_size} px; set env.obs_mode: rgb, or "
            f"env.obs.image_size: 0"
        )
    if cfg.obs_mode not in STATE_MODES and not wants_images:
        raise ValueError(
            f"env.obs_mode {cfg.obs_mode!r} renders cameras but env.obs asks for none; set "
            f"env.obs_mode: state, or env.obs.image_size and env.obs.cameras"
        )
    if cfg.obs_mode not in STATE_MODES + IMAGE_MODES:
        raise ValueError(f"env.obs_mode must be one of {', '.join(STATE_MODES + IMAGE_MODES)}, got {cfg.obs_mode!r}")
    if not cfg.tasks:
        raise ValueError("env.tasks must name at least one ManiSkill task id, e.g. PushCube-v1")


def resolve_backend(cfg: ManiSkillEnvConfig) -> str:
    if cfg.sim_backend != "auto":
        return cfg.sim_backend
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def make(cfg: ManiSkillEnvConfig, num_envs: int, rank: int = 0, seed: int = 0, group_size: int = 1):
    """Registry entry point. cpu: instance i of rank r runs the task `base.tasks_of` gives it;
    gpu: every instance of rank r runs `tasks[r % len(tasks)]` (one GPU scene set per process)."""
    validate(cfg)
    if num_envs < 1:
        raise ValueError(f"maniskill needs at least one environment per simulator rank, got {num_envs}")
    if resolve_backend(cfg) == "gpu":
        # SAPIEN holds one GPU physics system per process, so a gpu rank runs one task: ranks take turns.
        return GpuManiSkillVecEnv(cfg, [cfg.tasks[rank % len(cfg.tasks)]] * num_envs)
    return CpuManiSkillVecEnv(cfg, tasks_of(cfg.tasks, rank * num_envs, num_envs, group_size))
