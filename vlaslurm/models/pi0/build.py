"""Build a `PI0Policy`: from a folder in transformers' PI0 layout (strictly), or a seeded tiny random init.

A folder holds PI0's config.json (`model_type: pi0`) and safetensors in the layout transformers saves (lerobot's
parameter names, `paligemma_with_expert.*`), read with `from_pretrained` from the local folder only; any missing,
unexpected or mismatched tensor is an error. Beside them: a tokenizer (tokenizer.json, PaliGemma's) or this
project's `vlaslurm_pi0.json` naming the hashed-word encoder of tiny policies, and optionally the saved heads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from vlaslurm.models.pi0.flow import FlowSettings
from vlaslurm.models.pi0.inputs import HashedWords, ReleaseText, TextEncoder
from vlaslurm.models.pi0.policy import HEADS_FILE, POLICY_FILE, PI0Policy, ValueFrom, Vision
from vlaslurm.spec.model_types import PI0PolicyConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILE = "tokenizer.json"
TINY_VOCAB = 512


def settings_of(cfg: PI0PolicyConfig) -> FlowSettings:
    return FlowSettings(
        denoise_steps=cfg.denoise_steps,
        noise_method=cfg.noise_method,
        sde_steps=cfg.sde_steps,
        noise_level=cfg.noise_level,
        noise_min=cfg.noise_min,
        noise_max=cfg.noise_max,
    )


def build(cfg: PI0PolicyConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> PI0Policy:
    """Registry entry point: the folder in `cfg.path`, else a tiny π0 seeded with `cfg.init_seed`."""
    if num_cameras <= 0 or image_size <= 0:
        raise ValueError("a π0 reads camera images: set env.obs.image_size and env.obs.cameras")
    settings = settings_of(cfg)
    if cfg.path is None:
        policy = tiny_pi0(cfg.action_chunk, action_dim, state_dim, settings, cfg.value_from, cfg.init_seed, cfg.vision)
    else:
        policy = load_pi0(cfg.path, settings, action_dim, cfg.value_from, DTYPES[cfg.precision])
    if cfg.train_expert_only:
        policy.freeze_vlm()
    if cfg.lora is not None:  # the scope, "language_model", is PaliGemma's as it is the OpenVLA types'
        from vlaslurm.models.prismatic.lora import LoraSettings

        policy.add_lora(LoraSettings.of(cfg.lora))
    if policy.vision != cfg.vision:
        raise ValueError(f"model.vision is {cfg.vision} but {cfg.path} was saved with vision: {policy.vision}")
    if policy.action_chunk != cfg.action_chunk:
        raise ValueError(
            f"model.action_chunk is {cfg.action_chunk} but {cfg.path} has chunk_size {policy.action_chunk}; "
            "set model.action_chunk to it"
        )
    return policy


def tiny_config(chunk: int, action_dim: int, state_dim: int, denoise_steps: int = 10) -> Any:
    """A PI0Config of the same classes at test size: Gemma 2 x 32 prefix, SigLIP 1 layer on 28 px (4 tokens per
    camera), Gemma 2 x 16 expert (PI0 shares attention per layer, so both have 2 layers, 1 KV head of 16)."""
    from transformers import PI0Config

    text = dict(
        model_type="gemma",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=TINY_VOCAB,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=14,
        image_size=28,
        vision_use_head=False,
    )
    expert = dict(
        model_type="gemma",
        hidden_size=16,
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    # the image token lies outside the vocabulary, as in the full config (257152 of 257152)
    vlm = dict(model_type="paligemma", text_config=text, vision_config=vision, projection_dim=32)
    return PI0Config(
        vlm_config={**vlm, "image_token_id": TINY_VOCAB},
        dit_config=expert,
        chunk_size=chunk,
        max_state_dim=max(state_dim, 1),
        max_action_dim=action_dim,
        num_inference_steps=denoise_steps,
    )


def tiny_pi0(
    chunk: int,
    action_dim: int,
    state_dim: int,
    settings: FlowSettings,
    value_from: ValueFrom = "expert",
    seed: int = 0,
    vision: Vision = "siglip",
) -> PI0Policy:
    """A seeded random-init tiny π0 (the caller's RNG state is left as it was)."""
    from transformers import PI0ForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pi0 = PI0ForConditionalGeneration(tiny_config(chunk, action_dim, state_dim, settings.denoise_steps))
        return PI0Policy(pi0.eval(), HashedWords(TINY_VOCAB), settings, action_dim, value_from, vision)


def load_pi0(
    path: Union[str, Path],
    settings: Optional[FlowSettings] = None,
    action_dim: Optional[int] = None,
    value_from: Optional[ValueFrom] = None,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
) -> PI0Policy:
    """The policy of a PI0 folder, loaded strictly. What is not given comes from the folder's vlaslurm_pi0.json
    when this project saved it, else: `action_dim` the checkpoint's max_action_dim, the sampler `FlowSettings()`
    with the config's num_inference_steps, the critic on the expert."""
    from transformers import PI0ForConditionalGeneration

    folder = Path(path).expanduser()
    loaded: Any = PI0ForConditionalGeneration.from_pretrained(
        folder, output_loading_info=True, dtype=dtype, local_files_only=True
    )
    pi0, info = loaded  # (model, {"missing_keys": ..., "unexpected_keys": ..., ...})
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        raise ValueError(f"{folder} does not load strictly into PI0ForConditionalGeneration: {problems}")
    meta = _saved_meta(folder)
    if settings is None:
        saved = meta.get("flow", {"denoise_steps": pi0.config.num_inference_steps})
        settings = FlowSettings(**saved)
    dim = action_dim if action_dim is not None else int(meta.get("action_dim", pi0.config.max_action_dim))
    critic = value_from if value_from is not None else meta.get("value_from", "expert")
    vision = meta.get("vision", "siglip")  # a release reads frames with its own tower
    policy = PI0Policy(pi0.to(device).eval(), _text_encoder(folder, meta), settings, dim, critic, vision)
    _load_heads(policy, folder)
    policy.source = folder
    return policy


def _saved_meta(folder: Path) -> Dict[str, Any]:
    file = folder / POLICY_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def _text_encoder(folder: Path, meta: Dict[str, Any]) -> TextEncoder:
    if (folder / TOKENIZER_FILE).is_file():
        from transformers import AutoTokenizer

        return ReleaseText(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    if meta.get("text") == "hashed-words":
        return HashedWords(int(meta["vocab_size"]))
    raise ValueError(
        f"{folder} holds no {TOKENIZER_FILE}: copy the PaliGemma tokenizer the checkpoint was trained with into it"
    )


def _load_heads(policy: PI0Policy, folder: Path) -> None:
    """The saved value / noise heads when present and of this policy's kind; a release has none (fresh heads)."""
    file = folder / HEADS_FILE
    if not file.is_file():
        return
    from safetensors.torch import load_file

    stored, own = load_file(str(file)), policy.heads_state_dict()
    for head in ("value_head", "noise_head", "stem"):
        keys = {k for k in own if k.startswith(head + ".")}
        saved = {k: t for k, t in stored.items() if k.startswith(head + ".")}
        if head == "stem" and keys and not saved:
            raise ValueError(f"{file} holds no stem, which {POLICY_FILE} says this policy reads frames with")
        if not keys or not saved:
            continue  # a fresh head (e.g. the noise head of a policy saved with flow_sde)
        if set(saved) != keys or any(saved[k].shape != own[k].shape for k in keys):
            raise ValueError(f"{file}: the saved {head} does not fit (was it saved with another model.value_from?)")
        getattr(policy, head).load_state_dict({k.split(".", 1)[1]: t for k, t in saved.items()})
