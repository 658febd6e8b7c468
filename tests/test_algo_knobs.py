"""Issue 17's off-by-default learner knobs against hand computations or references: the k3 KL estimator and
the penalty to the frozen initial policy (`algo.kl_coef`), `algo.reward_scale`, `algo.entropy_level`; and
GRPO's defaults as the paper's recipes (outcome advantage, success filter [0.1, 0.9], clip 0.2/0.28). ~25 s."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from learner_helpers import algo_config, rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate, episode_layout
from vlaslurm.algos.learners import DataParallel, evaluate_all, make_learner
from vlaslurm.algos.ppo import entropy_at_level, kl_k3
from vlaslurm.spec.algo_types import GRPOConfig, PPOConfig


@pytest.fixture(scope="module")
def batch():
    """Sampled by the policy the tests then train (tiny_policy(seed=3)): a first update is on-policy."""
    return collate(rollout_segments(tiny_policy(seed=3), num_envs=4, chunks=4))


def test_k3_is_unbiased_for_the_exact_kl():
    # E_{x ~ p}[k3(log p(x), log q(x))] = sum q - 1 + KL(p || q) = KL(p || q): exact under p's own weights
    p = torch.distributions.Categorical(probs=torch.tensor([0.5, 0.3, 0.2]))
    q = torch.distributions.Categorical(probs=torch.tensor([0.2, 0.2, 0.6]))
    x = torch.arange(3)
    expected = float((p.probs * kl_k3(p.log_prob(x), q.log_prob(x))).sum())
    assert expected == pytest.approx(float(torch.distributions.kl_divergence(p, q)), rel=1e-6)
    # one hand value: new = log 0.5, ref = log 0.25 -> 0.5 - log 0.5 - 1
    one = kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25)))
    assert float(one) == pytest.approx(0.5 + math.log(2.0) - 1.0, rel=1e-6)
    assert float(kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0


def test_entropy_at_each_level_by_hand():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # each action's, summed over its 2 dimensions
    mask = torch.tensor([[True, True], [True, False]])  # the second chunk ended after one action
    action, n_action = entropy_at_level(entropy, mask, "action", action_dim=2)
    token, n_token = entropy_at_level(entropy, mask, "token", action_dim=2)
    chunk, n_chunk = entropy_at_level(entropy, mask, "chunk", action_dim=2)
    assert (float(action), n_action) == (pytest.approx(2.0), 3)  # (1 + 2 + 3) / 3
    assert (float(token), n_token) == (pytest.approx(1.0), 6)  # per dimension: the action's / 2
    assert (float(chunk), n_chunk) == (pytest.approx(3.0), 2)  # chunks (1 + 2) and 3


def test_kl_penalty_is_to_the_frozen_initial_policy(batch):
    cfg = replace(algo_config("ppo", "action", minibatches=1), epochs=1, kl_coef=0.5)
    policy = tiny_policy(seed=3)
    learner = make_learner(cfg, policy, DataParallel(None, 0, 1), 7)
    with torch.no_grad():  # what trains moves after the reference was taken (frozen embeddings never do)
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    moved = {k: v.clone() for k, v in policy.state_dict().items()}
    ref = learner.step.reference_logprobs(batch)
    assert all(torch.equal(moved[k], v) for k, v in policy.state_dict().items())  # swapped back
    initial = evaluate_all(tiny_policy(seed=3), batch, values=False)[1]
    torch.testing.assert_close(ref, initial)
    # the first (only) minibatch's KL statistic: k3 of the moved policy's log-probs against the initial's
    now = evaluate_all(policy, batch, values=False)[1]
    valid = batch.tensors["mask"] & batch.tensors["step_valid"][..., None]
    expected = float(kl_k3(now, initial)[valid].mean())
    stats = learner.update(batch, version=0)
    assert expected > 1e-4 and stats["losses/ref_kl"] == pytest.approx(expected, rel=1e-4)
    # the reference stays frozen through the update
    torch.testing.assert_close(learner.step.reference_logprobs(batch), initial)


def kl_after_training(batch, kl_coef: float) -> float:
    cfg = replace(algo_config("ppo", "action", minibatches=2), epochs=4, lr=3e-3, kl_coef=kl_coef)
    policy = tiny_policy(seed=3)
    learner = make_learner(cfg, policy, DataParallel(None, 0, 1), 7)
    initial = evaluate_all(tiny_policy(seed=3), batch, values=False)[1]
    learner.update(batch, version=0)
    valid = batch.tensors["mask"] & batch.tensors["step_valid"][..., None]
    return float(kl_k3(evaluate_all(policy, batch, values=False)[1], initial)[valid].mean())


def test_kl_penalty_keeps_the_policy_near_the_reference(batch):
    free, held = kl_after_training(batch, 0.0), kl_after_training(batch, 50.0)
    assert held < 0.5 * free, (free, held)


def test_reward_scale_scales_ppo_returns_and_advantages(batch):
    values = torch.zeros(batch.tensors["step_valid"].shape[0], batch.tensors["step_valid"].shape[1] + 1)
    results = []
    for scale in (1.0, 2.5):
        cfg = PPOConfig(type="ppo", logprob_level="action", reward_scale=scale)
        results.append(make_learner(cfg, tiny_policy(seed=3), DataParallel(None, 0, 1), 7).advantages(batch, values))
    (adv1, ret1), (adv2, ret2) = results
    assert ret1.abs().sum() > 0  # with zero values GAE is linear in the rewards
    torch.testing.assert_close(ret2, 2.5 * ret1)
    torch.testing.assert_close(adv2, 2.5 * adv1)


@pytest.fixture(scope="module")
def grpo_batch():
    """Groups of 4 where the random policy's successes are rare: some groups all fail, one has a success (the
    seed is one whose rollouts have both; the test checks that first)."""
    return collate(rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=12, group_size=4, seed=0))


def test_grpo_defaults_are_the_papers_recipe(grpo_batch):
    cfg = GRPOConfig(type="grpo")
    assert (cfg.advantage, cfg.success_filter, cfg.clip) == ("episode", [0.1, 0.9], [0.2, 0.28])
    assert PPOConfig(type="ppo").clip == [0.2, 0.2]  # PPO keeps its symmetric clip
    learner = make_learner(replace(cfg, group_size=4), tiny_policy(seed=1), DataParallel(None, 0, 1), 0)
    adv, used, info = learner.advantages(grpo_batch)
    lay = episode_layout(grpo_batch, 4)
    rate = {int(g): float(lay.success[lay.usable & (lay.group == g)].float().mean()) for g in lay.group[lay.usable]}
    assert any(0 < r < 1 for r in rate.values()) and any(r in (0, 1) for r in rate.values()), rate  # the fixture's
    used_groups = {int(lay.group[lay.episode[r]]) for r in used.nonzero(as_tuple=True)[0]}
    assert used_groups and all(0.0 < rate[g] < 1.0 for g in used_groups)  # all-same groups are dropped
    assert any(rate[g] in (0.0, 1.0) for g in rate) and info["grpo/episodes_dropped"] > 0
    # the outcome advantage: one value per used segment (rows are episodes here)
    assert all(len(torch.unique(adv[i][used[i]])) == 1 for i in range(len(adv)) if used[i].any())


def test_grpo_reward_scale_leaves_normalised_advantages(grpo_batch):
    advs = []
    for scale in (1.0, 3.0):
        cfg = GRPOConfig(type="grpo", group_size=4, reward_scale=scale)
        advs.append(make_learner(cfg, tiny_policy(seed=1), DataParallel(None, 0, 1), 0).advantages(grpo_batch)[0])
    torch.testing.assert_close(advs[0], advs[1], rtol=1e-4, atol=1e-5)  # normalised within the group
