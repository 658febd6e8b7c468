"""The frozen reference policy of `algo.kl_coef`: the initial values of the policy's trainable parameters.

Only trainable parameters can move away from their initial values, so only they are kept (a LoRA run keeps its
adapters, not the backbone): the extra memory is their bytes on each trainer rank (a shard of each under FSDP).
`swapped()` puts them into the policy for a forward pass and back, one parameter at a time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import torch
from torch import nn


class FrozenReference:
    """The policy's trainable parameters as they are when this is built (the initial policy)."""

    def __init__(self, policy: nn.Module) -> None:
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.initial: List[torch.Tensor] = [p.detach().clone() for p in self.params]

    def nbytes(self) -> int:
        """Memory the reference holds: what the placement model adds with `algo.kl_coef` > 0."""
        return sum(t.numel() * t.element_size() for t in self.initial)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Within: the policy computes with the reference's parameters (no gradients); after: its own again."""
        with torch.no_grad():
            self._swap()
            try:
                yield
            finally:
                self._swap()

    def _swap(self) -> None:
        for param, ref in zip(self.params, self.initial):
            held = param.detach().clone()  # one parameter's copy at a time
            param.detach().copy_(ref)
            ref.copy_(held)
