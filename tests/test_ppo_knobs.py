"""PPO knobs of RLinf's recipes, against hand computations: dual clip, value clipping, the Huber value loss."""

from __future__ import annotations

import math

import pytest
import torch
from learner_helpers import rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.algos.ppo import ppo_policy_loss, value_errors
from vlaslurm.spec.algo_types import PPOConfig


def test_dual_clip_bounds_the_loss_of_a_negative_advantage():
    new = torch.tensor([2.0, 2.0, -2.0])  # log-ratios against old = 0: r = e^2, e^2, e^-2
    adv = torch.tensor([-1.0, 1.0, -1.0])
    plain, _ = ppo_policy_loss(new, torch.zeros(3), adv, 0.2, 0.2, reduction="token")
    dual, _ = ppo_policy_loss(new, torch.zeros(3), adv, 0.2, 0.2, reduction="token", dual_clip=3.0)
    e2 = math.exp(2.0)
    # per element, plain: -min(r A, clip(r) A) = e^2, -1.2, 0.8; dual caps the first at -c A = 3
    assert float(plain) == pytest.approx((e2 - 1.2 + 0.8) / 3, rel=1e-6)
    assert float(dual) == pytest.approx((3.0 - 1.2 + 0.8) / 3, rel=1e-6)


def test_value_errors_clip_and_huber():
    new, ret, old = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 3.0]), torch.tensor([0.0, 0.0])
    torch.testing.assert_close(value_errors(new, ret), torch.tensor([2.0, 4.5]))
    # clipped to within 0.5 of old: V' = 0.5, 0.0; the larger error of V and V' per element
    torch.testing.assert_close(value_errors(new, ret, old, clip=0.5), torch.tensor([2.0, 4.5]))
    new2 = torch.tensor([-1.0, 1.0])
    torch.testing.assert_close(value_errors(new2, ret, old, clip=0.5), torch.tensor([0.5, 3.125]))
    # Huber with delta 1: 0.5 x^2 inside, |x| - 0.5 outside
    torch.testing.assert_close(value_errors(new, ret, huber_delta=1.0), torch.tensor([1.5, 2.5]))


def test_ppo_runs_with_every_knob():
    batch = collate(rollout_segments(tiny_policy(seed=1), num_envs=4, chunks=4))
    cfg = PPOConfig(
        type="ppo",
        lr=1e-3,
        epochs=1,
        minibatches=2,
        logprob_level="action",
        dual_clip=3.0,
        value_clip=0.2,
        value_loss="huber",
        huber_delta=0.5,
    )
    stats = make_learner(cfg, tiny_policy(seed=3), DataParallel(None, 0, 1), 7).update(batch, version=1)
    assert stats["losses/value_loss"] > 0 and all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("value_level", ["chunk", "action"])
def test_vtrace_traces_change_only_stale_samples_advantages(value_level):
    """gae_traces: vtrace gives plain GAE where the proximal policy is the behaviour one (fresh samples), and
    damps what later steps contribute where the current policy would take their actions less often."""
    batch = collate(rollout_segments(tiny_policy(seed=1), num_envs=4, chunks=6))
    t = batch.tensors
    cfg = dict(type="ppo", logprob_level="action", value_level=value_level, gamma=0.99, gae_lambda=0.95)
    traced = make_learner(PPOConfig(**cfg, gae_traces="vtrace"), tiny_policy(seed=3), DataParallel(None, 0, 1), 0)
    plain = make_learner(PPOConfig(**cfg, gae_traces="none"), tiny_policy(seed=3), DataParallel(None, 0, 1), 0)
    (n, T), chunk = t["step_valid"].shape, t["mask"].shape[2]
    values = torch.linspace(-1, 1, n * (T + 1) * chunk).reshape(n, T + 1, chunk)  # a value per action slot
    values = values[..., 0] if value_level == "chunk" else values
    fresh = t["logprob"].clone()
    assert torch.equal(traced.advantages(batch, values, fresh)[0], plain.advantages(batch, values, fresh)[0])
    stale = fresh - 0.5  # the current policy likes every stored action less than the sampling one did
    damped, undamped = traced.advantages(batch, values, stale)[0], plain.advantages(batch, values, stale)[0]
    assert not torch.equal(damped, undamped)
    assert torch.equal(plain.advantages(batch, values, stale)[0], plain.advantages(batch, values)[0])
