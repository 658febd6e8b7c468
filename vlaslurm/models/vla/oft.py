"""`model.type: openvla-oft` over a released checkpoint: a whole action chunk from one bidirectional pass.

The LLM reads `[<bos>, patches, (proprio), prompt[1:], 0 x slots, </s>]` with full attention over real tokens, as
the release; slot t x action_dim + d is read one position early (the release's shift). Two heads:
- `l1`: the release's L1 regression head gives the mean of a Gaussian with a state-independent std (learned, or
  scheduled from `init_std` to `final_std`); log-probs are exact Gaussian densities, per dimension.
- `discrete`: the LM head at each slot, a `CentreCategorical` at `model.temperature`; dimensions independent given
  the pass (the release decodes them in parallel), so the chunk's log-prob is the sum over its tokens.
Values: per action slot from the mean of that action's hidden states, per decision from the mean over all slots.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional, Tuple, cast

import torch
from torch import nn

from vlaslurm.models.base import PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.models.common import gaussian_logprob
from vlaslurm.models.prismatic.oft import L1RegressionActionHead, ProprioProjector, bidirectional_mask, save_oft_heads
from vlaslurm.models.prismatic.preprocess import STOP_TOKEN_ID
from vlaslurm.models.vla.base import VLAPolicy
from vlaslurm.models.vla.bins import CentreCategorical, entropy
from vlaslurm.models.vla.inputs import row_normals, row_uniforms

Head = Literal["l1", "discrete"]
StdMode = Literal["learned", "scheduled"]


class OFTChunkPolicy(VLAPolicy):
    """The OpenVLA-OFT release as a chunk-level stochastic policy with a value head."""

    std_progress: torch.Tensor  # the buffer registered in __init__

    def __init__(
        self,
        *args: Any,
        head: Head,
        categorical: CentreCategorical,
        action_head: Optional[L1RegressionActionHead],
        std: StdMode = "learned",
        init_std: float = 0.5,
        final_std: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if head == "l1" and action_head is None:
            raise ValueError("model.head 'l1' needs the release's action_head--*checkpoint.pt; use head: discrete")
        if init_std <= 0 or final_std <= 0:
            raise ValueError(f"model.init_std and model.final_std must be > 0, got {init_std} and {final_std}")
        self.head, self.categorical = head, categorical
        self.action_head = action_head
        self.std_mode, self.init_std, self.final_std = std, init_std, final_std
        if std == "learned":
            self.log_std = nn.Parameter(torch.full((self.shape.action_dim,), math.log(init_std), device=self.device))
        self.register_buffer("std_progress", torch.zeros((), device=self.device))

    # --- the pass -------------------------------------------------------------------------------------------
    def slot_hidden(self, inp: PolicyInput) -> torch.Tensor:
        """[B, slots, H]: the final hidden states one position before each action slot."""
        batch, slots = len(inp.instructions), self.shape.tokens
        stop = self.embed(torch.full((batch, 1), STOP_TOKEN_ID, dtype=torch.long, device=self.device))
        tail = torch.cat([stop.new_zeros(batch, slots, stop.shape[-1]), stop], dim=1)
        seq = self.sequence(inp, tail=tail)
        mask = bidirectional_mask(seq.mask, seq.embeddings.dtype)
        out = self.llm.model(
            inputs_embeds=seq.embeddings,
            attention_mask=mask,
            position_ids=seq.positions,
            use_cache=False,
            is_causal=False,
        )
        start = seq.length - (slots + 1) - 1  # the last prompt token ('▁'), then the first slots - 1 placeholders
        return out.last_hidden_state[:, start : start + slots]

    def values(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(value [B], slot_value [B, chunk])."""
        per_action = hidden.reshape(len(hidden), self.shape.chunk, self.shape.action_dim, -1).mean(2)
        return self.value(hidden.mean(1)), self.value(per_action)

    def save_heads(self, folder: Path) -> None:
        save_oft_heads(
            folder, self.action_head, cast(Optional[ProprioProjector], self.proprio_projector), keep_dtype=True
        )

    # --- the L1 head's Gaussian -----------------------------------------------------------------------------
    def set_std_progress(self, fraction: float) -> None:
        """Move the 'scheduled' std to `fraction` (0..1) of the way to `final_std`; no-op when learned."""
        self.std_progress.fill_(min(max(float(fraction), 0.0), 1.0))

    def action_log_std(self) -> torch.Tensor:
        """float32 [action_dim]."""
        if self.std_mode == "learned":
            return self.log_std
        std = self.init_std + (self.final_std - self.init_std) * self.std_progress
        return std.log().expand(self.shape.action_dim)

    def mean(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.action_head is not None  # checked in __init__
        return self.action_head(hidden).float()

    # --- the policy -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        hidden = self.slot_hidden(inp)
        value, slot_value = self.values(hidden)
        shape = (-1, self.shape.chunk, self.shape.action_dim)
        if self.head == "l1":
            mean, log_std = self.mean(hidden), self.action_log_std()
            if deterministic:
                actions = mean
            else:  # noise drawn only when sampled
                actions = mean + log_std.exp() * row_normals(inp.seeds, mean.shape, self.device)
            per_token = gaussian_logprob(actions, mean, log_std)
        else:
            uniforms = row_uniforms(inp.seeds, len(hidden), self.shape.tokens, self.device)
            index, log_probs = self.categorical.choose(self._logits(hidden), deterministic, uniforms)
            actions = self.categorical.values(index).view(shape)
            per_token = log_probs.gather(-1, index[..., None])[..., 0].view(shape)
        return PolicyOutput(actions, per_token.sum(-1), value, token_logprob=per_token, slot_value=slot_value)

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        hidden = self.slot_hidden(inp)
        value, slot_value = self.values(hidden)
        actions = actions.to(self.device, torch.float32)
        shape = (-1, self.shape.chunk, self.shape.action_dim)
        if self.head == "l1":
            mean, log_std = self.mean(hidden), self.action_log_std()
            per_token = gaussian_logprob(actions, mean, log_std)
            dim_entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).expand_as(per_token)
        else:
            log_probs = self.categorical.log_probs(self._logits(hidden))
            index = self.categorical.index(actions).reshape(len(hidden), -1)
            per_token = log_probs.gather(-1, index[..., None])[..., 0].view(shape)
            dim_entropy = entropy(log_probs).view(shape)
        return PolicyEval(
            logprob=per_token.sum(-1),
            entropy=dim_entropy.sum(-1),
            value=value,
            token_logprob=per_token,
            slot_value=slot_value,
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.categorical.action_logits(self.llm.lm_head, hidden)
