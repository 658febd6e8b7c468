"""Tiny random-init configurations of the released-VLA policies (`model.path: null`), no files needed.

`build_tiny` returns the same `OpenVLATokenPolicy` / `OFTChunkPolicy` a released checkpoint gets, over a small
module tree with the release's child names (`vision_backbone`, `projector`, `language_model`) and the release's
token layout (Llama-2 ids, vocabulary 32064 with <PAD> 32000, the action ids 31744..31999, the prompt template),
so the quickstart, the tests and a 7B run take one code path. Two vision backbones:

- `film-stem` (`StemVLA`): the toy task's fast learner, common.py's `VisionStem` (FiLM-conditioned conv stem,
  spatial softmax), one token per camera, FiLM-conditioned on the mean embedding of the instruction's words
  (by default; the whole prompt's mean is `film_text="prompt"`).
- `dinosiglip`: the release's fused DINOv2 + SigLIP towers and projector at tiny size (`tiny_release_config`),
  frames resized to 224 as the release's preprocessing does.

Words are hashed (`HashedTextEncoder`), so no tokenizer file is read; the ids avoid every id the Llama-2 layout
fixes. The OFT heads are the release's (`L1RegressionActionHead`, `ProprioProjector`); proprio is read raw (no
dataset statistics at random init). The 32064-row token embeddings stay frozen by default (random rows already
tell words apart; trained densely, each small update took 1.25x as long: benchmarks/tiny_update_cost.py), and so
does the LM head where no head reads it (OFT's L1 head): such tensors are rebuilt from the seed, so checkpoints and
publications leave them out.
`save_pretrained` writes the build arguments and the weights; `load_tiny` reads them back.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, cast

import torch
from torch import nn
from transformers import LlamaForCausalLM

from vlaslurm.models.checkpoint import CONFIG_FILE, TINY_MODEL_TYPE
from vlaslurm.models.common import VisionStem, init_module
from vlaslurm.models.prismatic.actions import ActionBins
from vlaslurm.models.prismatic.oft import L1RegressionActionHead, ProprioProjector
from vlaslurm.models.prismatic.preprocess import BOS_ID, EMPTY_TOKEN_ID, ImageTransform, prompt_token_ids
from vlaslurm.models.prismatic.release import (
    PAD_TOKEN_ID,
    SINGLE_WEIGHTS_FILE,
    TINY_TEXT_CONFIG,
    build_vla,
    tiny_release_config,
)
from vlaslurm.models.prismatic.vla import llama_config
from vlaslurm.models.vla.base import PolicyShape, ReleaseImages, VLAPolicy
from vlaslurm.models.vla.bins import CentreCategorical
from vlaslurm.models.vla.oft import OFTChunkPolicy
from vlaslurm.models.vla.openvla import OpenVLATokenPolicy
from vlaslurm.spec.model_types import BackboneConfig

Kind = Literal["openvla", "openvla-oft"]
Vision = Literal["film-stem", "dinosiglip"]
Projector = Literal["identity", "linear"]

# The Llama-2 layout's fixed ids, which hashed words must not take: <unk> 0, <s> 1, </s> 2, the byte tokens
# 3..258, '▁' 29871; the action ids 31744..31999 (the last 256 of the unpadded 32000); <PAD> 32000 and the
# padding rows up to 32063.
FIRST_WORD_ID = 259
ACTION_BINS = ActionBins()  # 256 bins on the last ids of the 32000-id vocabulary
FIRST_ACTION_ID = ACTION_BINS.vocab_size - ACTION_BINS.n_bins  # 31744
RESERVED_IDS = frozenset({0, 1, 2, EMPTY_TOKEN_ID, PAD_TOKEN_ID})  # the single fixed ids among them


class HashedTextEncoder:
    """Lower-cased, whitespace-split words hashed (crc32) into the ids 259..31743 except 29871; no vocabulary.

    `encode(text)` is `[<bos>] + word ids`, what the release tokenizer's `encode` gives (ids only), so
    `prompt_token_ids` applies the release's prompt template and appends '▁' as for a real tokenizer.
    """

    word_ids = FIRST_ACTION_ID - FIRST_WORD_ID - 1  # 31484: the free range, less the '▁' id inside it

    def word_id(self, word: str) -> int:
        index = FIRST_WORD_ID + zlib.crc32(word.lower().encode("utf-8")) % self.word_ids
        return index + 1 if index >= EMPTY_TOKEN_ID else index  # step over 29871

    def encode(self, text: str) -> List[int]:
        return [BOS_ID] + [self.word_id(w) for w in text.split()]


def tiny_llama(backbone: BackboneConfig) -> LlamaForCausalLM:
    """A randomly initialised `LlamaForCausalLM` of the backbone's size with the release's vocabulary and defaults."""
    if backbone.hidden_size % backbone.num_heads:
        raise ValueError(
            f"model.backbone.hidden_size ({backbone.hidden_size}) must be divisible by num_heads ({backbone.num_heads})"
        )
    return LlamaForCausalLM(llama_config(text_config(backbone), "model.backbone"))


def text_config(backbone: BackboneConfig) -> Dict[str, Any]:
    """The release's tiny `text_config` (vocabulary 32064, pad 32000) at the backbone's size."""
    return {
        **TINY_TEXT_CONFIG,
        "hidden_size": backbone.hidden_size,
        "intermediate_size": backbone.intermediate_size,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_heads,
        "num_key_value_heads": backbone.num_heads,
    }


class StemVLA(nn.Module):
    """A VLA with the release's child names over the FiLM stem: one token per camera into a tiny Llama."""

    def __init__(self, backbone: BackboneConfig, projector: Projector = "identity") -> None:
        super().__init__()
        hidden = backbone.hidden_size
        self.vision_backbone = VisionStem(backbone.vision_channels, backbone.num_keypoints, hidden, hidden)
        self.vision_backbone.apply(init_module)  # the look-alike's init: fan-in convs, identity FiLM, 0.02 linears
        self.projector: nn.Module = nn.Identity()
        if projector == "linear":
            self.projector = nn.Linear(hidden, hidden)
            init_module(self.projector)
        self.language_model = tiny_llama(backbone)

    @property
    def dtype(self) -> torch.dtype:
        return self._embeddings().dtype

    @property
    def device(self) -> torch.device:
        return self._embeddings().device

    def _embeddings(self) -> torch.Tensor:
        return cast(nn.Embedding, self.language_model.get_input_embeddings()).weight


@dataclasses.dataclass(frozen=True)
class StemImages:
    """`ImageEncoder` of a `StemVLA`: FiLM conditioned on the mean of each row's prompt embeddings, RMS-normalised
    (embeddings start at std 0.02, where FiLM would barely move), as common.py's PromptEncoder.

    The mean runs over positions `skip_head .. length - skip_tail` of each row: all real tokens by default, or
    only the instruction's words when the skips are the prompt template's fixed head and tail (`template_skips`).
    """

    skip_head: int = 0
    skip_tail: int = 0

    def __call__(self, vla: nn.Module, images: torch.Tensor, text: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        positions = torch.arange(text.shape[1], device=text.device)[None]
        ends = torch.tensor(lengths, device=text.device)[:, None] - self.skip_tail
        real = (positions >= self.skip_head) & (positions < ends)
        summary = (text * real[..., None]).sum(1) / real.sum(1, keepdim=True).clamp(min=1)
        summary = summary * torch.rsqrt(summary.pow(2).mean(-1, keepdim=True) + 1e-6)
        stem = cast(StemVLA, vla)
        return stem.projector(stem.vision_backbone(images, summary))  # [B, cams, H]


def template_skips(tokenizer: HashedTextEncoder) -> Tuple[int, int]:
    """(head, tail): how many prompt ids precede and follow the instruction's words in every prompt (the
    template's `<bos> In: What action should the robot take to` and `Out: ▁`; the last word keeps its '?',
    so the two probes differ there)."""
    a, b = (prompt_token_ids(tokenizer, text) for text in ("one", "two three"))
    head = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    tail = next(i for i, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y)
    return head, tail


def build_tiny(
    kind: Kind,
    backbone: BackboneConfig,
    *,
    action_chunk: int,
    action_dim: int,
    state_dim: int,
    image_size: int,
    num_cameras: int,
    seed: int,
    vision: Vision = "film-stem",
    head: Literal["l1", "discrete"] = "l1",
    std: Literal["learned", "scheduled"] = "learned",
    init_std: float = 0.5,
    final_std: float = 0.1,
    temperature: float = 1.0,
    projector: Projector = "identity",
    head_init_std: Optional[float] = 0.01,
    film_text: Literal["prompt", "instruction"] = "instruction",
    train_embeddings: bool = False,
) -> VLAPolicy:
    """A seeded random-init policy of `kind` (the caller's RNG state is left as it was).

    `projector` (film-stem only): what maps the stem's token to the LLM ('identity': the stem's own output
    layer already does). `head_init_std`: the std of the L1 head's last layer (`model.fc2`, bias zero), small so
    that early samples are dominated by the exploration std, as the look-alike's head; None keeps torch's init.
    `film_text` (film-stem only): what the stem's FiLM reads, the mean embedding of the instruction's words
    ('instruction') or of the whole prompt ('prompt': the template's 11 fixed tokens then dilute the instruction;
    on the quickstart task it reached 50% success 15-17k env steps later, benchmarks/results/tiny_vla_learning.md).
    `train_embeddings`: train the token embeddings too (and an LM head no head reads), else they stay frozen.
    """
    recipe = {k: v for k, v in locals().items() if k != "backbone"}  # the arguments, as save_pretrained records them
    recipe["backbone"] = dataclasses.asdict(backbone)
    if num_cameras <= 0 or image_size <= 0:
        raise ValueError("a VLA reads camera images: set env.obs.image_size and env.obs.cameras")
    if kind not in ("openvla", "openvla-oft"):
        raise ValueError(f"kind must be 'openvla' or 'openvla-oft', got {kind!r}")
    if vision not in ("film-stem", "dinosiglip"):
        raise ValueError(f"vision must be 'film-stem' or 'dinosiglip', got {vision!r}")
    shape = PolicyShape(action_chunk, action_dim)
    categorical = CentreCategorical(ACTION_BINS, temperature)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vla: nn.Module
        if vision == "film-stem":
            vla = StemVLA(backbone, projector)
            skips = template_skips(HashedTextEncoder()) if film_text == "instruction" else (0, 0)
            images: Any = StemImages(*skips)
        else:
            config = dataclasses.replace(tiny_release_config(), text_config=text_config(backbone))
            vla = build_vla(config, device="cpu")
            images = ReleaseImages(ImageTransform())
        common: Dict[str, Any] = dict(tokenizer=HashedTextEncoder(), images=images, shape=shape)
        policy: VLAPolicy
        if kind == "openvla":
            policy = OpenVLATokenPolicy(vla, categorical=categorical, **common)
        else:
            hidden = backbone.hidden_size
            action_head = L1RegressionActionHead(hidden, action_dim)
            if head_init_std is not None:
                nn.init.normal_(action_head.model.fc2.weight, std=head_init_std)
                nn.init.zeros_(action_head.model.fc2.bias)
            proprio = ProprioProjector(hidden, state_dim) if state_dim > 0 else None
            policy = OFTChunkPolicy(
                vla,
                head=head,
                categorical=categorical,
                action_head=action_head,
                std=std,
                init_std=init_std,
                final_std=final_std,
                proprio_projector=proprio,
                **common,
            )
    policy.recipe = recipe
    _freeze(policy, train_embeddings)
    return policy


def _freeze(policy: VLAPolicy, train_embeddings: bool) -> None:
    frozen: List[torch.Tensor] = []
    if not train_embeddings:
        frozen.append(cast(nn.Embedding, policy.llm.get_input_embeddings()).weight)
        if isinstance(policy, OFTChunkPolicy) and policy.head == "l1":
            frozen.append(policy.llm.lm_head.weight)
    for parameter in frozen:
        parameter.requires_grad_(False)
    ids = {id(p) for p in frozen}
    policy.frozen = frozenset(name for name, p in policy.named_parameters() if id(p) in ids)


def load_tiny(folder: Path) -> VLAPolicy:
    """The policy `save_pretrained` wrote for a tiny random init: rebuilt from its arguments, weights loaded
    strictly."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("model_type") != TINY_MODEL_TYPE or not isinstance(config.get("build_tiny"), dict):
        raise ValueError(f"{folder / CONFIG_FILE} is not a tiny policy's (model_type {TINY_MODEL_TYPE!r})")
    recipe = dict(config["build_tiny"])
    policy = build_tiny(recipe.pop("kind"), BackboneConfig(**recipe.pop("backbone")), **recipe)
    policy.load_state_dict(load_file(str(folder / SINGLE_WEIGHTS_FILE)), strict=True)
    return policy
