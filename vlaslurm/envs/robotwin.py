"""RoboTwin 2.0 tasks behind the `VecEnv` interface (`env.type: robotwin`).

RoboTwin is a checkout (`env.root`, else `$ROBOTWIN_ROOT`), driven the way its own evaluation
(`script/eval_policy.py`) does: task configs, seeds skipped when unstable, generated
instructions, `take_action` steps. Actions (`qpos` or `ee`) pass through unchanged. Each instance
runs in its own process (`vlaslurm.envs._procs`), started in the RoboTwin root.
Details (episodes, actions, observations): docs/simulators.md
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vlaslurm.envs._procs import call_each, check_ids, close_all, reset_seeds, stack_rows, start_all, step_result
from vlaslurm.envs.base import EnvIds, Observation, StepResult, tasks_of
from vlaslurm.spec.env_types import RoboTwinEnvConfig

ROOT_ENV = "ROBOTWIN_ROOT"
CAMERA_ALIASES = {
    "head": "head_camera",
    "head_camera": "head_camera",
    "left_wrist": "left_camera",
    "left_camera": "left_camera",
    "right_wrist": "right_camera",
    "right_camera": "right_camera",
    "front": "front_camera",
    "front_camera": "front_camera",
}
EE_ACTION_DIM = 16


def resolve_root(cfg: RoboTwinEnvConfig) -> Optional[str]:
    return cfg.root or os.environ.get(ROOT_ENV) or None


def root_problems(root: Optional[str]) -> List[str]:
    """What is missing from a RoboTwin checkout (empty: looks complete)."""
    if not root:
        return [f"RoboTwin location unknown: set env.root or ${ROOT_ENV} to a RoboTwin 2.0 checkout"]
    path = Path(root)
    if not path.is_dir():
        return [f"RoboTwin root {root} does not exist (env.root / ${ROOT_ENV})"]
    found = [
        f"RoboTwin root {root} has no {part} (is it a RoboTwin 2.0 checkout?)"
        for part in ("envs/_base_task.py", "task_config", "description/utils")
        if not (path / part).exists()
    ]
    found += [
        f"RoboTwin assets missing: {path / 'assets' / part} (run `python assets/_download.py` in {root})"
        for part in ("embodiments", "objects")
        if not (path / "assets" / part).is_dir()
    ]
    return found


def camera_name(name: str) -> str:
    if name not in CAMERA_ALIASES:
        raise ValueError(
            f"env.obs.cameras: unknown RoboTwin camera {name!r}; known: {', '.join(sorted(CAMERA_ALIASES))}"
        )
    return CAMERA_ALIASES[name]


def episode_args(root: str, task: str, task_config: str, want_rgb: bool) -> Dict[str, Any]:
    """The keyword arguments of `setup_demo`, assembled as RoboTwin's `eval_policy.main` assembles them."""
    import yaml

    configs = Path(root) / "task_config"
    with open(configs / f"{task_config}.yml", encoding="utf-8") as f:
        args = yaml.safe_load(f)
    with open(configs / "_embodiment_config.yml", encoding="utf-8") as f:
        embodiments = yaml.safe_load(f)
    with open(configs / "_camera_config.yml", encoding="utf-8") as f:
        cameras = yaml.safe_load(f)
    args.update(
        task_name=task, task_config=task_config, eval_mode=True, render_freq=0, eval_video_log=False, save_data=False
    )
    head = args["camera"]["head_camera_type"]
    args["head_camera_h"], args["head_camera_w"] = cameras[head]["h"], cameras[head]["w"]
    kinds = args["embodiment"]
    files = [embodiments[k]["file_path"] for k in kinds[:2]]
    if len(kinds) == 1:
        args.update(left_robot_file=files[0], right_robot_file=files[0], dual_arm_embodied=True)
    elif len(kinds) == 3:
        args.update(
            left_robot_file=files[0], right_robot_file=files[1], embodiment_dis=kinds[2], dual_arm_embodied=False
        )
    else:
        raise ValueError(f"{configs / task_config}.yml: embodiment must have 1 or 3 items, got {kinds}")
    for side in ("left", "right"):
        with open(Path(root) / args[f"{side}_robot_file"] / "config.yml", encoding="utf-8") as f:
            args[f"{side}_embodiment_config"] = yaml.safe_load(f)
    args["data_type"] = dict(args.get("data_type", {}), rgb=want_rgb, qpos=True)
    return args


class RoboTwinInstance:
    """One RoboTwin task in one process."""

    def __init__(
        self, root: str, task: str, cfg: RoboTwinEnvConfig, cameras: List[str], size: int, want_state: bool, index: int
    ) -> None:
        os.chdir(root)  # RoboTwin's configs name files relative to its root
        for path in (root, os.path.join(root, "description", "utils")):
            if path not in sys.path:
                sys.path.insert(0, path)
        self.task, self.cfg, self.index = task, cfg, index
        self.cameras, self.size, self.want_state = cameras, size, want_state
        self.args = episode_args(root, task, cfg.task_config, want_rgb=bool(cameras))
        self.env = getattr(importlib.import_module(f"envs.{task}"), task)()
        self.unstable = importlib.import_module("envs.utils.create_actor").UnStableError
        self.describe = importlib.import_module("generate_episode_instructions").generate_episode_descriptions
        left, right = (
            self.args[f"{s}_embodiment_config"]["arm_joints_name"][k] for s, k in (("left", 0), ("right", 1))
        )
        self.action_dim = len(left) + len(right) + 2 if cfg.action_type == "qpos" else EE_ACTION_DIM
        self.episodes = 0
        self.live = False
        self.instruction = ""

    def info(self) -> Dict[str, Any]:
        return {"action_dim": self.action_dim, "state_dim": self.action_dim if self.want_state else 0}

    def reset(self, seed: Optional[int]) -> Tuple[Any, ...]:
        first = int(seed) if seed is not None else 100000 * (1 + self.index) + self.episodes
        for tries in range(self.cfg.max_seed_tries):
            params = self._usable(first + tries)
            if params is not None:
                break
        else:
            raise RuntimeError(
                f"RoboTwin {self.task}: no usable seed in [{first}, {first + self.cfg.max_seed_tries}) "
                f"(unstable scenes or failed expert; raise env.max_seed_tries)"
            )
        used = first + tries
        self.env.setup_demo(now_ep_num=self.episodes, seed=used, is_test=True, **self.args)
        self.live = True
        self.instruction = self._instruction(params, used)
        self.env.set_instruction(instruction=self.instruction)
        self.episodes += 1
        return (*self._observe(), self.instruction, used)

    def step(self, action: np.ndarray) -> Tuple[Any, ...]:
        self.env.take_action(np.asarray(action, np.float64), action_type=self.cfg.action_type)
        success = bool(self.env.eval_success)
        limit = self.env.step_lim is not None and self.env.take_action_cnt >= self.env.step_lim
        return (*self._observe(), float(success), success, bool(limit) and not success)

    def close(self) -> None:
        self._close_episode()

    def _usable(self, seed: int) -> Optional[Dict[str, Any]]:
        """Episode parameters for `seed` ({} without the expert check), or None if RoboTwin would skip it."""
        self._close_episode()
        if not self.cfg.expert_check:
            return {}
        try:
            self.env.setup_demo(now_ep_num=self.episodes, seed=seed, is_test=True, **dict(self.args, render_freq=0))
            info = self.env.play_once()
            ok = bool(self.env.plan_success and self.env.check_success())
        except self.unstable:
            ok, info = False, None
        finally:
            self.live = True
            self._close_episode()
        return (info or {}).get("info", {}) if ok else None

    def _instruction(self, params: Dict[str, Any], seed: int) -> str:
        rng = np.random.default_rng(seed)
        if params:
            options = self.describe(self.task, [params], 100)[0][self.cfg.instruction_type]
            if options:
                return str(rng.choice(options))
        import json

        path = Path("description", "task_instruction", f"{self.task}.json")
        data = json.loads(path.read_text()) if path.is_file() else {}
        plain = [s for s in data.get(self.cfg.instruction_type, []) if "{" not in s]
        if plain:
            return str(rng.choice(plain))
        return data.get("full_description", self.task.replace("_", " ")).replace("<", "").replace(">", "")

    def _close_episode(self) -> None:
        if self.live:
            self.env.close_env(clear_cache=True)
            self.live = False

    def _observe(self) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        obs = self.env.get_obs()
        images = None
        if self.cameras:
            frames = []
            for name in self.cameras:
                if name not in obs["observation"]:
                    raise ValueError(
                        f"env.obs.cameras: RoboTwin rendered no {name}; it has {sorted(obs['observation'])}"
                    )
                frames.append(_resize(np.asarray(obs["observation"][name]["rgb"])[..., :3], self.size))
            images = np.stack(frames)[None].astype(np.uint8)
        state = None
        if self.want_state:
            state = np.asarray(obs["joint_action"]["vector"], np.float32)[None]
        return images, state


def _resize(image: np.ndarray, size: int) -> np.ndarray:
    """Nearest-neighbour resize to size x size (no extra dependency; cameras are 320x240 and alike)."""
    h, w = image.shape[:2]
    rows = (np.arange(size) * h // size).clip(0, h - 1)
    cols = (np.arange(size) * w // size).clip(0, w - 1)
    return image[rows][:, cols]


class RoboTwinVecEnv:
    """`num_envs` RoboTwin instances, one process each."""

    thread_safe = True
    shared_device = False

    def __init__(self, cfg: RoboTwinEnvConfig, root: str, tasks: List[str], first_index: int) -> None:
        self.cfg, self.tasks, self.num_envs = cfg, tasks, len(tasks)
        wants_images = cfg.obs.image_size > 0 and bool(cfg.obs.cameras)
        cameras = [camera_name(c) for c in cfg.obs.cameras] if wants_images else []
        self.workers, infos = start_all(
            "RoboTwin",
            self.num_envs,
            "vlaslurm.envs.robotwin:RoboTwinInstance",
            lambda i: (root, tasks[i], cfg, cameras, cfg.obs.image_size, cfg.obs.state, first_index + i),
        )
        self.action_dim = infos[0]["action_dim"]
        self.state_dim = infos[0]["state_dim"]
        self.instructions = [""] * self.num_envs
        self.seeds_used = [-1] * self.num_envs
        self._elapsed = np.zeros(self.num_envs, np.int64)

    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        ids = check_ids(env_ids, self.num_envs)
        rows = call_each(self.workers, ids, "reset", reset_seeds(ids, seeds))
        for i, row in zip(ids, rows):
            self.instructions[i], self.seeds_used[i] = row[2], row[3]
        self._elapsed[ids] = 0
        return stack_rows(ids, rows, self.instructions)

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        ids = check_ids(env_ids, self.num_envs)
        actions = np.asarray(actions, np.float32)
        if actions.shape != (len(ids), self.action_dim):
            raise ValueError(f"actions must have shape ({len(ids)}, {self.action_dim}), got {actions.shape}")
        rows = call_each(self.workers, ids, "step", actions)  # the limit in a reply: RoboTwin's step_lim
        self._elapsed[ids] += 1
        return step_result(ids, rows, self._elapsed[ids], self.cfg.max_episode_steps, self.instructions)

    def close(self) -> None:
        close_all(self.workers)
        self.workers = []


def validate(cfg: RoboTwinEnvConfig, root: Optional[str]) -> str:
    problems = root_problems(root)
    if problems:
        raise ValueError("; ".join(problems))
    assert root is not None  # root_problems reports a missing root
    if cfg.action_type not in ("qpos", "ee"):
        raise ValueError(f"env.action_type must be qpos or ee, got {cfg.action_type!r}")
    if cfg.instruction_type not in ("seen", "unseen"):
        raise ValueError(f"env.instruction_type must be seen or unseen, got {cfg.instruction_type!r}")
    if cfg.max_seed_tries < 1:
        raise ValueError(f"env.max_seed_tries must be >= 1, got {cfg.max_seed_tries}")
    if not (Path(root) / "task_config" / f"{cfg.task_config}.yml").is_file():
        known = sorted(p.stem for p in (Path(root) / "task_config").glob("*.yml") if not p.stem.startswith("_"))
        raise ValueError(f"env.task_config {cfg.task_config!r} is not in {root}/task_config; known: {', '.join(known)}")
    missing = [t for t in cfg.tasks if not (Path(root) / "envs" / f"{t}.py").is_file()]
    if missing or not cfg.tasks:
        known = sorted(p.stem for p in (Path(root) / "envs").glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"env.tasks: unknown RoboTwin task(s) {missing or '(none given)'}; known: {', '.join(known)}")
    if cfg.obs.image_size > 0:
        for name in cfg.obs.cameras:
            camera_name(name)
    return str(root)


def make(cfg: RoboTwinEnvConfig, num_envs: int, rank: int = 0, seed: int = 0, group_size: int = 1) -> RoboTwinVecEnv:
    """Registry entry point: instance i of rank r plays the task `base.tasks_of` gives it."""
    root = validate(cfg, resolve_root(cfg))
    if num_envs < 1:
        raise ValueError(f"robotwin needs at least one environment per simulator rank, got {num_envs}")
    first = rank * num_envs
    return RoboTwinVecEnv(cfg, root, tasks_of(cfg.tasks, first, num_envs, group_size), first)
