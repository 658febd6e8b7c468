"""`algo.value_level: action`: a value per executed action of a chunk (the policies' slot values), action-level
GAE, and a value loss per action; plan refuses it with one ratio per chunk."""

from __future__ import annotations

import pytest
import torch
from learner_helpers import rollout_segments, tiny_policy

from vlaslurm.algos.batch import TrainBatch, collate
from vlaslurm.algos.learners import DataParallel, PPOLearner, make_learner
from vlaslurm.spec.algo_types import PPOConfig


def hand_batch() -> TrainBatch:
    """One segment of 2 decision steps x 2 actions; the episode terminates after the third action."""
    mask = torch.tensor([[[True, True], [True, False]]])
    tensors = {
        "rewards": torch.tensor([[[1.0, 0.0], [2.0, 0.0]]]),
        "mask": mask,
        "step_valid": torch.tensor([[True, True]]),
        "length": torch.tensor([2]),
        "terminated": torch.tensor([True]),
        "truncated": torch.tensor([False]),
    }
    return TrainBatch(tensors, ["x"])


def test_action_level_advantages_by_hand():
    gamma, lam = 0.9, 0.8
    cfg = PPOConfig(type="ppo", value_level="action", logprob_level="action", gamma=gamma, gae_lambda=lam)
    learner = PPOLearner(cfg, tiny_policy(), DataParallel(None, 0, 1), seed=0)
    values = torch.tensor([[[0.5, 1.5], [2.5, 9.0], [7.0, 7.0]]])  # [N, T+1, C]; 9.0 is a padded slot
    adv, ret = learner.advantages(hand_batch(), values)
    # the executed actions in order: values 0.5, 1.5, 2.5; rewards 1, 0, 2; terminal after the third
    v, r = [0.5, 1.5, 2.5], [1.0, 0.0, 2.0]
    delta = [r[0] + gamma * v[1] - v[0], r[1] + gamma * v[2] - v[1], r[2] - v[2]]
    a2 = delta[2]
    a1 = delta[1] + gamma * lam * a2
    a0 = delta[0] + gamma * lam * a1
    torch.testing.assert_close(adv[0, 0], torch.tensor([a0, a1]))
    torch.testing.assert_close(adv[0, 1, 0], torch.tensor(a2))
    assert adv[0, 1, 1] == 0.0  # the padded action has none
    torch.testing.assert_close(ret[0, 0], torch.tensor([a0 + 0.5, a1 + 1.5]))


@pytest.mark.parametrize("level", ["action", "token"])
def test_ppo_updates_with_a_value_per_action(level):
    batch = collate(rollout_segments(tiny_policy(seed=1), num_envs=4, chunks=4))
    policy = tiny_policy(seed=3)
    cfg = PPOConfig(type="ppo", lr=1e-3, epochs=1, minibatches=2, value_level="action", logprob_level=level)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    stats = make_learner(cfg, policy, DataParallel(None, 0, 1), 7).update(batch, version=1)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert stats["losses/value_loss"] > 0
    assert not torch.equal(before["value_head.weight"], policy.state_dict()["value_head.weight"])


def test_a_chunk_ratio_cannot_take_action_advantages():
    cfg = PPOConfig(type="ppo", value_level="action", logprob_level="chunk")
    with pytest.raises(ValueError, match="logprob_level action"):
        PPOLearner(cfg, tiny_policy(), DataParallel(None, 0, 1), seed=0)
