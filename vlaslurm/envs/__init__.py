"""Simulator adapters behind one interface, chosen by `env.type` (heavy imports are lazy)."""

from __future__ import annotations

from typing import Callable, Optional

from vlaslurm.envs.base import Observation, StepResult, VecEnv, tasks_of
from vlaslurm.spec.env_types import EnvConfig, SyntheticEnvConfig
from vlaslurm.spec.registry import Registry

# The simulator of each env.type (its config class is registered in vlaslurm/spec/env_types.py):
# "module:function" building a VecEnv, imported only when that type is used.
ENVS: Registry[Callable[..., VecEnv]] = Registry("env", "simulator")
ENVS.lazy("synthetic", "vlaslurm.envs.synthetic:make")
ENVS.lazy("toy", "vlaslurm.envs.toy:make")
ENVS.lazy("maniskill", "vlaslurm.envs.maniskill:make")
ENVS.lazy("libero", "vlaslurm.envs.libero:make")
ENVS.lazy("robotwin", "vlaslurm.envs.robotwin:make")


def make_env(cfg: EnvConfig, num_envs: int, rank: int, seed: int, group_size: int = 1) -> VecEnv:
    """Build `num_envs` instances of `cfg.type` for simulator rank `rank`.

    Instance i of rank r has global id `r * num_envs + i` for seeding, so ranks
    never duplicate each other's episodes; tasks go by GRPO group of
    `group_size` global ids (`base.tasks_of`), so a group plays one task.
    """
    return ENVS.get(cfg.type)(cfg, num_envs=num_envs, rank=rank, seed=seed, group_size=group_size)


def known_action_dim(cfg: EnvConfig) -> Optional[int]:
    """The action size `cfg` takes, where it is known without starting the simulator (what `plan` checks a
    checkpoint against); None where only the simulator knows (RoboTwin's embodiment, ManiSkill's native actions)."""
    if cfg.type == "toy":
        return 2
    if cfg.type == "libero":
        return 7
    if cfg.type == "maniskill" and getattr(cfg, "action_convention", None) == "vla":
        return 7  # the adapter checks the simulator's own size against it when it starts
    return None


def known_state_dim(cfg: EnvConfig) -> Optional[int]:
    """The state size `cfg`'s simulator gives (its `state_dim`), where it is known without starting it (what
    `plan` checks a saved policy's proprio input against); None where only the simulator knows (ManiSkill's and
    RoboTwin's depend on the task and the embodiment)."""
    if cfg.type == "toy":
        from vlaslurm.envs.toy import ToyReachVecEnv

        return ToyReachVecEnv.state_dim
    if cfg.type == "libero":
        from vlaslurm.envs.libero import STATE_DIM

        return STATE_DIM if cfg.obs.state else 0
    if isinstance(cfg, SyntheticEnvConfig):
        return cfg.state_dim
    return None


__all__ = [
    "ENVS",
    "Observation",
    "StepResult",
    "VecEnv",
    "known_action_dim",
    "known_state_dim",
    "make_env",
    "tasks_of",
]
