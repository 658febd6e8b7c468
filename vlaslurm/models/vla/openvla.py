"""`model.type: openvla` over a released checkpoint: action tokens decoded one at a time, as the release.

A decision is `chunk x action_dim` tokens (the release: 1 x 7), each drawn from `CentreCategorical` at
`model.temperature` given the image, the prompt and the tokens before it (KV cache). Log-probs are exact per
token; an action's is the sum over its dimensions. The value of a decision reads the last prompt position; the
value of action slot k reads the position before its first token.
"""

from __future__ import annotations

from typing import Any

import torch

from vlaslurm.models.base import PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.models.common import run_lm
from vlaslurm.models.vla.base import VLAPolicy
from vlaslurm.models.vla.bins import CentreCategorical, entropy
from vlaslurm.models.vla.inputs import row_uniforms


class OpenVLATokenPolicy(VLAPolicy):
    """The OpenVLA release as a token-level stochastic policy with a value head."""

    def __init__(self, *args: Any, categorical: CentreCategorical, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.categorical = categorical

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.categorical.action_logits(self.llm.lm_head, hidden)

    @torch.no_grad()
    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        lm = self.llm.model
        seq = self.sequence(inp)
        out, mask, cache = run_lm(lm, seq.embeddings, seq.mask, use_cache=True)
        hidden = out[:, -1]
        n, per_action = self.shape.tokens, self.shape.action_dim
        uniforms = row_uniforms(inp.seeds, len(hidden), n, self.device)
        chosen, token_lp, before_action = [], [], []
        for k in range(n):
            if k % per_action == 0:
                before_action.append(hidden)
            uniform = None if uniforms is None else uniforms[:, k]
            index, log_probs = self.categorical.choose(self._logits(hidden), deterministic, uniform)
            chosen.append(index)
            token_lp.append(log_probs.gather(-1, index[:, None])[:, 0])
            if k + 1 == n:
                break
            step = self.embed(self.categorical.token_ids(index))[:, None]
            out, mask, cache = run_lm(lm, step, mask.new_ones(len(index), 1), cache, past_mask=mask, use_cache=True)
            hidden = out[:, -1]
        shape = (-1, self.shape.chunk, per_action)
        actions = self.categorical.values(torch.stack(chosen, 1)).view(shape)
        per_token = torch.stack(token_lp, 1).view(shape)
        slot_value = self.value(torch.stack(before_action, 1))
        return PolicyOutput(
            actions=actions,
            logprob=per_token.sum(-1),
            value=slot_value[:, 0],
            token_logprob=per_token,
            slot_value=slot_value,
        )

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        """Teacher-forced: the prompt, then every stored token but the last; position t predicts token t."""
        n, per_action = self.shape.tokens, self.shape.action_dim
        index = self.categorical.index(actions.to(self.device)).reshape(len(inp.instructions), n)
        fed = self.embed(self.categorical.token_ids(index[:, :-1]))
        seq = self.sequence(inp, tail=fed)
        hidden, _, _ = run_lm(self.llm.model, seq.embeddings, seq.mask)
        predicting = hidden[:, seq.length - n :]  # the last prompt position, then the fed tokens
        log_probs = self.categorical.log_probs(self._logits(predicting))
        shape = (-1, self.shape.chunk, per_action)
        per_token = log_probs.gather(-1, index[..., None])[..., 0].view(shape)
        slot_value = self.value(predicting[:, ::per_action])
        return PolicyEval(
            logprob=per_token.sum(-1),
            entropy=entropy(log_probs).view(shape).sum(-1),
            value=slot_value[:, 0],
            token_logprob=per_token,
            slot_value=slot_value,
        )
