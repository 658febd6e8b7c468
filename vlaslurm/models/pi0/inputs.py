"""A batch of observations as the PaliGemma prefix of transformers' PI0 reads it.

The prompt is PI0Processor's: `<image>` x (tokens per camera x cameras), `<bos>`, the instruction, `\\n`,
right-padded with the attention mask marking real tokens (positions are counted over them, so a row's output does
not depend on its batch). Frames are resized (bicubic, antialiased) to the vision tower's size and scaled to
[-1, 1] (PI0ImageProcessor's mean and std 0.5); the state is zero-padded to `max_state_dim`, as the processor pads.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol

import torch
import torch.nn.functional as F

NEWLINE = "\n"


class TextEncoder(Protocol):
    """Instruction -> the ids of `instruction + '\\n'` (no special tokens) and the `<bos>` id."""

    @property
    def bos_id(self) -> int: ...

    def encode(self, text: str) -> List[int]: ...


@dataclass(frozen=True)
class HashedWords:
    """A tokenizer without files for tiny policies: lower-cased words hashed (crc32) into [4, vocab_size);
    0 pad, 1 eos, 2 bos, 3 the newline."""

    vocab_size: int
    bos_id: int = 2
    newline_id: int = 3
    first_word_id: int = 4

    def encode(self, text: str) -> List[int]:
        span = self.vocab_size - self.first_word_id
        words = [self.first_word_id + zlib.crc32(w.lower().encode("utf-8")) % span for w in text.split()]
        return words + [self.newline_id]


class ReleaseText:
    """A release folder's tokenizer (transformers' PaliGemma tokenizer), encoding as PI0Processor does."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bos_id = int(tokenizer.bos_token_id)

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text + NEWLINE, add_special_tokens=False))


@dataclass(frozen=True)
class PromptLayout:
    """What the prompt's fixed part needs from the PI0 config."""

    image_token_id: int
    tokens_per_image: int
    image_size: int
    max_state_dim: int

    @classmethod
    def of(cls, config: Any) -> PromptLayout:
        vision = config.vlm_config.vision_config
        return cls(
            image_token_id=int(config.vlm_config.image_token_id),
            tokens_per_image=(vision.image_size // vision.patch_size) ** 2,
            image_size=int(vision.image_size),
            max_state_dim=int(config.max_state_dim),
        )


def prompt_ids(
    layout: PromptLayout, text: TextEncoder, instructions: List[str], cameras: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int64 [B, L], attention_mask int64 [B, L]), right-padded with id 0."""
    head = [layout.image_token_id] * (layout.tokens_per_image * cameras) + [text.bos_id]
    rows = [head + text.encode(i) for i in instructions]
    length = max((len(r) for r in rows), default=len(head))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    return ids.to(device), mask.to(device)


def pixel_values(layout: PromptLayout, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [B, N, H, W, 3] -> [B, N, 3, S, S] in [-1, 1]."""
    if images.dtype != torch.uint8 or images.ndim != 5 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [B, cameras, H, W, 3], got {images.dtype} {list(images.shape)}")
    batch, cameras, height, width, _ = images.shape
    unit = images.reshape(batch * cameras, height, width, 3).permute(0, 3, 1, 2).float().div(255)
    size = layout.image_size
    if (height, width) != (size, size):
        unit = F.interpolate(unit, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
        unit = unit.clamp(0.0, 1.0)
    return ((unit - 0.5) / 0.5).reshape(batch, cameras, 3, size, size).to(dtype)


def padded_state(layout: PromptLayout, state: Optional[torch.Tensor], batch: int, device: torch.device) -> torch.Tensor:
    """float32 [B, max_state_dim]: the state zero-padded (zeros without one)."""
    out = torch.zeros(batch, layout.max_state_dim, device=device)
    if state is None:
        return out
    if state.shape[-1] > layout.max_state_dim:
        raise ValueError(f"the state has {state.shape[-1]} dimensions, more than max_state_dim {layout.max_state_dim}")
    out[:, : state.shape[-1]] = state.to(device, torch.float32)
    return out
