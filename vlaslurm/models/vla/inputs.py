"""Batched inputs of a released VLA during rollouts and updates: frames to pixel values, prompts, padding.

`predict_action` (prismatic/) preprocesses one frame with PIL exactly as the release does. A rollout batch stays
on the policy's device instead: frames are resized with torch's antialiased bicubic, which equals the release
when a frame already has the towers' size (LIBERO renders at 224) and differs by about one grey level otherwise.
Sequences are left-padded so that every row's prompt ends at the same index, with positions counted over real
tokens, so a row's output does not depend on the batch it is served in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from vlaslurm.models.prismatic.preprocess import CENTER_CROP_SCALE, ImageTransform, TextEncoder, prompt_token_ids


def pixel_values(
    images: torch.Tensor, transform: ImageTransform, center_crop: bool, dtype: torch.dtype
) -> torch.Tensor:
    """uint8 [B, N, H, W, 3] frames of N cameras -> [B, 6 N, S, S] (tower-normalised, cameras on channels)."""
    if images.dtype != torch.uint8 or images.ndim != 5 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [B, cameras, H, W, 3], got {images.dtype} {list(images.shape)}")
    batch, cameras, height, width, _ = images.shape
    unit = images.reshape(batch * cameras, height, width, 3).permute(0, 3, 1, 2).float().div(255)
    if center_crop:
        unit = _center_box(unit, CENTER_CROP_SCALE)
    size = transform.towers[0].size
    if unit.shape[-2:] != (size, size):
        unit = F.interpolate(unit, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
        unit = unit.clamp(0.0, 1.0)
    towers = []
    for tower in transform.towers:
        mean = torch.tensor(tower.mean, device=unit.device)[:, None, None]
        std = torch.tensor(tower.std, device=unit.device)[:, None, None]
        towers.append((unit - mean) / std)
    fused = torch.cat(towers, dim=1)  # [B N, 6, S, S]
    return fused.reshape(batch, cameras * fused.shape[1], size, size).to(dtype)


def _center_box(unit: torch.Tensor, crop_scale: float) -> torch.Tensor:
    """The centred box keeping `crop_scale` of the area (each side scaled by its square root), not resized yet.

    The release's eval crops with TF's crop_and_resize (prismatic/preprocess.py:center_crop, bit-equal there); a
    rollout uses this box plus the bicubic resize, which agrees with it to within interpolation differences.
    """
    height, width = unit.shape[-2:]
    side = math.sqrt(crop_scale)
    h, w = max(1, round(height * side)), max(1, round(width * side))
    top, left = (height - h) // 2, (width - w) // 2
    return unit[..., top : top + h, left : left + w]


class PromptIds:
    """Instruction -> the release's prompt ids (`<bos> In: What action ... Out: ▁`), remembered per instruction
    (a task suite has few instructions, and the tokenizer is the slowest part of a small batch)."""

    def __init__(self, tokenizer: TextEncoder, template: str = "openvla") -> None:
        self.tokenizer, self.template = tokenizer, template
        self._ids: Dict[str, List[int]] = {}

    def __call__(self, instruction: str) -> List[int]:
        if instruction not in self._ids:
            self._ids[instruction] = prompt_token_ids(self.tokenizer, instruction, self.template)
        return self._ids[instruction]


@dataclass
class Packed:
    """A left-padded multimodal batch: the last `tail` positions are the same kind in every row."""

    embeddings: torch.Tensor  # [B, S, H]
    mask: torch.Tensor  # long [B, S]: 1 = token, 0 = left padding
    positions: torch.Tensor  # long [B, S]: 0, 1, ... over each row's real tokens

    @property
    def length(self) -> int:
        return int(self.embeddings.shape[1])


def assemble(
    text: torch.Tensor,
    lengths: Sequence[int],
    prefix: torch.Tensor,
    tail: Optional[torch.Tensor] = None,
) -> Packed:
    """Rows `[<bos>, prefix, prompt[1:], tail]`, left-padded, as the release orders them (patches after <bos>).

    text [B, L, H]: each row's prompt embeddings, right-padded to L (row b has `lengths[b]` real ones); prefix
    [B, P, H]: image (and proprio) tokens; tail [B, K, H]: what follows the prompt in every row (OFT's slots).
    One gather from `[<bos>, prefix, text[1:], tail]`: a loop over rows made the backward quadratic in the batch
    (each row's slice assignment copies a whole-batch gradient).
    """
    hidden, width, patches = text.shape[-1], text.shape[1], prefix.shape[1]
    slots = 0 if tail is None else tail.shape[1]
    full = torch.cat([text[:, :1], prefix, text[:, 1:]] + ([] if tail is None else [tail]), dim=1)
    n = torch.tensor(list(lengths), device=text.device)
    longest = patches + int(n.max()) + slots
    # k: each output position's index within its row's real tokens (negative in the left padding)
    k = torch.arange(longest, device=text.device)[None] - (longest - (patches + n + slots))[:, None]
    head = patches + n[:, None]  # <bos>, the prefix and prompt[1:] stand at the start of `full`
    mask = (k >= 0).long()
    source = torch.where(k < head, k, k - head + patches + width).clamp(min=0) * mask  # the tail after text
    embeddings = full.gather(1, source[..., None].expand(-1, -1, hidden)) * mask[..., None].to(full.dtype)
    return Packed(embeddings, mask, positions_of(mask))


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted over real tokens only (left padding gets 0)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def padded_ids(prompts: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """long [B, L] prompt ids right-padded with 0 (their embeddings are never read: see `assemble`)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids.to(device)


def row_uniforms(seeds: Optional[torch.Tensor], batch: int, count: int, device: torch.device) -> Optional[torch.Tensor]:
    """float [B, count] uniforms, each row from its own seed (a sample does not depend on the batch it was
    served in, nor on the process's RNG); None without seeds."""
    if seeds is None:
        return None
    rows = [torch.rand(count, generator=torch.Generator().manual_seed(int(s))) for s in seeds.tolist()]
    return (torch.stack(rows) if rows else torch.zeros(batch, count)).to(device)


def row_normals(seeds: Optional[torch.Tensor], shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """float [B, *shape[1:]] standard normals, per row from its seed when seeds are given."""
    if seeds is None:
        return torch.randn(*shape, device=device)
    rows = [torch.randn(*shape[1:], generator=torch.Generator().manual_seed(int(s))) for s in seeds.tolist()]
    return (torch.stack(rows) if rows else torch.zeros(*shape)).to(device)
