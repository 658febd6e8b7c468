"""The OpenVLA release's model (`OpenVLAForActionPrediction`) as a plain module with the release's parameter names.

`PrismaticVLA` holds `vision_backbone` (DINOv2 + SigLIP), `projector` and `language_model` (a stock transformers
`LlamaForCausalLM`), so a release state dict loads as is. `forward` inserts the 256 projected patches after <bos>;
`predict_action` is the release's greedy 7-token decode, de-tokenised and un-normalised.
Facts: /work/shared/facts/openvla-checkpoints.md, sections 2, 3, 5, 6 and 8.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from vlaslurm.models.prismatic.actions import ActionBins, ArrayStats, unnormalize_actions
from vlaslurm.models.prismatic.preprocess import EMPTY_TOKEN_ID, STOP_TOKEN_ID
from vlaslurm.models.prismatic.projector import FusedGeluMLPProjector
from vlaslurm.models.prismatic.vit import DinoSigLIPBackbone, DinoV2Config, SigLIPConfig
from vlaslurm.spec.errors import close_names

# transformers 4.40.1's `LlamaConfig()` defaults, which the release's `text_config` is read against (it stores only
# the fields that differ). Spelled out so that a later transformers changing a default cannot change the model.
LLAMA_DEFAULTS: Dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,  # not Llama-2-7b-hf's own 1e-5: the release was built from the bare defaults
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": False,
}
# text_config keys that describe the checkpoint rather than the architecture; they do not reach LlamaConfig.
TEXT_CONFIG_METADATA = ("model_type", "torch_dtype", "dtype", "transformers_version", "architectures")
OTHER_LLAMA_KEYS = ("pad_token_id", "rope_theta", "rope_scaling", "head_dim", "mlp_bias", "attention_dropout")
# The KV cache's argument (and output) name: `cache` in transformers >= 5.2x, `past_key_values` before.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def llama_config(text_config: Mapping[str, Any], where: str = "text_config") -> LlamaConfig:
    """The release's LLM config: the 4.40.1 `LlamaConfig()` defaults, then `text_config`, with SDPA attention."""
    model_type = text_config.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{where}.model_type is {model_type!r}; only 'llama' (Llama-2 backbones) is implemented")
    fields = {key: value for key, value in text_config.items() if key not in TEXT_CONFIG_METADATA}
    valid = (*LLAMA_DEFAULTS, *OTHER_LLAMA_KEYS)
    unknown = [key for key in fields if key not in valid]
    if unknown:
        hints = {key: close_names(key, valid) for key in unknown}
        described = ", ".join(f"{k!r} (did you mean {', '.join(h)}?)" if h else repr(k) for k, h in hints.items())
        raise ValueError(f"{where} has unknown key(s) {described}; valid keys: {', '.join(valid)}")
    # SDPA as the release ran it: with an all-ones mask it is plain causal attention, whatever the mask's length.
    arguments: Dict[str, Any] = {**LLAMA_DEFAULTS, **fields, "attn_implementation": "sdpa"}
    return LlamaConfig(**arguments)


class PrismaticVLA(nn.Module):
    """Fused vision backbone, projector and Llama; `state_dict()` keys are the release's (982 at full size)."""

    def __init__(self, dino: DinoV2Config, siglip: SigLIPConfig, text_config: LlamaConfig) -> None:
        super().__init__()
        self.vision_backbone = DinoSigLIPBackbone(dino, siglip)
        self.projector = FusedGeluMLPProjector(self.vision_backbone.embed_dim, text_config.hidden_size)
        self.language_model = LlamaForCausalLM(text_config)

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.fc1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.projector.fc1.weight.device

    def multimodal_inputs(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(embeddings [B, 1 + P + T-1, H], mask or None): `[<bos>, P patches, input_ids[:, 1:]]`, patches unmasked."""
        if input_ids.ndim != 2 or input_ids.shape[0] != pixel_values.shape[0]:
            raise ValueError(
                f"input_ids must be [B, T] with B = pixel_values' batch ({pixel_values.shape[0]}), "
                f"got {list(input_ids.shape)}"
            )
        patches = self.projector(self.vision_backbone(pixel_values.to(self.dtype)))
        text = self.language_model.get_input_embeddings()(input_ids)
        # The release inserts the patches after <bos> (input_ids[:, 0]), not before it.
        embeddings = torch.cat([text[:, :1], patches, text[:, 1:]], dim=1)
        if attention_mask is None:
            return embeddings, None
        patch_mask = attention_mask.new_ones(patches.shape[:2])
        return embeddings, torch.cat([attention_mask[:, :1], patch_mask, attention_mask[:, 1:]], dim=1)

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """pixel_values [B, 6, S, S], input_ids [B, T] (starting with <bos>) -> logits [B, P + T, vocab]."""
        embeddings, mask = self.multimodal_inputs(pixel_values, input_ids, attention_mask)
        return self.language_model(inputs_embeds=embeddings, attention_mask=mask, use_cache=False).logits

    @torch.inference_mode()
    def generate_action_tokens(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, count: int) -> List[int]:
        """The release's `generate(max_new_tokens=count)`: greedy, KV cache, batch 1; returns the last `count` ids.

        The first token is the argmax at the last position of the multimodal pass; each next one feeds the previous
        token alone at the next position. As upstream, a generated </s> stops decoding early, and the window of the
        last `count` ids of prompt + generated ids then reaches back into the prompt.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"action decoding takes one sample (batch 1, as the release), got {input_ids.shape[0]}")
        embeddings, _ = self.multimodal_inputs(pixel_values, input_ids)
        out = self.language_model(inputs_embeds=embeddings, use_cache=True)
        generated: List[int] = []
        while True:
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            if len(generated) == count or token == STOP_TOKEN_ID:
                break
            step = torch.tensor([[token]], device=input_ids.device)
            out = self.language_model(input_ids=step, use_cache=True, **{CACHE_ARG: getattr(out, CACHE_ARG)})
        return last_window(input_ids[0].tolist(), generated, count)

    def predict_action(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, stats: ArrayStats, bins: ActionBins
    ) -> np.ndarray:
        """The release's `predict_action`: float64 [D] actions, D = len(stats.q01).

        Appends the empty token 29871 if the prompt does not end with it, decodes D tokens greedily, maps them to
        bin centres and un-normalises them with (q01, q99) where `stats.mask` is true.
        """
        if int(input_ids[0, -1]) != EMPTY_TOKEN_ID:
            input_ids = torch.cat([input_ids, input_ids.new_full((1, 1), EMPTY_TOKEN_ID)], dim=1)
        tokens = self.generate_action_tokens(pixel_values, input_ids, stats.dim)
        return unnormalize_actions(bins.decode(np.asarray(tokens, dtype=np.int64)), stats)


def last_window(prompt_ids: List[int], generated: List[int], count: int) -> List[int]:
    """`generated_ids[0, -count:]` of `generate`'s output (prompt + new ids), the ids upstream de-tokenises."""
    return (prompt_ids + generated)[-count:]
