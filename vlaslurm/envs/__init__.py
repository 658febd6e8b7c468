"""Simulator adapters behind one interface, chosen by `env.type` (heavy imports are lazy)."""
from __future__ import annotations

import importlib
from typing import Callable, Dict

from vlaslurm.envs.base import Observation, StepResult, VecEnv, tasks_of
from vlaslurm.spec.env_types import EnvConfig

# type name -> "module:function" building a VecEnv; imported only when used.
_BUILDERS: Dict[str, str] = {
    "synthetic": "vlaslurm.envs.synthetic:make",
    "toy": "vlaslurm.envs.toy:make",
    "maniskill": "vlaslurm.envs.maniskill:make",
    "libero": "vlaslurm.envs.libero:make",
    "robotwin": "vlaslurm.envs.robotwin:make",
}


def make_env(cfg: EnvConfig, num_envs: int, rank: int, seed: int, group_size: int = 1) -> VecEnv:
    """Build `num_envs` instances of `cfg.type` for simulator rank `rank`.

    Instance i of rank r has global id `r * num_envs + i` for seeding, so ranks
    never duplicate each other's episodes; tasks go by GRPO group of
    `group_size` global ids (`base.tasks_of`), so a group plays one task.
    """
    target = _BUILDERS.get(cfg.type)
    if target is None:
        raise ValueError(f"unknown env.type {cfg.type!r}; known types: {', '.join(sorted(_BUILDERS))}")
    module_name, func_name = target.split(":")
    builder: Callable[..., VecEnv] = getattr(importlib.import_module(module_name), func_name)
    return builder(cfg, num_envs=num_envs, rank=rank, seed=seed, group_size=group_size)


__all__ = ["Observation", "StepResult", "VecEnv", "make_env", "tasks_of"]
