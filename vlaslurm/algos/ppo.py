"""PPO losses as pure functions, with masked reductions.

Losses are minimised: ``loss = policy_loss + value_coef * value_loss - entropy_coef * entropy``.
Stats are detached 0-dim tensors keyed by cleanrl's metric names; call ``.item()`` when
logging so the update loop does not sync the device once per minibatch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

Stats = Dict[str, Tensor]
REDUCTIONS = ("token", "sequence")


def masked_mean(x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is true; 0 (still differentiable) if none are."""
    if mask is None:
        return x.mean()
    mask = mask.bool().expand_as(x)
    # where(), not x * mask: padded entries may hold inf/nan (e.g. exp of a garbage logprob).
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1)


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over each row's valid entries, then over rows that have any: ``[N, T] -> []``.

    Every trajectory weighs the same whatever its length (GRPO's normalisation); rows with
    no valid entry (e.g. filtered groups) are left out rather than counted as zero.
    """
    mask = mask.bool().expand_as(x)
    row_sum = torch.where(mask, x, torch.zeros_like(x)).sum(-1)
    row_len = mask.sum(-1)
    row_mean = row_sum / row_len.clamp(min=1)
    return masked_mean(row_mean, row_len > 0)


def reduce(x: Tensor, mask: Optional[Tensor], reduction: str) -> Tensor:
    """``token``: mean over all valid entries; ``sequence``: ``sequence_mean`` over ``[N, T]``."""
    if reduction == "token":
        return masked_mean(x, mask)
    if reduction == "sequence":
        return sequence_mean(x, torch.ones_like(x, dtype=torch.bool) if mask is None else mask)
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def fill_masked(x: Tensor, mask: Optional[Tensor], value: float = 0.0) -> Tensor:
    """``x`` with entries outside ``mask`` set to ``value``.

    Applied to inputs before any exp or product: ``where`` alone zeroes a padded entry's
    value, but its gradient would still be ``0 * nan = nan`` if the entry held inf or nan.
    """
    if mask is None:
        return x
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def clip_stats(logratio: Tensor, clip_low: float, clip_high: float, mask: Optional[Tensor]) -> Stats:
    """approx_kl with the low-variance ``(r - 1) - log r`` estimator, and the clipped fraction."""
    with torch.no_grad():
        ratio = logratio.exp()
        clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        return {
            "losses/approx_kl": masked_mean((ratio - 1.0) - logratio, mask),
            "losses/clipfrac": masked_mean(clipped.to(logratio.dtype), mask),
        }


def ppo_policy_loss(
    new_logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    mask: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    reduction: str = "token",
    dual_clip: Optional[float] = None,
) -> Tuple[Tensor, Stats]:
    """Clipped surrogate ``-min(r A, clip(r, 1 - low, 1 + high) A)`` with ``r = exp(new - old)``.

    All tensors share one shape (``advantages`` broadcastable to it; use
    ``gae.expand_chunk`` to give every action or token of a chunk its chunk's advantage).
    ``weight`` (treated as constant) multiplies each element's surrogate; decoupled PPO
    passes its behaviour importance weight here. ``dual_clip`` c > 1 bounds the loss of a negative
    advantage at ``-c A`` (dual-clip PPO, RLinf's ``clip_ratio_c``): a huge ratio cannot dominate it.
    """
    logratio = fill_masked(new_logprob - old_logprob.detach(), mask)
    advantages = fill_masked(advantages.expand_as(logratio), mask)
    ratio = logratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_elem = -torch.min(unclipped, clipped)
    if dual_clip is not None:
        per_elem = torch.where(advantages < 0, torch.min(per_elem, -dual_clip * advantages), per_elem)
    if weight is not None:
        per_elem = fill_masked(weight.detach().expand_as(per_elem), mask) * per_elem
    loss = reduce(per_elem, mask, reduction)
    stats = clip_stats(logratio.detach(), clip_low, clip_high, mask)
    stats["losses/policy_loss"] = loss.detach()
    return loss, stats


def value_errors(
    new_values: Tensor,
    returns: Tensor,
    old_values: Optional[Tensor] = None,
    clip: Optional[float] = None,
    huber_delta: Optional[float] = None,
) -> Tensor:
    """Per element: ``0.5 (V - R)^2``, or the Huber loss of ``V - R`` with ``huber_delta``; with ``old_values`` and
    ``clip``, the larger of that and the error of ``V`` clipped to within ``clip`` of ``old_values`` (cleanrl's
    ``clip_vloss``, RLinf's ``value_clip``)."""

    def error(v: Tensor) -> Tensor:
        if huber_delta is None:
            return 0.5 * (v - returns) ** 2
        return torch.nn.functional.huber_loss(v, returns, reduction="none", delta=huber_delta)

    err = error(new_values)
    if clip is not None and old_values is not None:
        err = torch.max(err, error(old_values + (new_values - old_values).clamp(-clip, clip)))
    return err


def value_loss(
    new_values: Tensor,
    returns: Tensor,
    old_values: Optional[Tensor] = None,
    clip: Optional[float] = None,
    mask: Optional[Tensor] = None,
) -> Tensor:
    """``0.5 * (V - R)^2``; with ``old_values`` and ``clip``, the pessimistic clipped version (mean of
    `value_errors`)."""
    return masked_mean(value_errors(new_values, returns, old_values, clip), mask)


def entropy_bonus(entropy: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Mean entropy (positive); the total loss subtracts ``entropy_coef`` times it."""
    return masked_mean(entropy, mask)


def entropy_at_level(entropy: Tensor, mask: Tensor, level: str, action_dim: int) -> Tuple[Tensor, int]:
    """The mean entropy per token, action or chunk (`algo.entropy_level`) and how many of those it averages.

    ``entropy`` ``[B, C]`` is each action's entropy, the sum over its ``action_dim`` dimensions' (every policy's
    distribution factorises so), ``mask`` ``[B, C]`` its executed actions. ``token``: the mean over action
    dimensions (each action's entropy / action_dim); ``action``: over executed actions; ``chunk``: each chunk's
    sum over its executed actions, averaged over chunks (RLinf's entropy_type).
    """
    executed = int(mask.sum())
    if level == "action":
        return masked_mean(entropy, mask), executed
    if level == "token":
        return masked_mean(entropy / action_dim, mask), executed * action_dim
    if level == "chunk":
        return torch.where(mask.bool(), entropy, torch.zeros_like(entropy)).sum(-1).mean(), entropy.shape[0]
    raise ValueError(f"algo.entropy_level must be token, action or chunk, got {level!r}")


def kl_k3(new_logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """Per element, Schulman's k3 estimate of KL(new || ref): ``exp(ref - new) - (ref - new) - 1``.

    Unbiased for samples of the current policy, never negative, low variance (the GRPO paper's and RLinf's
    ``low_var_kl``); the reference's log-probs are constants. The log-ratio is clamped to +-20 (as verl's
    ``low_var_kl``), so a far-off element cannot overflow ``exp``.
    """
    delta = (ref_logprob.detach() - new_logprob).clamp(-20.0, 20.0)
    return delta.exp() - delta - 1.0


def explained_variance(y_pred: Tensor, y_true: Tensor, mask: Optional[Tensor] = None) -> float:
    """``1 - Var[y_true - y_pred] / Var[y_true]`` over valid entries; nan if ``Var[y_true]`` is 0.

    1 is a perfect critic, 0 is no better than a constant, negative is worse.
    """
    with torch.no_grad():
        if mask is not None:
            keep = mask.bool().expand_as(y_true)
            y_pred, y_true = y_pred[keep], y_true[keep]
        y_pred, y_true = y_pred.double().flatten(), y_true.double().flatten()
        if y_true.numel() == 0:
            return float("nan")
        var_y = y_true.var(unbiased=False)
        if var_y == 0:
            return float("nan")
        return float(1.0 - (y_true - y_pred).var(unbiased=False) / var_y)
