"""Build the RL policy of `model.type` openvla / openvla-oft from the spec's model section (`build`, the registry's
entry): a released checkpoint (or a LoRA adapter over one), a tiny policy this project saved, or a tiny random
init (vla/tiny.py). All three are the same policy classes.

A release's VLA is built on the meta device and filled from the folder's shards strictly (prismatic/release.py), in
the spec's precision; LoRA adapters go in place (prismatic/lora.py), so the release's parameter names stay. A sharded
trainer leaves the VLA on the meta device (`ReleaseWeights`) and reads each rank's slices itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple, Union

import torch
from torch import nn

from vlaslurm.models.checkpoint import check_checkpoint
from vlaslurm.models.prismatic.actions import DatasetStats
from vlaslurm.models.prismatic.lora import LoraSettings, apply_lora, load_adapter
from vlaslurm.models.prismatic.oft import (
    ACTION_HEAD,
    PROPRIO_PROJECTOR,
    OFTShape,
    find_component_file,
    load_action_head,
    load_proprio_projector,
)
from vlaslurm.models.prismatic.release import (
    CONFIG_FILE,
    build_vla,
    load_image_transform,
    load_norm_stats,
    load_tokenizer,
    load_weights,
    read_release_config,
)
from vlaslurm.models.prismatic.vla import PrismaticVLA
from vlaslurm.models.vla.base import PolicyShape, ReleaseImages, VLAPolicy
from vlaslurm.models.vla.bins import CentreCategorical
from vlaslurm.models.vla.oft import OFTChunkPolicy
from vlaslurm.models.vla.openvla import OpenVLATokenPolicy
from vlaslurm.models.vla.tiny import build_tiny, load_tiny
from vlaslurm.spec.model_types import OpenVLAConfig, OpenVLAOFTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VLAConfig = Union[OpenVLAConfig, OpenVLAOFTConfig]
VLA_PREFIX = "vla."  # of the VLA's tensors in a VLAPolicy's state dict (the attribute `vla`)
RANDOM_INIT_TRAINED = ("vision_backbone", "projector")  # what trains in full beside LoRA over a random init


@dataclass(frozen=True)
class ReleaseWeights:
    """Where the weights of a VLA left on the meta device are: the release folder, the prefix of the VLA's tensors
    in the policy's state dict, and the dtype the release is loaded in (the spec's `model.precision`)."""

    folder: Path
    prefix: str
    dtype: torch.dtype


def build(cfg: VLAConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> VLAPolicy:
    """The policy of `cfg`: `cfg.path` a release or adapter folder (`build_released`), a folder a tiny policy's
    `save_pretrained` wrote, or None for a seeded tiny random init; LoRA from `model.lora` in every case."""
    from vlaslurm.models.checkpoint import is_released_checkpoint

    if cfg.path and is_released_checkpoint(cfg.path):
        return build_released(cfg, action_dim, state_dim, image_size, num_cameras)
    if cfg.path:
        check_checkpoint(cfg, action_dim, state_dim=state_dim)  # the checks `plan` makes, with the env's sizes
        policy = load_tiny(Path(cfg.path).expanduser())
    else:
        policy = build_tiny(
            cfg.type,  # type: ignore[arg-type]  # the registry maps only these two types here
            cfg.backbone,
            action_chunk=cfg.action_chunk,
            action_dim=action_dim,
            state_dim=state_dim,
            image_size=image_size,
            num_cameras=num_cameras,
            seed=cfg.init_seed,
            vision=cfg.vision,
            temperature=cfg.temperature,
            **_oft_fields(cfg),
        )
    for part in (policy.vla, getattr(policy, "action_head", None), policy.proprio_projector):
        if part is not None:  # in the spec's precision, as a release's VLA and head files load (not the critic)
            part.to(DTYPES[cfg.precision])
    # LoRA over a random init: its vision backbone has nothing pretrained to keep, so it trains in full (frozen at
    # random, the quickstart's stem left a LoRA run at 0.11-0.16 success by 60k env steps, below the 0.33 of
    # ignoring the instruction).
    _add_adapters(policy.vla, cfg, None, trainable_extra=RANDOM_INIT_TRAINED)
    policy.publish_merged = cfg.lora is not None and cfg.lora.publish == "merged"
    if cfg.lora is not None:  # what apply_lora left trainable besides the adapters: the modules above
        trainable = (name for name, p in policy.vla.named_parameters() if p.requires_grad and ".lora_" not in name)
        policy.full_trained = frozenset(VLA_PREFIX + name for name in trainable)
    return policy


def _oft_fields(cfg: VLAConfig) -> dict:
    if not isinstance(cfg, OpenVLAOFTConfig):
        return {}
    return dict(head=cfg.head, std=cfg.std, init_std=cfg.init_std, final_std=cfg.final_std)


def deferred_release(cfg: VLAConfig) -> Optional[ReleaseWeights]:
    """The release a sharded trainer can read slice by slice: a release folder in `model.path` without LoRA (LoRA
    under fsdp is refused at load; an adapter folder's base is loaded whole). None otherwise."""
    from vlaslurm.models.checkpoint import checkpoint_folders, is_released_checkpoint

    if not cfg.path or not is_released_checkpoint(cfg.path) or cfg.lora is not None:
        return None
    folders = checkpoint_folders(cfg)
    return None if folders.adapter is not None else ReleaseWeights(folders.release, VLA_PREFIX, DTYPES[cfg.precision])


def build_released(
    cfg: VLAConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int, load_vla: bool = True
) -> VLAPolicy:
    """The policy of `cfg.path` (a release folder, or an adapter folder over `cfg.base_path`) on the CPU. Without
    `load_vla` the VLA stays on the meta device (its heads are real): for a trainer that shards it and then reads
    each rank's slices (`deferred_release`)."""
    from vlaslurm.models.checkpoint import checkpoint_folders

    # What plan checked, now against the environment's own sizes (plan knows them only for some env types).
    check_checkpoint(cfg, action_dim, state=state_dim > 0, images=num_cameras > 0 and image_size > 0)
    folders = checkpoint_folders(cfg)
    dtype = DTYPES[cfg.precision]
    release = folders.release
    config = read_release_config(release / CONFIG_FILE)
    stats = load_norm_stats(release).select(cfg.unnorm_key)
    vla = build_vla(config, device="meta", dtype=dtype)
    if load_vla:
        load_weights(vla, release, dtype, "cpu")
    _add_adapters(vla, cfg, folders.adapter)
    shape = PolicyShape(cfg.action_chunk, action_dim)
    common = dict(
        tokenizer=load_tokenizer(release),
        images=ReleaseImages(load_image_transform(release, config), cfg.center_crop),
        shape=shape,
    )
    categorical = CentreCategorical(config.action_bins(), cfg.temperature)
    policy: VLAPolicy
    if isinstance(cfg, OpenVLAOFTConfig):
        policy = _oft(vla, cfg, release, stats, state_dim, dtype, common, categorical)
    else:
        policy = OpenVLATokenPolicy(vla, categorical=categorical, **common)
    policy.source = release
    policy.publish_merged = cfg.lora is not None and cfg.lora.publish == "merged"
    return policy


def _add_adapters(
    vla: nn.Module, cfg: VLAConfig, adapter: Optional[Path], trainable_extra: Tuple[str, ...] = ()
) -> None:
    """`model.lora` adapters (and the modules under `trainable_extra` trained in full), then the adapter folder's
    weights (which must then have the same settings)."""
    if cfg.lora is not None:
        apply_lora(vla, dataclasses.replace(LoraSettings.of(cfg.lora), trainable_extra=trainable_extra))
    if adapter is not None:
        load_adapter(vla, adapter)


def _oft(
    vla: PrismaticVLA,
    cfg: OpenVLAOFTConfig,
    release: Path,
    stats: DatasetStats,
    state_dim: int,
    dtype: torch.dtype,
    common: dict,
    categorical: CentreCategorical,
) -> OFTChunkPolicy:
    llm_dim = vla.language_model.config.hidden_size
    head_file = find_component_file(release, ACTION_HEAD)
    projector_file = find_component_file(release, PROPRIO_PROJECTOR)
    shape = OFTShape(cfg.action_chunk, common["shape"].action_dim, max(state_dim, 1))
    head = None if head_file is None else load_action_head(head_file, shape, llm_dim, dtype, "cpu")
    projector = None  # check_checkpoint made sure the environment gives the state a projector reads
    if projector_file is not None:
        projector = load_proprio_projector(projector_file, shape, llm_dim, dtype, "cpu")
    return OFTChunkPolicy(
        vla,
        head=cfg.head,
        categorical=categorical,
        action_head=head,
        std=cfg.std,
        init_std=cfg.init_std,
        final_std=cfg.final_std,
        proprio_projector=projector,
        proprio_stats=stats.proprio,
        **common,
    )
