"""OpenVLA-OFT-style policy (`model.type: openvla-oft`): a continuous action chunk in one forward.

OpenVLA-OFT replaces OpenVLA's autoregressive action tokens with parallel
decoding of a whole chunk of continuous actions. Here a linear head on the last
prompt position outputs the `action_chunk * action_dim` means of a Gaussian
whose std is either a learned state-independent parameter ('learned') or a
linear schedule from `init_std` to `final_std` ('scheduled', driven by
`set_std_progress`). A value head shares the backbone.

Actions returned by `act` are raw Gaussian samples (the simulator clips them);
log-probs are per action of the chunk, summed over action dimensions.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from vlaslurm.models.base import PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.models.common import (
    PromptEncoder,
    VLAModelConfig,
    autocast_for,
    gaussian_logprob,
    init_module,
    init_seeded,
    run_lm,
    shape_fields,
)
from vlaslurm.models.vla.inputs import row_normals
from vlaslurm.spec.model_types import BackboneConfig, OpenVLAOFTConfig

STD_MODES = ("learned", "scheduled")


class OpenVLAOFTModelConfig(VLAModelConfig):
    """config.json of the OpenVLA-OFT-style policy: the shared shapes plus its Gaussian head's std."""

    model_type = "vlaslurm-openvla-oft"

    def __init__(self, std: str = "learned", init_std: float = 0.5, final_std: float = 0.1, **kwargs):
        self.std = std
        self.init_std = init_std
        self.final_std = final_std
        super().__init__(**kwargs)


class OpenVLAOFTPolicy(PreTrainedModel):
    """Tiny OpenVLA-OFT: Llama backbone over instruction, image and state tokens; Gaussian chunk head."""

    config_class = OpenVLAOFTModelConfig
    base_model_prefix = "vla"
    main_input_name = "images"
    std_progress: torch.Tensor  # the buffer registered in __init__ (declared for type checkers)

    def __init__(self, config: OpenVLAOFTModelConfig):
        super().__init__(config)
        _check_std(config.std, config.init_std, config.final_std)
        backbone = BackboneConfig(**config.backbone)
        hidden = backbone.hidden_size
        self.encoder = PromptEncoder(backbone, backbone.vocab_size, 0, config.state_dim, config.num_cameras)
        self.action_head = nn.Linear(hidden, config.action_chunk * config.action_dim)
        self.value_head = nn.Linear(hidden, 1)
        if config.std == "learned":
            self.log_std = nn.Parameter(torch.full((config.action_dim,), math.log(config.init_std)))
        # Fraction of training done, for the 'scheduled' std; a buffer so checkpoints keep it.
        self.register_buffer("std_progress", torch.zeros(()))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        init_module(module)
        if module is self:
            # Small initial means: early samples are dominated by the exploration std.
            nn.init.normal_(self.action_head.weight, std=0.01)
            if self.config.std == "learned":
                nn.init.constant_(self.log_std, math.log(self.config.init_std))
            nn.init.zeros_(self.std_progress)

    @property
    def action_chunk(self) -> int:
        return self.config.action_chunk

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    def set_std_progress(self, fraction: float) -> None:
        """Move the 'scheduled' std to `fraction` (0..1) of the way to `final_std`; no-op when learned."""
        self.std_progress.fill_(min(max(float(fraction), 0.0), 1.0))

    def action_log_std(self) -> torch.Tensor:
        """log std per action dimension, float [action_dim]."""
        if self.config.std == "learned":
            return self.log_std
        c = self.config
        std = c.init_std + (c.final_std - c.init_std) * self.std_progress
        return std.log().expand(c.action_dim)

    def forward(self, inp: PolicyInput) -> torch.Tensor:
        """Backbone feature of the last prompt position, float32 [B, hidden]."""
        with autocast_for(self.config.precision, self.device):
            embeds, mask = self.encoder(inp.images, inp.state, inp.instructions)
            hidden, _, _ = run_lm(self.encoder.lm, embeds, mask)
        return hidden[:, -1].float()

    def _heads(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.action_head(features).view(-1, self.action_chunk, self.action_dim)
        return mean, self.value_head(features).squeeze(-1)

    @torch.no_grad()
    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        mean, value = self._heads(self(inp))
        log_std = self.action_log_std()
        actions = (
            mean
            if deterministic
            else mean + log_std.exp() * row_normals(inp.seeds, mean.shape, mean.device).to(mean.dtype)
        )
        per_dim = gaussian_logprob(actions, mean, log_std)
        return PolicyOutput(actions, per_dim.sum(-1), value, token_logprob=per_dim, slot_value=self._slot_values(value))

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        mean, value = self._heads(self(inp))
        log_std = self.action_log_std()
        actions = actions.to(mean.device, mean.dtype)
        per_dim = gaussian_logprob(actions, mean, log_std)
        logprob = per_dim.sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum().expand_as(logprob)
        return PolicyEval(logprob, entropy, value, token_logprob=per_dim, slot_value=self._slot_values(value))

    def _slot_values(self, value: torch.Tensor) -> torch.Tensor:
        # One value per observation: every action slot of the chunk shares it (a released OFT's critic reads each
        # action's own hidden states, vlaslurm/models/vla/oft.py).
        return value[:, None].expand(-1, self.action_chunk)


def _check_std(mode: str, init_std: float, final_std: float) -> None:
    if mode not in STD_MODES:
        raise ValueError(f"model.std must be one of {STD_MODES}, got {mode!r}")
    if init_std <= 0 or final_std <= 0:
        raise ValueError(f"model.init_std and model.final_std must be > 0, got {init_std} and {final_std}")


def build(cfg: OpenVLAOFTConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int) -> nn.Module:
    """Registry entry point: a released checkpoint at `cfg.path` (vlaslurm/models/vla/), a look-alike saved with
    save_pretrained, or a seeded random init."""
    from vlaslurm.models.checkpoint import is_released_checkpoint
    from vlaslurm.models.vla.build import build_released  # peft and safetensors: lazily

    if cfg.path and is_released_checkpoint(cfg.path):
        return build_released(cfg, action_dim, state_dim, image_size, num_cameras)
    if cfg.path:  # a folder of this project's tiny look-alike, written by save_pretrained
        model = OpenVLAOFTPolicy.from_pretrained(check_checkpoint_dir(cfg.path))
        check_loaded(model.config, cfg, action_dim, state_dim, num_cameras)
        model.config.precision = cfg.precision
        return model
    config = OpenVLAOFTModelConfig(
        std=cfg.std,
        init_std=cfg.init_std,
        final_std=cfg.final_std,
        **shape_fields(cfg, action_dim, state_dim, image_size, num_cameras),
    )
    _check_std(cfg.std, cfg.init_std, cfg.final_std)
    return init_seeded(OpenVLAOFTPolicy, config, cfg.init_seed)


def check_checkpoint_dir(path: str) -> str:
    """`path` if it holds a saved policy, else an error that says what is wrong."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.path {path!r} is not a folder; point it at a save_pretrained() output")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model.path {path!r} holds no config.json; point it at a save_pretrained() output")
    return path


def check_loaded(config: PretrainedConfig, cfg, action_dim: int, state_dim: int, num_cameras: int) -> None:
    """The loaded checkpoint must fit the simulator and the spec's chunk."""
    expected = {"action_dim": action_dim, "state_dim": state_dim, "action_chunk": cfg.action_chunk}
    if config.num_cameras:  # a policy without a vision stem ignores the camera count
        expected["num_cameras"] = num_cameras
    wrong = {k: (getattr(config, k), v) for k, v in expected.items() if getattr(config, k) != v}
    if wrong:
        details = ", ".join(f"{k}: checkpoint {got}, needed {want}" for k, (got, want) in wrong.items())
        raise ValueError(f"checkpoint {cfg.path!r} does not fit this run ({details})")
