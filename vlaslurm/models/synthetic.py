"""A policy that sleeps instead of computing (`model.type: synthetic`).

Its forward time is `base + per_item * batch` ms, so the runtime's batching can
be measured without CPU contention; its weights are a plain vector, so weight
synchronisation still moves real bytes. Drawing the actions counts inside that time,
and a sleep's late wake-up (the OS's, not the model's) is taken back from the next
forward, as the synthetic simulator does with its steps (docs/simulators.md).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from vlaslurm.models.base import PolicyEval, PolicyInput, PolicyOutput
from vlaslurm.spec.model_types import SyntheticModelConfig


class SyntheticPolicy(nn.Module):
    """Random actions after a modelled delay."""

    def __init__(self, cfg: SyntheticModelConfig, action_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.action_chunk = cfg.action_chunk
        self.action_dim = action_dim
        self.weight = nn.Parameter(torch.zeros(cfg.num_params))
        self._late = 0.0  # seconds the last forward's wake-up came after its deadline

    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        start = time.perf_counter()
        batch = len(inp.instructions)
        out = self._outputs(inp, batch)
        seconds = (self.cfg.forward_ms.base + self.cfg.forward_ms.per_item * batch) / 1000.0
        deadline = start + seconds - min(self._late, seconds)
        slept = False
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
            slept = True
        # Only a sleep's lateness is the OS's: drawing the actions past the deadline is this forward's own cost.
        self._late = time.perf_counter() - deadline if slept else 0.0
        return out

    def _outputs(self, inp: PolicyInput, batch: int) -> PolicyOutput:
        shape = (self.action_chunk, self.action_dim)
        if inp.seeds is None:
            actions = torch.rand(batch, *shape) * 2 - 1
        else:
            actions = (
                torch.stack(
                    [
                        torch.rand(*shape, generator=torch.Generator().manual_seed(int(s))) * 2 - 1
                        for s in inp.seeds.tolist()
                    ]
                )
                if batch
                else torch.zeros(0, *shape)
            )
        tokens = torch.zeros(batch, self.action_chunk, self.action_dim)
        slots = torch.zeros(batch, self.action_chunk)
        return PolicyOutput(
            actions, torch.zeros(batch, self.action_chunk), torch.zeros(batch), token_logprob=tokens, slot_value=slots
        )

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        batch = actions.shape[0]
        # Tie the outputs to the weights so a real optimizer step has something to move.
        zero = self.weight.sum() * 0.0
        return PolicyEval(
            torch.zeros(batch, self.action_chunk) + zero,
            torch.zeros(batch, self.action_chunk),
            torch.zeros(batch) + zero,
            token_logprob=torch.zeros(batch, self.action_chunk, self.action_dim) + zero,
            slot_value=torch.zeros(batch, self.action_chunk) + zero,
        )


def build(
    cfg: SyntheticModelConfig, action_dim: int, state_dim: int, image_size: int, num_cameras: int
) -> SyntheticPolicy:
    """Build the synthetic policy."""
    return SyntheticPolicy(cfg, action_dim)
