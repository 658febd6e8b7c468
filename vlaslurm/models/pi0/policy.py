"""`model.type: pi0`: transformers' PI0ForConditionalGeneration as an RL policy with path log-probs and a critic.

The PaliGemma prefix (images, instruction) runs once per decision and its KV cache serves every denoising step of
the Gemma action expert (each step crops the cache back to the prefix, as PI0's `sample_actions`). `act` samples
a chunk with the Flow-SDE or Flow-Noise sampler (flow.py) and returns its denoising path [B, K+1, chunk, D] and
stochastic steps [B, S] in `PolicyOutput.replay`; `evaluate` recomputes the log-density of that stored path under
the current weights, one expert pass per stochastic step. D is the checkpoint's `max_action_dim` (the path keeps
the padded dimensions, which the velocity of the real ones depends on); the actions are its first `action_dim`.

Values (`value_from`): `expert` reads the action expert in one extra pass with x = 0 at t = 1 (deterministic
given the observation): a value per action slot from that slot's hidden state, per decision from their mean, as
πRL reads its critic from the expert. `prefix` reads the mean final hidden state of the prefix: one linear head
gives the decision's value and one per slot. Details: docs/models.md
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Literal, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from vlaslurm.models.base import PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.models.checkpoint import PI0_POLICY_FILE
from vlaslurm.models.common import VisionStem
from vlaslurm.models.pi0.flow import (
    FlowSettings,
    draw,
    gaussian_entropy,
    gaussian_logdensity,
    ode_step,
    stochastic_mask,
    times,
    transition,
)
from vlaslurm.models.pi0.inputs import (
    HashedWords,
    PromptLayout,
    ReleaseText,
    TextEncoder,
    padded_state,
    pixel_values,
    prompt_ids,
)

ValueFrom = Literal["expert", "prefix"]
Vision = Literal["siglip", "stem"]
FROZEN_PREFIX = "pi0.model.vlm."  # PaliGemma under `train_expert_only`
STEM_CHANNELS, STEM_KEYPOINTS = 32, 16  # the tiny VLAs' film-stem size, which learns the toy task
HEADS_FILE = "vlaslurm_heads.safetensors"  # value (and noise) heads, beside the release's weights
POLICY_FILE = PI0_POLICY_FILE  # a saved policy's action size, sampler, critic, vision and text encoder


@dataclass
class Prefix:
    """One decision's prefix: the VLM's cache (cropped back to `length` after each expert pass) and outputs."""

    cache: Any
    mask: torch.Tensor  # int64 [B, L]: real prefix tokens
    state: torch.Tensor  # [B, max_state_dim], in the model's dtype
    hidden: torch.Tensor  # [B, L, H_vlm]: the prefix's final hidden states
    length: int


class PI0Policy(nn.Module):
    """A PI0ForConditionalGeneration with the πRL samplers, a value head and (Flow-Noise) a noise head."""

    pi0: Any  # the PI0ForConditionalGeneration (Any: its submodules are reached by name, as transformers names them)
    # Under FSDP (algos/sharding.py) the Gemma layers stay gathered from forward to backward: the action expert runs
    # once per denoising step in one act or evaluate, and the prefix's layers hand their keys and values to it
    # through the KV cache.
    FSDP_GATHERED = ("pi0.model.dit", "pi0.model.vlm.language_model")

    def __init__(
        self,
        pi0: Any,
        text: TextEncoder,
        settings: FlowSettings,
        action_dim: int,
        value_from: ValueFrom = "expert",
        vision: Vision = "siglip",
    ) -> None:
        super().__init__()
        config = pi0.config
        if not 0 < action_dim <= config.max_action_dim:
            raise ValueError(f"action_dim {action_dim} must lie in [1, max_action_dim = {config.max_action_dim}]")
        if value_from not in ("expert", "prefix"):
            raise ValueError(f"model.value_from must be expert or prefix, got {value_from!r}")
        self.pi0, self.text, self.settings = pi0, text, settings
        self.layout = PromptLayout.of(config)
        self.chunk, self.width, self._action_dim = int(config.chunk_size), int(config.max_action_dim), action_dim
        self.value_from = value_from
        device = next(pi0.parameters()).device
        expert, prefix = config.dit_config.hidden_size, config.vlm_config.text_config.hidden_size
        # float32 whatever the model's dtype: a bf16 head would round returns of ~1e2 to 3 digits
        size = (expert, 1) if value_from == "expert" else (prefix, 1 + self.chunk)
        self.value_head = nn.Linear(*size, dtype=torch.float32, device=device)
        nn.init.normal_(self.value_head.weight, std=0.02)
        nn.init.zeros_(self.value_head.bias)
        self.noise_head: Optional[nn.Linear] = None
        if settings.noise_method == "flow_noise":  # zero init: the std starts mid-way between its bounds
            self.noise_head = nn.Linear(expert, self.width, dtype=torch.float32, device=device)
            nn.init.zeros_(self.noise_head.weight)
            nn.init.zeros_(self.noise_head.bias)
        self.vision = vision
        self.stem: Optional[VisionStem] = None
        if vision == "stem":  # one token per camera of tokens_per_image x H, split into the image positions
            width = prefix * self.layout.tokens_per_image
            self.stem = VisionStem(STEM_CHANNELS, STEM_KEYPOINTS, prefix, width).to(device)
        elif vision != "siglip":
            raise ValueError(f"model.vision must be siglip or stem, got {vision!r}")
        self.train_expert_only = False  # `freeze_vlm`
        self.lora = False  # `add_lora`
        self.cache_kw = _cache_keyword()
        self.source: Optional[Path] = None  # the folder it was loaded from (save_pretrained copies its tokenizer)

    @property
    def action_chunk(self) -> int:
        return self.chunk

    @property
    def action_dim(self) -> int:
        return self._action_dim

    @property
    def device(self) -> torch.device:
        return self.value_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pi0.action_out_proj.weight.dtype

    # --- the two halves of PI0 ------------------------------------------------------------------------------
    def encode_prefix(self, inp: PolicyInput) -> Prefix:
        """The VLM over images and prompt, as PI0's `sample_actions` runs it."""
        if inp.images is None:
            raise ValueError("a π0 reads camera images: set env.obs.image_size and env.obs.cameras")
        batch, cameras = inp.images.shape[:2]
        ids, mask = prompt_ids(self.layout, self.text, inp.instructions, cameras, self.device)
        if self.stem is None:
            pixels = pixel_values(self.layout, inp.images.to(self.device), self.dtype)
            present = torch.ones(batch, cameras, dtype=torch.bool, device=self.device)
            embeds = self.pi0.model.embed_prefix(ids, pixels, present)
        else:
            embeds = self.stem_prefix(ids, mask, inp.images.to(self.device))
        out = self.pi0.model.vlm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(embeds)[:, :, 0],
            use_cache=True,
        )
        cache = _output_cache(out)
        state = padded_state(self.layout, inp.state, batch, self.device).to(self.dtype)
        return Prefix(cache, mask, state, out.last_hidden_state, cache.get_seq_length())

    def stem_prefix(self, ids: torch.Tensor, mask: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """`vision: stem`: the prefix embeddings with the stem's tokens in the image positions (which lead the
        prompt, camera by camera), the stem FiLM-conditioned on the mean embedding of the instruction's tokens."""
        assert self.stem is not None
        n = self.layout.tokens_per_image * images.shape[1]
        text = self.pi0.model.vlm.get_input_embeddings()(ids[:, n:])
        real = mask[:, n:, None].to(text.dtype)
        cond = (text * real).sum(1) / real.sum(1).clamp(min=1)
        tokens = self.stem(images, cond.float()).reshape(len(ids), n, -1)
        return torch.cat([tokens.to(text.dtype), text], 1)

    def expert(self, prefix: Prefix, x: torch.Tensor, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(velocity float32 [B, chunk, D], the action tokens' hidden states [B, chunk, H]) at x [B, chunk, D]
        and times t [B]: PI0's forward over a prefix cache."""
        embeds = self.pi0.embed_action_time(prefix.state, x.to(self.dtype), t)
        out = self.pi0.model(action_embeds=embeds, attention_mask=prefix.mask, **{self.cache_kw: prefix.cache})
        # no attention to earlier denoising steps (a negative crop removes tokens, in every transformers with PI0)
        prefix.cache.crop(prefix.length - prefix.cache.get_seq_length())
        hidden = out.last_hidden_state[:, -self.chunk :]
        return self.pi0.action_out_proj(hidden).float(), hidden

    def noise_raw(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        return None if self.noise_head is None else self.noise_head(hidden.float())

    def values(self, prefix: Prefix) -> Tuple[torch.Tensor, torch.Tensor]:
        """(value float32 [B], slot_value float32 [B, chunk])."""
        batch = prefix.mask.shape[0]
        if self.value_from == "expert":
            zeros = torch.zeros(batch, self.chunk, self.width, device=self.device)
            _, hidden = self.expert(prefix, zeros, torch.ones(batch, device=self.device))
            h = hidden.float()
            return self.value_head(h.mean(1)).squeeze(-1), self.value_head(h).squeeze(-1)
        real = prefix.mask[..., None].float()
        pooled = (prefix.hidden.float() * real).sum(1) / real.sum(1).clamp(min=1)
        out = self.value_head(pooled)
        return out[:, 0], out[:, 1:]

    # --- the policy -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        """A chunk per observation: the sampler's path, or with `deterministic` the ODE path from the same initial
        noise (whose `logprob` is then its density under the sampler's transitions, for logging only)."""
        s, prefix = self.settings, self.encode_prefix(inp)
        batch = prefix.mask.shape[0]
        draws = draw(s, inp.seeds, batch, self.chunk, self.width, self.device)
        grid, stochastic = times(s, self.device), stochastic_mask(draws.steps, s.denoise_steps)
        x, path = draws.initial, [draws.initial]
        logprob = torch.zeros(batch, self.chunk, device=self.device)
        for k in range(s.denoise_steps):
            t = grid[k].expand(batch)
            v, hidden = self.expert(prefix, x, t)
            mean, std = transition(s, x, v, t, self.noise_raw(hidden))
            x = ode_step(s, x, v)
            if not deterministic:
                x = torch.where(stochastic[:, k, None, None], mean + std * draws.noise[:, k], x)
            step = gaussian_logdensity(x, mean, std).sum(-1)
            logprob = logprob + torch.where(stochastic[:, k, None], step, torch.zeros_like(step))
            path.append(x)
        value, slot_value = self.values(prefix)
        replay = {"path": torch.stack(path, 1), "steps": draws.steps}
        return PolicyOutput(x[..., : self.action_dim], logprob, value, slot_value=slot_value, replay=replay)

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        """The stored paths' log-densities [B, chunk] (summed over stochastic steps and dimensions), the entropy
        of their stochastic transitions, and the values, under the current weights."""
        path, steps = self.stored_paths(inp, actions)
        s, prefix = self.settings, self.encode_prefix(inp)
        grid, rows = times(s, self.device), torch.arange(path.shape[0], device=self.device)
        logprob = torch.zeros(path.shape[0], self.chunk, device=self.device)
        entropy = torch.zeros_like(logprob)
        for column in range(steps.shape[1]):
            k = steps[:, column]
            x, t = path[rows, k], grid[k]
            v, hidden = self.expert(prefix, x, t)
            mean, std = transition(s, x, v, t, self.noise_raw(hidden))
            logprob = logprob + gaussian_logdensity(path[rows, k + 1], mean, std).sum(-1)
            entropy = entropy + gaussian_entropy(std, mean).sum(-1)
        value, slot_value = self.values(prefix)
        return PolicyEval(logprob, entropy, value, slot_value=slot_value)

    def stored_paths(self, inp: PolicyInput, actions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(path float32 [B, K+1, chunk, D], steps int64 [B, S]) from `inp.replay`, checked against `actions`."""
        replay = inp.replay or {}
        if "path" not in replay or "steps" not in replay:
            raise ValueError(
                "pi0 evaluates stored denoising paths: PolicyInput.replay must hold the 'path' and 'steps' that act "
                "returned in PolicyOutput.replay"
            )
        path = replay["path"].to(self.device, torch.float32)
        steps = replay["steps"].to(self.device, torch.long)
        want = (path.shape[0], self.settings.denoise_steps + 1, self.chunk, self.width)
        if tuple(path.shape) != want or steps.shape != (path.shape[0], self.settings.stochastic):
            raise ValueError(f"replay path {list(path.shape)} / steps {list(steps.shape)} do not fit this policy")
        if not torch.equal(path[:, -1, :, : self.action_dim], actions.to(self.device, torch.float32)):
            raise ValueError("the stored actions are not the last step of their stored paths")
        return path, steps

    def predict_action(
        self, images: np.ndarray, instruction: str, state: Optional[np.ndarray] = None, seed: int = 0
    ) -> np.ndarray:
        """float32 [chunk, action_dim]: the ODE's chunk from seeded noise for uint8 frames [H, W, 3] (or
        [cameras, H, W, 3]), in the policy's action space."""
        frames = np.asarray(images, dtype=np.uint8)
        frames = frames[None] if frames.ndim == 3 else frames
        robot = None if state is None else torch.as_tensor(np.asarray(state, np.float32))[None]
        inp = PolicyInput(torch.from_numpy(frames)[None], robot, [instruction], seeds=torch.tensor([seed]))
        return self.act(inp, deterministic=True).actions[0].cpu().numpy()

    # --- weights --------------------------------------------------------------------------------------------
    def freeze_vlm(self) -> None:
        """`model.train_expert_only`: PaliGemma stops training (its parameters need no gradient)."""
        self.pi0.model.vlm.requires_grad_(False)
        self.train_expert_only = True

    def add_lora(self, settings: Any) -> None:
        """`model.lora`: peft adapters on the linear layers of PaliGemma's language model (`LoraSettings` scoped to
        it); the rest of PaliGemma freezes, the expert, the stem and the heads go on training in full."""
        from vlaslurm.models.prismatic.lora import apply_lora

        apply_lora(self.pi0.model.vlm, settings)  # freezes the VLM but its adapters
        self.lora = True

    def trained_state_dict(self) -> Dict[str, torch.Tensor]:
        """What training changes (`models.trained_state`): everything, or with `train_expert_only` everything but
        PaliGemma, with LoRA everything but PaliGemma's frozen base; the rest comes from `model.path`."""
        state = self.state_dict()
        frozen = self.train_expert_only or self.lora
        return {k: t for k, t in state.items() if not (frozen and k.startswith(FROZEN_PREFIX) and ".lora_" not in k)}

    def pi0_state_dict(self) -> Dict[str, torch.Tensor]:
        """PI0's own state dict under transformers' names, LoRA adapters merged into their weights (W + scale B A)."""
        if not self.lora:
            return self.pi0.state_dict()
        from vlaslurm.models.prismatic.lora import merged_tensors

        vlm = FROZEN_PREFIX.removeprefix("pi0.")
        kept = {k: t for k, t in self.pi0.state_dict().items() if not k.startswith(vlm)}
        return {**kept, **{vlm + name: t for name, t in merged_tensors(self.pi0.model.vlm)}}

    def heads_state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: t for k, t in self.state_dict().items() if not k.startswith("pi0.")}

    def save_pretrained(self, folder: Union[str, Path]) -> Path:
        """A folder `load_pretrained` (and `model.path`) loads: PI0's config.json and weights in transformers'
        saved (lerobot) layout, the heads, the text encoder (the source's tokenizer, or the hashed words), and in
        vlaslurm_pi0.json the action size, sampler and critic that `load_pretrained` then defaults to."""
        from safetensors.torch import save_file

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self.pi0.save_pretrained(out, state_dict=self.pi0_state_dict())  # a plain PI0 folder, adapters merged
        save_file({k: t.detach().cpu().contiguous() for k, t in self.heads_state_dict().items()}, str(out / HEADS_FILE))
        meta: Dict[str, Any] = {
            "action_dim": self.action_dim,
            "value_from": self.value_from,
            "vision": self.vision,
            "flow": dataclasses.asdict(self.settings),
        }
        if isinstance(self.text, HashedWords):
            meta.update(text="hashed-words", vocab_size=self.text.vocab_size)
        elif isinstance(self.text, ReleaseText):
            self.text.tokenizer.save_pretrained(out)
            meta.update(text="tokenizer")
        (out / POLICY_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out


def _cache_keyword() -> str:
    """PI0Model.forward's cache argument: `cache` from transformers 5.2x, `past_key_values` before (5.4 .. 5.17)."""
    from transformers.models.pi0.modeling_pi0 import PI0Model

    return "cache" if "cache" in inspect.signature(PI0Model.forward).parameters else "past_key_values"


def _output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
