"""VLA policies chosen by `model.type` (heavy imports are lazy)."""

from __future__ import annotations

from typing import Callable

from vlaslurm.models.base import Policy, PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.models.checkpoint import CheckpointError, check_checkpoint, env_action_transform, load_pretrained
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.registry import Registry

# The policy of each model.type (its config class is registered in vlaslurm/spec/model_types.py):
# "module:function" building a Policy, imported only when that type is used.
POLICIES: Registry[Callable[..., Policy]] = Registry("model", "policy")
POLICIES.lazy("synthetic", "vlaslurm.models.synthetic:build")
POLICIES.lazy("openvla", "vlaslurm.models.openvla:build")
POLICIES.lazy("openvla-oft", "vlaslurm.models.openvla_oft:build")
POLICIES.lazy("pi0", "vlaslurm.models.pi0.build:build")


def build_policy(cfg: ModelConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> Policy:
    """Build the policy of `cfg.type`: loaded from `cfg.path` when set, else randomly initialised."""
    build = POLICIES.get(cfg.type)
    return build(cfg, action_dim=action_dim, state_dim=state_dim, image_size=image_size, num_cameras=num_cameras)


__all__ = [
    "POLICIES",
    "CheckpointError",
    "Policy",
    "PolicyEval",
    "PolicyInput",
    "PolicyOutput",
    "build_policy",
    "check_checkpoint",
    "env_action_transform",
    "load_pretrained",
]
