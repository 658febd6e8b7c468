"""Pieces of the tiny VLAs (vla/tiny.py) and π0's stem: the FiLM vision stem, the Llama call, initialisation.

`VisionStem` turns each camera image into one token: a FiLM-conditioned conv stem pooled into keypoints (spatial
softmax), which learns the toy task's reaching fast. Details: docs/models.md
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn


class FiLM(nn.Module):
    """Per-channel scale and shift from a conditioning vector, starting as the identity."""

    def __init__(self, cond_dim: int, channels: int):
        super().__init__()
        # Own parameters rather than a child nn.Linear: transformers re-initialises
        # modules that hold parameters, and this keeps the identity init in one place.
        self.weight = nn.Parameter(torch.empty(2 * channels, cond_dim))
        self.bias = nn.Parameter(torch.empty(2 * channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Zero weights make scale 1 and shift 0: the stem starts language-blind and
        # learns how much the instruction should modulate it.
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = F.linear(cond, self.weight, self.bias).chunk(2, dim=-1)
        return x * (1 + scale[..., None, None]) + shift[..., None, None]


class SpatialSoftmax(nn.Module):
    """Expected (x, y) image position of each of `num_keypoints` learned feature maps."""

    def __init__(self, channels: int, num_keypoints: int):
        super().__init__()
        self.keypoints = nn.Conv2d(channels, num_keypoints, kernel_size=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        maps = self.keypoints(features)  # [N, K, H, W]
        n, k, h, w = maps.shape
        attention = maps.flatten(2).float().softmax(dim=-1)  # softmax in fp32 whatever the weights' dtype
        ys, xs = coordinate_grid(h, w, features.device)
        x = (attention * xs.flatten()).sum(-1)
        y = (attention * ys.flatten()).sum(-1)
        return torch.stack([x, y], dim=-1).reshape(n, 2 * k).to(features.dtype)


def coordinate_grid(h: int, w: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row and column coordinates in [-1, 1], each float [h, w]."""
    ys = torch.linspace(-1.0, 1.0, h, device=device)
    xs = torch.linspace(-1.0, 1.0, w, device=device)
    rows, cols = torch.meshgrid(ys, xs, indexing="ij")
    return rows, cols


class VisionStem(nn.Module):
    """Two FiLM-modulated 3x3 convolutions over RGB + x/y channels, spatial softmax, one token.

    The first convolution has stride 2: on a 2-core CPU, full-resolution
    features made the stem ~10x slower (fwd+bwd of 256 32x32 images: 330 ms
    against 32 ms) and the keypoint softmax still localises to sub-pixel.
    """

    def __init__(self, channels: int, num_keypoints: int, cond_dim: int, hidden_size: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3 + 2, channels, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.film1 = FiLM(cond_dim, channels)
        self.film2 = FiLM(cond_dim, channels)
        self.pool = SpatialSoftmax(channels, num_keypoints)
        self.proj = nn.Linear(2 * num_keypoints, hidden_size)

    def forward(self, images: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """uint8 [B, cams, H, W, 3] and cond [B, D] -> one token per camera [B, cams, hidden]."""
        b, cams, h, w, _ = images.shape
        x = images.reshape(b * cams, h, w, 3).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        ys, xs = coordinate_grid(h, w, x.device)
        coords = torch.stack([xs, ys]).expand(b * cams, 2, h, w)
        x = torch.cat([x, coords], dim=1).to(self.conv1.weight.dtype)
        cond = cond.repeat_interleave(cams, dim=0)
        x = F.relu(self.film1(self.conv1(x), cond))
        x = F.relu(self.film2(self.conv2(x), cond))
        return self.proj(self.pool(x)).reshape(b, cams, -1)


def run_lm(
    lm: nn.Module,
    embeds: torch.Tensor,
    mask: torch.Tensor,
    past=None,
    past_mask: Optional[torch.Tensor] = None,
    use_cache: bool = False,
):
    """Causal LM over `embeds` (after `past`), positions counted over real tokens only.

    Returns (hidden [B, T, H], full mask, cache). Counting positions from the
    mask makes the output independent of how much left padding a batch has.
    """
    full_mask = mask if past_mask is None else torch.cat([past_mask, mask], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)[:, -embeds.shape[1] :]
    cache_kwargs = {_cache_arg_name(): past} if past is not None else {}
    out = lm(
        inputs_embeds=embeds, attention_mask=full_mask, position_ids=positions, use_cache=use_cache, **cache_kwargs
    )
    cache = out[1] if use_cache else None  # by position: the field's name changed in transformers 5.2x
    return out.last_hidden_state, full_mask, cache


@functools.cache
def _cache_arg_name() -> str:
    # transformers 5.2x renamed LlamaModel.forward's `past_key_values` to `cache`.
    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def init_module(module: nn.Module, std: float = 0.02) -> None:
    """The film stem's initialisation: fan-in convolutions, identity FiLM, N(0, std) linears and embeddings."""
    if isinstance(module, FiLM):
        module.reset_parameters()
    elif isinstance(module, nn.Conv2d):
        module.reset_parameters()  # PyTorch's fan-in init: 0.02 normal starves a small conv stem
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=std)
    elif "RMSNorm" in type(module).__name__:
        nn.init.ones_(cast(torch.Tensor, module.weight))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, exp(log_std)^2)."""
    return -0.5 * ((x - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
