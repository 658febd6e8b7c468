"""What both released-VLA policies share: the loaded VLA, its inputs, the value head, LoRA state dicts.

A `VLAPolicy` wraps a `PrismaticVLA` (release parameter names under `vla.`) with a value head on the LLM's final
hidden state, a parameter-sharing critic as in RLinf's OpenVLA recipes. Subclasses decide the actions: autoregressive
tokens (`openvla`) or one parallel pass over a chunk (`openvla-oft`).
Details: docs/models.md
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Protocol, Tuple, Union, cast

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaForCausalLM

from vlaslurm.models.base import PolicyInput
from vlaslurm.models.checkpoint import TINY_MODEL_TYPE
from vlaslurm.models.prismatic.actions import ArrayStats, Normalization, normalize_proprio_torch
from vlaslurm.models.prismatic.lora import (
    adapter_state_dict,
    fold_publication,
    fold_sources,
    lora_layers,
    merged_state_dict,
    unwrap_adapters,
)
from vlaslurm.models.prismatic.oft import project_images
from vlaslurm.models.prismatic.preprocess import ImageTransform, TextEncoder
from vlaslurm.models.prismatic.release import (
    CONFIG_FILE,
    DATASET_STATISTICS_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    GENERATION_CONFIG_FILE,
    PREPROCESSOR_FILE,
    SINGLE_WEIGHTS_FILE,
    TOKENIZER_CONFIG_FILES,
    TOKENIZER_FILE,
    save_weights,
)
from vlaslurm.models.prismatic.vla import PrismaticVLA
from vlaslurm.models.vla.inputs import Packed, PromptIds, assemble, padded_ids, pixel_values

# What a saved policy keeps of its source release besides the weights (which it writes merged).
RELEASE_METADATA_FILES = (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    PREPROCESSOR_FILE,
    DATASET_STATISTICS_FILE,
    TOKENIZER_FILE,
    "tokenizer.model",
    "added_tokens.json",
    *TOKENIZER_CONFIG_FILES,
)
VALUE_HEAD_FILE = "value_head.safetensors"


class ImageEncoder(Protocol):
    """Camera frames to LLM tokens with the VLA's own modules; the text lets a backbone condition on language."""

    def __call__(self, vla: nn.Module, images: torch.Tensor, text: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        """uint8 [B, N, H, W, 3] frames, prompt embeddings [B, L, H] -> image tokens [B, N * P, H]."""


@dataclass(frozen=True)
class ReleaseImages:
    """The release's fused DINOv2 + SigLIP towers and projector, on batched, tower-normalised frames."""

    transform: ImageTransform
    center_crop: bool = False

    def __call__(self, vla: nn.Module, images: torch.Tensor, text: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        dtype = text.dtype
        return project_images(cast(PrismaticVLA, vla), pixel_values(images, self.transform, self.center_crop, dtype))


@dataclass(frozen=True)
class PolicyShape:
    """What one decision produces: `chunk` actions of `action_dim`, executed open-loop."""

    chunk: int
    action_dim: int

    @property
    def tokens(self) -> int:
        return self.chunk * self.action_dim


class VLAPolicy(nn.Module):
    """A released VLA as an RL policy: shared inputs and critic; `act` / `evaluate` in the subclasses."""

    def __init__(
        self,
        vla: nn.Module,
        tokenizer: TextEncoder,
        images: ImageEncoder,
        shape: PolicyShape,
        proprio_projector: Optional[nn.Module] = None,
        proprio_stats: Optional[ArrayStats] = None,
        normalization: Normalization = "bounds_q99",
    ) -> None:
        super().__init__()
        self.vla = vla
        self.proprio_projector = proprio_projector
        hidden = cast(LlamaForCausalLM, vla.language_model).config.hidden_size
        device = next(vla.parameters()).device
        if device.type == "meta":  # the VLA's weights come later, into a sharded trainer's shards: real heads
            device = torch.device("cpu")
        # float32 whatever the VLA's dtype: a bf16 value head would round returns of ~1e2 to 3 digits
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32, device=device)
        nn.init.normal_(self.value_head.weight, std=0.02)
        nn.init.zeros_(self.value_head.bias)
        self.shape = shape
        self.prompts = PromptIds(tokenizer)
        self.images = images
        self.proprio_stats, self.normalization = proprio_stats, normalization
        self.source: Optional[Path] = None  # the release folder it was loaded from (save_pretrained copies its files)
        # A tiny random init (vla/tiny.py): its build arguments, what save_pretrained records instead of a release's
        # files, and the state-dict keys it never trains (rebuilt from its seed, so neither checkpointed nor sent).
        self.recipe: Optional[Dict[str, Any]] = None
        self.frozen: FrozenSet[str] = frozenset()
        # Under LoRA, VLA parameters that train in full beside the adapters (a random init's vision backbone).
        self.full_trained: FrozenSet[str] = frozenset()
        self.publish_merged = False  # model.lora.publish: merged (set by the builder)
        self.served_merged: Optional[List[str]] = None  # a generator's copy that takes merged publications

    @property
    def action_chunk(self) -> int:
        return self.shape.chunk

    @property
    def action_dim(self) -> int:
        return self.shape.action_dim

    @property
    def llm(self) -> LlamaForCausalLM:
        """The VLA's language model (a stock transformers Llama)."""
        return cast(LlamaForCausalLM, self.vla.language_model)

    @property
    def device(self) -> torch.device:
        return self.value_head.weight.device

    # --- inputs ---------------------------------------------------------------------------------------------
    def prefix(self, inp: PolicyInput, text: torch.Tensor, lengths: List[int]) -> torch.Tensor:
        """[B, P, H]: the image tokens of every camera, then the proprio token if the policy reads proprio."""
        if inp.images is None:
            raise ValueError("a VLA needs camera images: set env.obs.image_size and env.obs.cameras")
        tokens = self.images(self.vla, inp.images.to(self.device), text, lengths)
        if self.proprio_projector is None:
            return tokens
        if inp.state is None:
            raise ValueError("this checkpoint has a proprio projector: set env.obs.state: true")
        state = inp.state.to(self.device, torch.float32)
        if self.proprio_stats is not None:
            state = normalize_proprio_torch(state, self.proprio_stats, self.normalization)
        return torch.cat([tokens, self.proprio_projector(state.to(tokens.dtype))], dim=1)

    def text(self, instructions: List[str]) -> Tuple[torch.Tensor, List[int]]:
        """Prompt embeddings [B, L, H] (right-padded) and each row's prompt length."""
        prompts = [self.prompts(i) for i in instructions]
        embeddings = self.llm.get_input_embeddings()(padded_ids(prompts, self.device))
        return embeddings, [len(p) for p in prompts]

    def sequence(self, inp: PolicyInput, tail: Optional[torch.Tensor] = None) -> Packed:
        """The left-padded `[<bos>, patches, (proprio), prompt[1:], tail]` batch."""
        text, lengths = self.text(inp.instructions)
        return assemble(text, lengths, self.prefix(inp, text, lengths), tail)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.llm.get_input_embeddings()(token_ids)

    # --- critic ---------------------------------------------------------------------------------------------
    def value(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [...] values of final hidden states [..., H]."""
        return self.value_head(hidden.float()).squeeze(-1)

    # --- weights --------------------------------------------------------------------------------------------
    def has_adapters(self) -> bool:
        return bool(lora_layers(self.vla))

    def adapter_state_dict(self) -> Dict[str, torch.Tensor]:
        """The VLA's LoRA tensors under peft's saved names (what an adapter folder holds)."""
        return adapter_state_dict(self.vla)

    def trained_state_dict(self) -> Dict[str, torch.Tensor]:
        """What training changes, which is what a checkpoint needs beside `model.path`: with LoRA the adapters and
        everything outside the VLA (heads, std), without it the whole state dict."""
        return self._trained(self.state_dict())

    def _trained(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if self.served_merged is not None:  # what a merged publication holds: the adapted layers' weights, heads
            merged = set(self.served_merged) | self.full_trained
            return {key: t for key, t in state.items() if not key.startswith("vla.") or key in merged}
        if not self.has_adapters():
            return {key: t for key, t in state.items() if key not in self.frozen}
        keep = self.full_trained
        return {key: t for key, t in state.items() if not key.startswith("vla.") or ".lora_" in key or key in keep}

    def save_pretrained(self, folder: Union[str, Path]) -> Path:
        """A release folder of the trained policy, adapters merged, that `model.path` (and `vlaslurm eval`) loads:
        the source release's tokenizer, statistics and configs, the merged weights, OFT's head files, and the
        value head in `value_head.safetensors` (no release reads it; a later run of this project may)."""
        out = Path(folder)
        if self.source is None:
            if self.recipe is None:
                raise ValueError("this policy was neither loaded from a release folder nor built by build_tiny")
            return self._save_recipe(out)
        out.mkdir(parents=True, exist_ok=True)
        for path in self.source.iterdir():
            if path.is_file() and path.name in RELEASE_METADATA_FILES:
                shutil.copy2(path, out / path.name)
        save_weights(self.merged_state_dict(), out, DEFAULT_MAX_SHARD_SIZE)
        self.save_heads(out)
        save_file(
            {k: t.detach().cpu().contiguous() for k, t in self.value_head.state_dict().items()},
            str(out / VALUE_HEAD_FILE),
        )
        return out

    def _save_recipe(self, out: Path) -> Path:
        """A tiny random init's folder: config.json (`model_type` TINY_MODEL_TYPE, the build arguments) and every
        tensor, adapters merged, in one safetensors file; vla/tiny.py `load_tiny` reads it back."""
        out.mkdir(parents=True, exist_ok=True)
        state = {key: t for key, t in self.state_dict().items() if not key.startswith("vla.")}
        state.update({"vla." + key: t for key, t in self.merged_state_dict().items()})
        save_file({k: t.detach().cpu().contiguous() for k, t in state.items()}, str(out / SINGLE_WEIGHTS_FILE))
        config = {"model_type": TINY_MODEL_TYPE, "build_tiny": self.recipe}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return out

    def save_heads(self, folder: Path) -> None:
        """Head files beside the VLA's weights (OFT's action head and proprio projector); none for OpenVLA."""

    def merged_state_dict(self) -> Dict[str, torch.Tensor]:
        """The VLA's weights under the release's names, adapters folded in (`W + scale B A`); without adapters,
        the VLA's own state dict. The heads (value, OFT's action head) are not part of a release's weights."""
        if not self.has_adapters():
            return {key: t.detach() for key, t in self.vla.state_dict().items()}
        return merged_state_dict(self.vla)

    # --- weight publications (models.publication_state) --------------------------------------------------------
    def publication_sources(self) -> Dict[str, torch.Tensor]:
        """The live tensors a weight publication is made of: what trains, and under `model.lora.publish: merged`
        each adapted layer's frozen base weight too (the merge needs it; a sharded trainer gathers them all)."""
        live = self.state_dict()
        trained = self._trained(live)
        if not self.publish_merged:
            return trained
        return {**trained, **{name: live[name] for name in fold_sources(self.vla, "vla.")}}

    def fold_publication(self, full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """What the generators get from the full `publication_sources`: under `publish: merged` the adapted layers'
        merged weights and the heads, else the sources themselves."""
        return fold_publication(self.vla, full, "vla.") if self.publish_merged else full

    def serve_merged(self) -> int:
        """A generator's copy under `publish: merged`: adapters folded into plain layers (no adapter cost per
        forward); from then on `trained_state_dict` names what a merged publication holds. Returns how many."""
        if self.publish_merged and self.served_merged is None:
            _, names = unwrap_adapters(self.vla)
            self.served_merged = ["vla." + name for name in names]
        return len(self.served_merged or [])
