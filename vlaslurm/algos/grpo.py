"""GRPO: advantages relative to a group of rollouts from the same task and initial state.

Trajectories are batch-major here: ``[N, T]`` = trajectories x decision steps (chunks),
with ``group_ids[N]`` any integers (groups need not be contiguous nor the same size).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from vlaslurm.algos.ppo import Stats, ppo_policy_loss


def _group_normalise(x: Tensor, ids: Tensor, valid: Tensor, eps: float) -> Tensor:
    """``(x - mean) / (std + eps)`` within each id over valid entries (1-D); 0 elsewhere.

    The std is the population std (a group of one gets 0). A group whose std is at most
    ``eps`` carries no signal and gets 0 rather than rounding noise divided by ``eps``.
    """
    _, inverse = torch.unique(ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    w = valid.to(x.dtype)
    xv = torch.where(valid, x, torch.zeros_like(x))
    count = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, w)
    total = torch.zeros_like(count).index_add_(0, inverse, xv)
    mean = (total / count.clamp(min=1))[inverse]
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    var = torch.zeros_like(count).index_add_(0, inverse, sq) / count.clamp(min=1)
    std = var.sqrt()[inverse]
    adv = (x - mean) / (std + eps)
    return torch.where(valid & (std > eps), adv, torch.zeros_like(x))


def group_advantages(returns: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Episode-level GRPO advantage ``[N]``: each return normalised within its group."""
    return _group_normalise(returns, group_ids, torch.ones_like(returns, dtype=torch.bool), eps)


def group_advantages_per_step(returns: Tensor, group_ids: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """Per-decision-step GRPO advantage ``[N, T]``.

    ``returns[n, t]`` is trajectory ``n``'s return from step ``t`` on (see ``reward_to_go``);
    it is normalised against the same step of the other group members still running
    (``mask[n, t]``). Denser credit than one advantage per episode.
    """
    N, T = returns.shape
    step = torch.arange(T, device=returns.device)
    ids = group_ids.long().unsqueeze(1) * T + step  # one group per (group, step)
    adv = _group_normalise(returns.flatten(), ids.flatten(), mask.bool().flatten(), eps)
    return adv.reshape(N, T)


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G[n, t] = sum_{k >= t} gamma**(k - t) r[n, k]`` over valid steps: ``[N, T] -> [N, T]``."""
    r = torch.where(mask.bool(), rewards, torch.zeros_like(rewards))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def success_filter_mask(success: Tensor, group_ids: Tensor, low: float, high: float) -> Tensor:
    """Bool ``[N]``: keep trajectories whose group's success rate lies in ``[low, high]``.

    Groups that all succeed or all fail have zero advantage; ``[low, high]`` strictly inside
    ``[0, 1]`` drops them so they do not dilute the batch.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    s = success.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(0, inverse, torch.ones_like(s))
    rate = (torch.zeros_like(count).index_add_(0, inverse, s) / count)[inverse]
    return (rate >= low) & (rate <= high)


def valid_action_mask(lengths: Tensor, T: int) -> Tensor:
    """Bool ``[N, T]``: step ``t`` of trajectory ``n`` is valid iff ``t < lengths[n]``."""
    return torch.arange(T, device=lengths.device) < lengths.unsqueeze(-1)


def grpo_policy_loss(
    new_logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> Tuple[Tensor, Stats]:
    """Clipped surrogate ``[N, T]``, averaged over each trajectory's valid steps, then trajectories.

    ``advantages`` is ``[N]`` (episode level, broadcast over steps) or ``[N, T]`` (per step).
    For stale samples use ``offpolicy.policy_loss(..., reduction="sequence")`` instead.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return ppo_policy_loss(new_logprob, old_logprob, adv, clip_low, clip_high, mask, reduction="sequence")
