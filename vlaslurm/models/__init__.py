"""VLA policies chosen by `model.type` (heavy imports are lazy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple, cast

from torch import nn

from vlaslurm.models.base import (
    Policy,
    PolicyEval,
    PolicyInput,
    PolicyOutput,
    load_trained_state,
    prepare_to_serve,
    publication_sources,
    publication_state,
    trained_state,
)
from vlaslurm.models.checkpoint import CheckpointError, check_checkpoint, env_action_transform, load_pretrained
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.registry import Registry

if TYPE_CHECKING:
    from vlaslurm.models.vla.build import ReleaseWeights

# The policy of each model.type (its config class is registered in vlaslurm/spec/model_types.py):
# "module:function" building a Policy, imported only when that type is used.
POLICIES: Registry[Callable[..., Policy]] = Registry("model", "policy")
POLICIES.lazy("synthetic", "vlaslurm.models.synthetic:build")
POLICIES.lazy("openvla", "vlaslurm.models.vla.build:build")
POLICIES.lazy("openvla-oft", "vlaslurm.models.vla.build:build")
POLICIES.lazy("pi0", "vlaslurm.models.pi0.build:build")


def build_policy(cfg: ModelConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> Policy:
    """Build the policy of `cfg.type`: loaded from `cfg.path` when set, else randomly initialised."""
    build = POLICIES.get(cfg.type)
    return build(cfg, action_dim=action_dim, state_dim=state_dim, image_size=image_size, num_cameras=num_cameras)


def build_policy_for_shards(
    cfg: ModelConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int
) -> Tuple[nn.Module, Optional[ReleaseWeights]]:
    """As `build_policy`, for a trainer that shards the policy: a released checkpoint's VLA stays on the meta device
    (its heads are built for real) and the caller fills each rank's shards from the returned `ReleaseWeights`
    (`algos.sharding.load_release_slices`), so that no rank ever holds the whole VLA. Other policies (a tiny random
    init or saved tiny policy, an adapter folder's base) are built whole, with None."""
    if cfg.type in ("openvla", "openvla-oft"):
        from vlaslurm.models.vla.build import build_released, deferred_release

        release = deferred_release(cfg)  # type: ignore[arg-type]  # the two VLA config types
        if release is not None:
            dims = dict(action_dim=action_dim, state_dim=state_dim, image_size=image_size, num_cameras=num_cameras)
            return build_released(cfg, **dims, load_vla=False), release  # type: ignore[arg-type]
    return cast(nn.Module, build_policy(cfg, action_dim, state_dim, image_size, num_cameras)), None


__all__ = [
    "POLICIES",
    "CheckpointError",
    "Policy",
    "PolicyEval",
    "PolicyInput",
    "PolicyOutput",
    "build_policy",
    "build_policy_for_shards",
    "check_checkpoint",
    "env_action_transform",
    "load_pretrained",
    "prepare_to_serve",
    "publication_sources",
    "publication_state",
    "load_trained_state",
    "trained_state",
]
