"""Policy losses for stale samples: the generator's policy lags the learner's.

Three log-probs of the same actions: ``behaviour`` (the sampling policy, from the generator),
``proximal`` (the learner's weights at the start of the update, no grad) and ``new`` (with grad).
Corrections (``AlgoConfig.offpolicy_correction``): ``none`` (PPO on ``new / behaviour``),
``decoupled`` (decoupled PPO: clip ``new / proximal``, weight by ``min(proximal / behaviour,
behaviour_weight_cap)``) and ``tis`` (truncated importance sampling, no clip, ``tis_cap``). Details: docs/algorithms.md
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from vlaslurm.algos.ppo import Stats, fill_masked, masked_mean, ppo_policy_loss, reduce

CORRECTIONS = ("none", "decoupled", "tis")


def truncated_is_weight(target_logprob: Tensor, behaviour_logprob: Tensor, cap: float) -> Tensor:
    """``min(pi_target / pi_behaviour, cap)``, detached."""
    with torch.no_grad():
        return (target_logprob - behaviour_logprob).exp().clamp(max=cap)


def vtrace_traces(proximal: Tensor, behaviour: Tensor, mask: Tensor, per_action: bool) -> Tensor:
    """V-trace's traces ``min(1, proximal / behaviour)`` of the executed actions, for `gae`'s ``traces``:
    per decision step (``[N, T]``: the chunk's executed actions' ratios multiplied) or, with `per_action`, per
    action (``[N, T, C]``). Log-probs ``[N, T, C]``, or ``[N, T, C, A]`` per token (summed over A); `mask`
    ``[N, T, C]`` the executed actions."""
    with torch.no_grad():
        log_ratio = proximal - behaviour
        if log_ratio.ndim == 4:
            log_ratio = log_ratio.sum(-1)
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
        if not per_action:
            log_ratio = log_ratio.sum(-1)
        return log_ratio.clamp(max=0.0).exp()


def _weight_stats(target: Tensor, behaviour: Tensor, cap: float, mask: Optional[Tensor]) -> Stats:
    with torch.no_grad():
        raw = (target - behaviour).exp()
        return {
            "losses/is_weight": masked_mean(raw.clamp(max=cap), mask),
            "losses/is_capfrac": masked_mean((raw > cap).to(raw.dtype), mask),
        }


def tis_policy_loss(
    new_logprob: Tensor,
    behaviour_logprob: Tensor,
    advantages: Tensor,
    tis_cap: float,
    mask: Optional[Tensor] = None,
    reduction: str = "token",
) -> Tuple[Tensor, Stats]:
    """Truncated-IS policy gradient; the loss value is ``-mean(min(rho, cap) * A)``."""
    weight = fill_masked(truncated_is_weight(new_logprob.detach(), behaviour_logprob, tis_cap), mask)
    advantages = fill_masked(advantages.expand_as(weight), mask)
    # Value -w*A, gradient -w*A*grad(log pi): no exp of a large log-ratio, so no overflow.
    score = 1.0 + fill_masked(new_logprob - new_logprob.detach(), mask)
    loss = reduce(-weight * advantages * score, mask, reduction)
    logratio = (new_logprob - behaviour_logprob).detach()
    stats = _weight_stats(new_logprob.detach(), behaviour_logprob, tis_cap, mask)
    stats["losses/approx_kl"] = masked_mean(logratio.exp() - 1.0 - logratio, mask)
    stats["losses/clipfrac"] = stats["losses/is_capfrac"]
    stats["losses/policy_loss"] = loss.detach()
    return loss, stats


def policy_loss(
    new_logprob: Tensor,
    proximal_logprob: Tensor,
    behaviour_logprob: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    correction: str,
    tis_cap: float,
    mask: Optional[Tensor] = None,
    reduction: str = "token",
    dual_clip: Optional[float] = None,
    weight_cap: Optional[float] = None,
) -> Tuple[Tensor, Stats]:
    """Policy loss with the chosen off-policy ``correction`` (``none``, ``decoupled``, ``tis``).

    Shapes as in ``ppo.ppo_policy_loss``. ``proximal_logprob`` is only read by ``decoupled``, which caps its
    behaviour weight at ``weight_cap`` (``tis_cap`` if None); ``tis`` caps its ratio at ``tis_cap``.
    ``reduction``: ``token`` (mean over valid entries) or ``sequence`` (GRPO: per-row mean).
    """
    if correction == "none":
        return ppo_policy_loss(
            new_logprob, behaviour_logprob, advantages, clip_low, clip_high, mask, None, reduction, dual_clip
        )
    if correction == "decoupled":
        cap = tis_cap if weight_cap is None else weight_cap
        weight = truncated_is_weight(proximal_logprob, behaviour_logprob, cap)
        loss, stats = ppo_policy_loss(
            new_logprob, proximal_logprob, advantages, clip_low, clip_high, mask, weight, reduction, dual_clip
        )
        stats.update(_weight_stats(proximal_logprob, behaviour_logprob, cap, mask))
        return loss, stats
    if correction == "tis":
        return tis_policy_loss(new_logprob, behaviour_logprob, advantages, tis_cap, mask, reduction)
    raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
