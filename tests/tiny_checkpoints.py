"""Tiny random checkpoints in exactly the released layout, for tests that load them through `model.path`.

`write_tiny_release` writes an OpenVLA release folder (config.json, safetensors, tokenizer, dataset statistics,
preprocessor config) built from `tiny_release_config`; with `oft=True` it adds the OFT head files, so the folder is
an OpenVLA-OFT release. `write_tiny_adapter` writes a peft LoRA adapter folder over such a release. Both are
deterministic for a seed, and cheap (a few MB, well under a second each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Sequence, Union, cast

import torch
from torch import nn

from vlaslurm.models.prismatic.lora import LoraSettings, apply_lora, lora_layers, save_adapter
from vlaslurm.models.prismatic.oft import L1RegressionActionHead, ProprioProjector, save_oft_heads
from vlaslurm.models.prismatic.release import (
    build_vla,
    llama_layout_tokenizer,
    load_pretrained,
    save_release_layout,
    tiny_release_config,
)

PathLike = Union[str, Path]
SHARD_SIZE = "8MB"


def tiny_array_stats(dim: int, low: float, high: float, masked_last: bool, offset: float = 0.0) -> Dict[str, Any]:
    """One statistics entry of `dim` dimensions with bounds away from [-1, 1], so un-normalising is visible.

    q01/q99 differ per dimension (dimension i spans [low + 0.1 i + offset, high + 0.3 i + offset]); with
    `masked_last` the last dimension is not normalised, as the release's gripper.
    """
    q01 = [round(low + 0.1 * i + offset, 6) for i in range(dim)]
    q99 = [round(high + 0.3 * i + offset, 6) for i in range(dim)]
    return {
        "q01": q01,
        "q99": q99,
        "min": [v - 0.5 for v in q01],
        "max": [v + 0.5 for v in q99],
        "mean": [round((a + b) / 2, 6) for a, b in zip(q01, q99)],
        "std": [round((b - a) / 4, 6) for a, b in zip(q01, q99)],
        "mask": [True] * (dim - 1) + [not masked_last],
    }


def tiny_norm_stats(datasets: Sequence[str], action_dim: int, proprio_dim: int) -> Dict[str, Any]:
    """dataset_statistics.json's content: per dataset an `action` and a `proprio` entry, plus the counts.

    Each dataset gets its own offset, so picking the wrong `unnorm_key` changes the actions.
    """
    out: Dict[str, Any] = {}
    for i, name in enumerate(datasets):
        out[name] = {
            "action": tiny_array_stats(action_dim, -0.5, 1.5, masked_last=True, offset=0.25 * i),
            "proprio": tiny_array_stats(proprio_dim, -2.0, 3.0, masked_last=False, offset=0.5 * i),
            "num_transitions": 1000 + i,
            "num_trajectories": 10 + i,
        }
    return out


# 4x4 patches instead of 16x16: the same modules, config fields and preprocessing, at a sequence ~5x shorter, so
# runs that train a tiny release on two shared cores spend their time in the runtime rather than in attention.
RUNTIME_IMAGE_SIZE = 56


def write_tiny_release(
    folder: PathLike,
    *,
    oft: bool = False,
    action_dim: int = 7,
    proprio_dim: int = 8,
    datasets: Sequence[str] = ("libero_spatial_no_noops",),
    seed: int = 0,
    image_size: int = 224,
) -> Path:
    """A tiny random OpenVLA release folder at `folder` (created); OpenVLA-OFT's with `oft=True`. Returns it.

    `image_size` is the towers' input side (config.json `image_sizes`, preprocessor_config.json): the release's
    224 by default; RUNTIME_IMAGE_SIZE for tests that run jobs through the release's code path."""
    if not datasets:
        raise ValueError("datasets must name at least one statistics entry")
    norm_stats = tiny_norm_stats(datasets, action_dim, proprio_dim)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG stays as it was
        torch.manual_seed(seed)
        vla = build_vla(tiny_release_config(norm_stats, image_size), device="cpu").eval()
        # ~18 MB in four shards with their index, as the 7B releases are stored (a single file is another path).
        out = save_release_layout(vla, folder, llama_layout_tokenizer(), norm_stats, max_shard_size=SHARD_SIZE)
        if oft:
            width = vla.language_model.config.hidden_size
            head = L1RegressionActionHead(width, action_dim).eval()
            projector = ProprioProjector(width, proprio_dim).eval()
            save_oft_heads(out, head, projector)
    return out


def write_tiny_adapter(release_folder: PathLike, adapter_folder: PathLike, rank: int = 4, seed: int = 0) -> Path:
    """A peft LoRA adapter folder over `release_folder` (recorded as its base), with non-zero B so it matters."""
    vla = load_pretrained(release_folder).model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        apply_lora(vla, LoraSettings(rank=rank, alpha=float(rank)))
        with torch.no_grad():  # a fresh adapter has B = 0 and would leave the model unchanged
            for layer in lora_layers(vla).values():
                for module in cast(nn.ModuleDict, layer.lora_B).values():
                    cast(nn.Linear, module).weight.normal_(0.0, 0.05)
    return save_adapter(vla, adapter_folder, Path(release_folder))
