"""The spec's `trainer:` section: micro-batches accumulate to the same update, the optimizer takes its settings,
and the value head its own learning rate."""

from __future__ import annotations

import pytest
import torch
from learner_helpers import algo_config, assert_same_update, rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.spec.trainer_types import OptimizerConfig, TrainerSpec


@pytest.fixture(scope="module")
def batch():
    segments = rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, group_size=4, version_every=3)
    return collate(segments)


def updated(kind: str, level: str, batch, trainer: TrainerSpec) -> dict:
    policy = tiny_policy(seed=3)
    cfg = algo_config(kind, level, minibatches=2)
    stats = make_learner(cfg, policy, DataParallel(None, 0, 1), 7, trainer).update(batch, version=2)
    return {"params": {k: v.detach().clone() for k, v in policy.state_dict().items()}, "stats": stats}


@pytest.mark.parametrize("kind,level", [("ppo", "chunk"), ("ppo", "token"), ("grpo", "action")])
def test_micro_batches_make_the_same_update(batch, kind, level):
    whole = updated(kind, level, batch, TrainerSpec())
    micro = updated(kind, level, batch, TrainerSpec(micro_batch_size=5))
    before = tiny_policy(seed=3).state_dict()
    assert sum(not torch.equal(before[k], whole["params"][k]) for k in before) > len(before) // 2
    assert_same_update(micro["params"], whole["params"])
    for key in ("losses/entropy", "losses/approx_kl"):
        assert micro["stats"][key] == pytest.approx(whole["stats"][key], rel=1e-3, abs=1e-6)


def test_the_optimizer_takes_the_trainer_settings(batch):
    settings = OptimizerConfig(weight_decay=0.01, betas=[0.8, 0.95], eps=1e-6, value_lr=1e-12)
    policy = tiny_policy(seed=3)
    cfg = algo_config("ppo", "chunk", minibatches=2)
    learner = make_learner(cfg, policy, DataParallel(None, 0, 1), 7, TrainerSpec(optimizer=settings))
    groups = learner.opt.param_groups
    assert [g["lr"] for g in groups] == [1e-3, 1e-12]
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 and g["weight_decay"] == 0.01 for g in groups)
    value_before = policy.value_head.weight.detach().clone()
    learner.update(batch, version=2)
    # a vanishing value_lr leaves the critic (almost) where it was while the rest moved
    torch.testing.assert_close(policy.value_head.weight, value_before, atol=1e-9, rtol=0)
    head = "action_head.model.fc2.weight"
    assert not torch.equal(policy.state_dict()[head], tiny_policy(seed=3).state_dict()[head])
