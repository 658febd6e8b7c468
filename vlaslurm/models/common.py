"""Pieces shared by the OpenVLA-style policies: tokenizer, vision stem, backbone.

The backbone is a small causal Llama (transformers `LlamaModel`, configured in code) that reads
one left-padded sequence per observation, ``[pad ..., <bos>, instruction words, camera tokens,
state token]``; the heads read the last position. Each camera image becomes one token
(`VisionStem`: a FiLM-conditioned conv stem pooled into keypoints).
Details (why keypoints, loading a real checkpoint): docs/models.md
"""

from __future__ import annotations

import functools
import inspect
import math
import zlib
from contextlib import nullcontext
from dataclasses import asdict
from typing import TYPE_CHECKING, ContextManager, List, Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from vlaslurm.spec.model_types import BackboneConfig

if TYPE_CHECKING:
    from transformers import LlamaModel

PAD_ID = 0
BOS_ID = 1
_FIRST_WORD_ID = 2


class HashedWordTokenizer:
    """Lower-case words hashed (crc32) into ids [2, vocab_size - reserved); no vocabulary file.

    `reserved` ids at the top of the vocabulary are kept free (the action bins of
    the discrete policy live there). Pad is 0, <bos> is 1, and every sequence
    starts with <bos>, so no row is all padding.
    """

    def __init__(self, vocab_size: int, max_tokens: int, reserved: int = 0):
        self.num_word_ids = vocab_size - reserved - _FIRST_WORD_ID
        if self.num_word_ids < 1:
            raise ValueError(
                f"vocab_size {vocab_size} leaves no word ids after {reserved} reserved ids; raise vocab_size"
            )
        if max_tokens < 2:
            raise ValueError(f"max_instruction_tokens must be >= 2 (bos + one word), got {max_tokens}")
        self.max_tokens = max_tokens

    def word_id(self, word: str) -> int:
        return _FIRST_WORD_ID + zlib.crc32(word.lower().encode("utf-8")) % self.num_word_ids

    def encode(self, text: str) -> List[int]:
        """<bos> then word ids, cut to `max_tokens` (the leading words are kept)."""
        ids = [BOS_ID] + [self.word_id(w) for w in text.split()]
        return ids[: self.max_tokens]

    def __call__(self, texts: List[str], device: torch.device | str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask, long [B, L] with L = the longest instruction in the batch."""
        encoded = [self.encode(t) for t in texts]
        length = max(len(e) for e in encoded)
        ids = torch.full((len(texts), length), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(texts), length), dtype=torch.long)
        for row, e in enumerate(encoded):
            ids[row, length - len(e) :] = torch.tensor(e)
            mask[row, length - len(e) :] = 1
        return ids.to(device), mask.to(device)


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
        attention = maps.flatten(2).float().softmax(dim=-1)  # softmax in fp32 even under autocast
        ys, xs = coordinate_grid(h, w, features.device)
        x = (attention * xs.flatten()).sum(-1)
        y = (attention * ys.flatten()).sum(-1)
        return torch.stack([x, y], dim=-1).reshape(n, 2 * k)


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
        x = torch.cat([x, coords], dim=1)
        cond = cond.repeat_interleave(cams, dim=0)
        x = F.relu(self.film1(self.conv1(x), cond))
        x = F.relu(self.film2(self.conv2(x), cond))
        return self.proj(self.pool(x)).reshape(b, cams, -1)


def build_llama(backbone, vocab_size: int, max_positions: int) -> LlamaModel:
    """A randomly initialised causal Llama of the `BackboneConfig` size (transformers, no files)."""
    from transformers import LlamaConfig, LlamaModel

    if backbone.hidden_size % backbone.num_heads:
        raise ValueError(
            f"model.backbone.hidden_size ({backbone.hidden_size}) must be divisible by num_heads ({backbone.num_heads})"
        )
    # attn_implementation is one of PretrainedConfig's kwargs, which LlamaConfig's dataclass signature omits
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=backbone.hidden_size,
        intermediate_size=backbone.intermediate_size,
        num_hidden_layers=backbone.num_layers,
        num_attention_heads=backbone.num_heads,
        num_key_value_heads=backbone.num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaModel(config)


class PromptEncoder(nn.Module):
    """Builds the LM input for a batch: instruction embeddings, camera tokens, state token."""

    def __init__(self, backbone, vocab_size: int, reserved: int, state_dim: int, num_cameras: int):
        super().__init__()
        self.tokenizer = HashedWordTokenizer(vocab_size, backbone.max_instruction_tokens, reserved)
        max_positions = backbone.max_instruction_tokens + num_cameras + 1 + 512  # room for decoded tokens
        self.lm = build_llama(backbone, vocab_size, max_positions)
        hidden = backbone.hidden_size
        self.vision = (
            VisionStem(backbone.vision_channels, backbone.num_keypoints, hidden, hidden) if num_cameras > 0 else None
        )
        self.state_proj = nn.Linear(state_dim, hidden) if state_dim > 0 else None
        self.num_cameras = num_cameras
        self.state_dim = state_dim

    def forward(self, images: Optional[torch.Tensor], state: Optional[torch.Tensor], instructions: List[str]):
        """Prompt embeddings [B, T, hidden] and attention mask long [B, T]."""
        device = self.lm.embed_tokens.weight.device
        ids, mask = self.tokenizer(instructions, device)
        words = self.lm.embed_tokens(ids)
        parts, masks = [words], [mask]
        if self.vision is not None:
            if images is None:
                raise ValueError(f"this policy was built for {self.num_cameras} camera(s) but got no images")
            # The instruction summary that modulates vision: mean of the real words' embeddings,
            # RMS-normalised because embeddings start at std 0.02 and FiLM would barely move.
            summary = (words * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            summary = summary * torch.rsqrt(summary.pow(2).mean(-1, keepdim=True) + 1e-6)
            parts.append(self.vision(images.to(device), summary))
            masks.append(mask.new_ones(len(instructions), self.num_cameras))
        if self.state_proj is not None:
            if state is None:
                raise ValueError(f"this policy was built for a state of size {self.state_dim} but got no state")
            parts.append(self.state_proj(state.to(device=device, dtype=words.dtype))[:, None])
            masks.append(mask.new_ones(len(instructions), 1))
        return torch.cat(parts, dim=1), torch.cat(masks, dim=1)


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


def autocast_for(precision: str, device: torch.device) -> ContextManager:
    """Autocast context of `precision` (fp32 = none)."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if precision == "fp32":
        return nullcontext()
    if precision not in dtypes:
        raise ValueError(f"model.precision must be one of fp32, bf16, fp16; got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=dtypes[precision])


def init_module(module: nn.Module, std: float = 0.02) -> None:
    """Weight init shared by both policies (called by transformers for each module)."""
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


class VLAModelConfig(PretrainedConfig):
    """What every tiny VLA's `save_pretrained` writes to config.json: the shapes the network is built for.

    Each policy's config adds its own head's fields; `model_type` names the policy.
    """

    def __init__(
        self,
        action_dim: int = 7,
        action_chunk: int = 1,
        state_dim: int = 0,
        num_cameras: int = 1,
        image_size: int = 64,
        backbone: dict | None = None,
        precision: str = "fp32",
        **kwargs,
    ):
        self.action_dim = action_dim
        self.action_chunk = action_chunk
        self.state_dim = state_dim
        self.num_cameras = num_cameras
        self.image_size = image_size
        self.backbone = dict(backbone or asdict(BackboneConfig()))
        self.precision = precision
        super().__init__(**kwargs)


def shape_fields(cfg, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> dict:
    """The `VLAModelConfig` fields of a fresh policy: the spec's model section plus the simulator's shapes."""
    return {
        "action_dim": action_dim,
        "action_chunk": cfg.action_chunk,
        "state_dim": state_dim,
        "num_cameras": num_cameras if image_size > 0 else 0,
        "image_size": image_size,
        "backbone": asdict(cfg.backbone),
        "precision": cfg.precision,
    }


def init_seeded(policy_cls, config, seed: int):
    """A randomly initialised policy from `seed`, leaving the caller's random state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return policy_cls(config)
