"""Generalised advantage estimation over decision steps and action chunks.

Tensors are time-major, ``[T, N]`` = steps x env instances: ``rewards``, ``values`` (V(s_t)),
``next_values`` (V after step t; for a done step the episode's final observation, so truncated
episodes bootstrap), ``terminated`` (no bootstrap) and ``truncated`` (bootstrap); either flag cuts
the recursion. Chunk level: one decision step per chunk (`chunk_rewards`, `compute_gae`); action
level: one step per action (`action_level_gae`). With `traces` (V-trace's truncated importance weights
of each step's action, `offpolicy.vtrace_traces`) the advantages are the current policy's on stale samples.
Details: docs/algorithms.md
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor


def compute_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: Union[float, Tensor],
    lam: float,
    traces: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) with partial resets; returns ``(advantages, returns)``, each ``[T, N]``.

    ``gamma`` is a float or a ``[T, N]`` tensor of per-step discounts (see ``chunk_rewards``).
    ``returns = advantages + values`` are the value-function targets. ``traces`` ``[T, N]``, each step's
    ``c_t = min(1, pi(a_t) / mu(a_t))``: ``A_t = delta_t + gamma lam c_{t+1} A_{t+1}`` (V-trace / Retrace): a
    later action the current policy would take less often than the sampling one did carries less of its
    future into ``A_t``. All ones (or None) is plain GAE.
    """
    gamma_t = torch.as_tensor(gamma, dtype=values.dtype, device=values.device).expand_as(values)
    terminated, truncated = terminated.bool(), truncated.bool()
    # Termination: the next state has value 0. Truncation: it has the value of the final obs.
    bootstrap = torch.where(terminated, torch.zeros_like(next_values), next_values)
    deltas = rewards + gamma_t * bootstrap - values
    # Any done step cuts the recursion: the following step belongs to a new episode.
    carry = gamma_t * lam * (~(terminated | truncated)).to(values.dtype)
    if traces is not None:  # step t carries A_{t+1} weighted by the trace of step t+1's action
        carry = carry * torch.cat([traces[1:], torch.ones_like(traces[:1])])

    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[0])
    for t in reversed(range(values.shape[0])):
        last = deltas[t] + carry[t] * last
        advantages[t] = last
    return advantages, advantages + values


def chunk_rewards(rewards: Tensor, mask: Tensor, gamma: float) -> Tuple[Tensor, Tensor]:
    """Fold per-action rewards ``[..., C]`` into one reward per chunk and its discount.

    Returns ``(reward, discount)``, each ``[...]``: ``reward = sum_k gamma**k r_k`` over
    valid actions and ``discount = gamma**n_valid``, so a chunk cut short by the end of an
    episode bootstraps at exactly the env step where the episode ended. Padded actions
    (mask 0) only ever follow the last valid action.
    """
    valid = mask.to(rewards.dtype)
    powers = gamma ** torch.arange(rewards.shape[-1], dtype=rewards.dtype, device=rewards.device)
    reward = (torch.where(mask.bool(), rewards, torch.zeros_like(rewards)) * powers).sum(-1)
    discount = gamma ** valid.sum(-1)
    return reward, discount


def expand_chunk(x: Tensor, chunk_size: int) -> Tensor:
    """Repeat a per-chunk quantity ``[...]`` for each action: ``[..., C]`` (a view)."""
    return x.unsqueeze(-1).expand(*x.shape, chunk_size)


def flatten_chunks(x: Tensor) -> Tensor:
    """Action-major time: ``[T, N, C] -> [T*C, N]``, action ``k`` of chunk ``t`` at row ``t*C + k``."""
    T, N, C = x.shape
    return x.permute(0, 2, 1).reshape(T * C, N)


def unflatten_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """Inverse of ``flatten_chunks``: ``[T*C, N] -> [T, N, C]``."""
    TC, N = x.shape
    return x.reshape(TC // chunk_size, chunk_size, N).permute(0, 2, 1)


def action_level_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    mask: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
    traces: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """GAE where each action of a chunk is its own step with its own value.

    Shapes: ``rewards, values, mask: [T, N, C]`` (``values[t, :, k]`` is the value head's
    estimate before action ``k``); ``next_values, terminated, truncated: [T, N]`` as in
    ``compute_gae`` (chunk level). Action ``k`` bootstraps from ``values[t, :, k+1]``; the
    last valid action of the chunk bootstraps from ``next_values[t]`` and carries the chunk's
    done flags. ``gamma`` and ``lam`` apply per env step; ``traces`` ``[T, N, C]`` per action as in
    ``compute_gae``. Returns ``(advantages, returns)`` ``[T, N, C]``, zero on padded actions.
    """
    valid = mask.bool()
    n_valid = valid.sum(-1, keepdim=True)
    C = rewards.shape[-1]
    position = torch.arange(C, device=rewards.device)
    is_last = position == (n_valid - 1).clamp(min=0)  # [T, N, C]
    shifted = torch.cat([values[..., 1:], values[..., -1:]], dim=-1)
    action_next = torch.where(is_last, next_values.unsqueeze(-1), shifted)
    term = is_last & terminated.bool().unsqueeze(-1)
    trunc = is_last & truncated.bool().unsqueeze(-1)
    # Padded actions become inert steps (zero reward and values, done) so nothing leaks
    # through them, even if a producer padded a chunk without flagging the episode done.
    zeros = torch.zeros_like(rewards)
    adv, _ = compute_gae(
        flatten_chunks(torch.where(valid, rewards, zeros)),
        flatten_chunks(torch.where(valid, values, zeros)),
        flatten_chunks(torch.where(valid, action_next, zeros)),
        flatten_chunks(term),
        flatten_chunks(trunc | ~valid),
        gamma,
        lam,
        None if traces is None else flatten_chunks(torch.where(valid, traces, torch.ones_like(traces))),
    )
    adv = torch.where(valid, unflatten_chunks(adv, C), zeros)
    return adv, torch.where(valid, adv + values, zeros)
