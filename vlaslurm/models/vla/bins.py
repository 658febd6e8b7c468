"""The RL distribution over a release's action bins: a categorical over the distinct bin centres.

The release decodes 256 action tokens to 255 centres: the two top tokens (31744 and 31745) share the last centre.
A policy over tokens would then give one environment action two log-probs, depending on which token was drawn, and
a stored action could not tell them apart. So the distribution here is over centres: `log pi(c)` is the tempered
softmax over the 256 action-token logits, with the two tokens of the shared centre adding their probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from vlaslurm.models.prismatic.actions import ActionBins


@dataclass(frozen=True)
class CentreCategorical:
    """Tempered categorical over `bins`' centres; indices 0..n_bins-2 from `low` up."""

    bins: ActionBins
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"model.temperature must be > 0, got {self.temperature}")

    @property
    def size(self) -> int:
        return self.bins.n_bins - 1

    def action_logits(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [..., n_bins]: the LM head's logits of the action ids (first_token..last_token) at `hidden`.

        A plain linear head is sliced to the action rows (the full 32064-wide product is 125x larger); a wrapped
        one (LoRA on lm_head) is applied whole, then sliced.
        """
        first, last = self.bins.first_token, self.bins.last_token + 1
        if type(head) is nn.Linear:
            bias = None if head.bias is None else head.bias[first:last]
            return nn.functional.linear(hidden, head.weight[first:last], bias).float()
        return head(hidden)[..., first:last].float()

    def log_probs(self, action_logits: torch.Tensor) -> torch.Tensor:
        """[..., n_bins] token logits (by token id) -> float32 [..., n_bins - 1] log-probs by centre index."""
        tokens = torch.log_softmax(action_logits.float() / self.temperature, dim=-1)
        # centre c <- token last_token - c, for c < n_bins - 2; the top centre <- the two lowest token ids
        by_centre = tokens.flip(-1)
        top = torch.logaddexp(by_centre[..., -2], by_centre[..., -1])
        return torch.cat([by_centre[..., :-2], top[..., None]], dim=-1)

    def index(self, actions: torch.Tensor) -> torch.Tensor:
        """Normalised actions (any shape) -> long centre indices: the bin whose interval holds each value."""
        b = self.bins
        unit = (actions.to(torch.float64) - b.low) / (b.high - b.low)
        return (unit * (b.n_bins - 1)).floor().long().clamp(0, self.size - 1)

    def values(self, index: torch.Tensor) -> torch.Tensor:
        """float32 centre values of `index` (any shape)."""
        centres = torch.from_numpy(self.bins.centers).to(index.device)
        return centres[index].float()

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """The token fed back for a centre (teacher forcing, decoding): `last_token - c` (the top centre: 31745)."""
        return self.bins.last_token - index

    def greedy(self, action_logits: torch.Tensor) -> torch.Tensor:
        """long [...] centre of the most likely action token: the release's greedy decode (restricted to action
        tokens). Not the mode of the centres: the shared top centre holds two tokens' probability."""
        token = action_logits.argmax(-1)  # 0 = first_token (the top centre) ... n_bins - 1 = last_token (centre 0)
        return (self.bins.n_bins - 1 - token).clamp(max=self.size - 1)

    def choose(
        self, action_logits: torch.Tensor, deterministic: bool, uniform: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(long [...] centre indices, float32 [..., n_bins - 1] log-probs): the release's greedy choice, an
        inverse-CDF draw from `uniform` [...] (per-row seeds), or a torch draw."""
        log_probs = self.log_probs(action_logits)
        if deterministic:
            return self.greedy(action_logits), log_probs
        probs = log_probs.exp()
        if uniform is None:
            flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1)[:, 0]
            return flat.reshape(probs.shape[:-1]), log_probs
        below = (probs.cumsum(-1) < uniform[..., None]).sum(-1)
        return below.clamp(max=self.size - 1), log_probs


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """float32 [...] entropy of the categoricals [..., K]."""
    return -(log_probs.exp() * log_probs).sum(-1)
