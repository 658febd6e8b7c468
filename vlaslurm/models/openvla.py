"""OpenVLA-style policy (`model.type: openvla`): discrete action tokens decoded autoregressively.

Each action dimension is quantised into `n_bins` bins, mapped to the vocabulary's last `n_bins`
tokens, and decoded one token at a time with a KV cache; the value head reads the last prompt
position. `temperature` divides the bin logits in `act` and `evaluate` alike.
Details: docs/models.md
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from vlaslurm.models.base import PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.models.common import (
    PromptEncoder,
    VLAModelConfig,
    autocast_for,
    init_module,
    init_seeded,
    run_lm,
    shape_fields,
)
from vlaslurm.models.openvla_oft import check_checkpoint_dir, check_loaded
from vlaslurm.models.vla.inputs import row_uniforms
from vlaslurm.spec.model_types import BackboneConfig, OpenVLAConfig


class OpenVLAModelConfig(VLAModelConfig):
    """config.json of the OpenVLA-style policy: the shared shapes plus its action-token bins."""

    model_type = "vlaslurm-openvla"

    def __init__(
        self,
        n_bins: int = 256,
        action_low: float = -1.0,
        action_high: float = 1.0,
        action_temperature: float = 1.0,
        **kwargs,
    ):
        self.n_bins = n_bins
        self.action_low = action_low
        self.action_high = action_high
        self.action_temperature = action_temperature
        super().__init__(**kwargs)


class OpenVLAPolicy(PreTrainedModel):
    """Tiny OpenVLA: Llama backbone; action dimensions as bin tokens, decoded one by one."""

    config_class = OpenVLAModelConfig
    base_model_prefix = "vla"
    main_input_name = "images"

    def __init__(self, config: OpenVLAModelConfig):
        super().__init__(config)
        _check_bins(config, BackboneConfig(**config.backbone).vocab_size)
        backbone = BackboneConfig(**config.backbone)
        self.vocab_size = backbone.vocab_size
        self.encoder = PromptEncoder(backbone, backbone.vocab_size, config.n_bins, config.state_dim, config.num_cameras)
        # Full-vocabulary head as in a causal LM (a real checkpoint's head loads here); only the
        # last n_bins rows are ever used.
        self.lm_head = nn.Linear(backbone.hidden_size, backbone.vocab_size, bias=False)
        self.value_head = nn.Linear(backbone.hidden_size, 1)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        init_module(module)

    @property
    def action_chunk(self) -> int:
        return self.config.action_chunk

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    @property
    def first_bin_token(self) -> int:
        return self.vocab_size - self.config.n_bins

    # --- actions <-> bins ------------------------------------------------------------------
    def bin_centers(self) -> torch.Tensor:
        c = self.config
        edges = torch.linspace(c.action_low, c.action_high, c.n_bins + 1, device=self.device)
        return (edges[:-1] + edges[1:]) / 2

    def actions_to_bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Continuous actions (any shape) -> bin indices long, values outside the range clamped."""
        c = self.config
        unit = (actions.to(self.device).float() - c.action_low) / (c.action_high - c.action_low)
        return (unit * c.n_bins).floor().long().clamp(0, c.n_bins - 1)

    # --- network ---------------------------------------------------------------------------
    def forward(self, inp: PolicyInput, action_bins: torch.Tensor | None = None):
        """Teacher-forced pass: (bin logits [B, C*A, n_bins] or None, value [B], slot values [B, C]), float32.

        Position T-1 (the last prompt token) predicts the first action token;
        action token k predicts token k+1, so the last action token is not fed.
        """
        with autocast_for(self.config.precision, self.device):
            embeds, mask = self.encoder(inp.images, inp.state, inp.instructions)
            prompt_len = embeds.shape[1]
            if action_bins is not None:
                fed = self.encoder.lm.embed_tokens(action_bins[:, :-1] + self.first_bin_token)
                embeds = torch.cat([embeds, fed], dim=1)
                mask = torch.cat([mask, mask.new_ones(fed.shape[:2])], dim=1)
            hidden, _, _ = run_lm(self.encoder.lm, embeds, mask)
        hidden = hidden.float()
        value = self.value_head(hidden[:, prompt_len - 1]).squeeze(-1)
        logits = self._bin_logits(hidden[:, prompt_len - 1 :]) if action_bins is not None else None
        # action slot k's value reads the position before its first token (the decision's value for k = 0)
        before = (
            hidden[:, prompt_len - 1 :: self.action_dim][:, : self.action_chunk] if action_bins is not None else None
        )
        slot_value = self.value_head(before).squeeze(-1) if before is not None else value[:, None]
        return logits, value, slot_value

    def _bin_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The LM head restricted to the bin tokens, tempered (see module docstring).
        weight = self.lm_head.weight[self.first_bin_token :].float()
        return torch.nn.functional.linear(hidden, weight) / self.config.action_temperature

    @torch.no_grad()
    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        n_tokens = self.action_chunk * self.action_dim
        with autocast_for(self.config.precision, self.device):
            embeds, mask = self.encoder(inp.images, inp.state, inp.instructions)
            hidden, mask, cache = run_lm(self.encoder.lm, embeds, mask, use_cache=True)
        hidden = hidden[:, -1].float()
        value = self.value_head(hidden).squeeze(-1)
        bins, logprobs, before_action = [], [], []
        uniforms = row_uniforms(inp.seeds, len(hidden), n_tokens, hidden.device)
        for k in range(n_tokens):
            if k % self.action_dim == 0:
                before_action.append(self.value_head(hidden).squeeze(-1))
            dist = torch.distributions.Categorical(logits=self._bin_logits(hidden))
            if deterministic:
                token = dist.probs.argmax(-1)
            elif uniforms is None:
                token = dist.sample()
            else:  # inverse-CDF sampling from the item's own uniforms
                below = (dist.probs.cumsum(-1) < uniforms[:, k, None]).sum(-1)
                token = below.clamp(max=dist.probs.shape[-1] - 1)
            bins.append(token)
            logprobs.append(dist.log_prob(token))
            if k + 1 == n_tokens:
                break
            with autocast_for(self.config.precision, self.device):
                step = self.encoder.lm.embed_tokens(token + self.first_bin_token)[:, None]
                out, mask, cache = run_lm(
                    self.encoder.lm, step, mask.new_ones(len(token), 1), cache, past_mask=mask, use_cache=True
                )
            hidden = out[:, -1].float()
        shape = (-1, self.action_chunk, self.action_dim)
        actions = self.bin_centers()[torch.stack(bins, 1)].view(shape)
        per_token = torch.stack(logprobs, 1).view(shape)
        slot_value = torch.stack(before_action, 1)
        return PolicyOutput(actions, per_token.sum(-1), value, token_logprob=per_token, slot_value=slot_value)

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        bins = self.actions_to_bins(actions).reshape(len(inp.instructions), -1)
        logits, value, slot_value = self(inp, bins)
        dist = torch.distributions.Categorical(logits=logits)
        shape = (-1, self.action_chunk, self.action_dim)
        per_token = dist.log_prob(bins).view(shape)
        entropy = dist.entropy().view(shape).sum(-1)
        return PolicyEval(per_token.sum(-1), entropy, value, token_logprob=per_token, slot_value=slot_value)


def _check_bins(config: OpenVLAModelConfig, vocab_size: int) -> None:
    if config.n_bins < 2:
        raise ValueError(f"model.n_bins must be >= 2, got {config.n_bins}")
    if config.n_bins > vocab_size - 3:
        raise ValueError(
            f"model.n_bins ({config.n_bins}) leaves no word tokens in model.backbone.vocab_size ({vocab_size}); "
            "raise vocab_size or lower n_bins"
        )
    if not config.action_low < config.action_high:
        raise ValueError(f"model.action_low must be < action_high, got {config.action_low} and {config.action_high}")
    if config.action_temperature <= 0:
        raise ValueError(f"model.temperature must be > 0, got {config.action_temperature}")


def build(cfg: OpenVLAConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> nn.Module:
    """Registry entry point: a released checkpoint at `cfg.path` (vlaslurm/models/vla/), a look-alike saved with
    save_pretrained, or a seeded random init."""
    from vlaslurm.models.checkpoint import is_released_checkpoint
    from vlaslurm.models.vla.build import build_released  # peft and safetensors: lazily

    if cfg.path and is_released_checkpoint(cfg.path):
        return build_released(cfg, action_dim, state_dim, image_size, num_cameras)
    if cfg.path:  # a folder of this project's tiny look-alike, written by save_pretrained
        model = OpenVLAPolicy.from_pretrained(check_checkpoint_dir(cfg.path))
        check_loaded(model.config, cfg, action_dim, state_dim, num_cameras)
        model.config.precision = cfg.precision
        model.config.action_temperature = cfg.temperature
        return model
    config = OpenVLAModelConfig(
        n_bins=cfg.n_bins,
        action_low=cfg.action_low,
        action_high=cfg.action_high,
        action_temperature=cfg.temperature,
        **shape_fields(cfg, action_dim, state_dim, image_size, num_cameras),
    )
    _check_bins(config, cfg.backbone.vocab_size)
    return init_seeded(OpenVLAPolicy, config, cfg.init_seed)
