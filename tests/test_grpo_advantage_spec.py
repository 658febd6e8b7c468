"""`algo.advantage` of a GRPO spec reaches the learner: episode-level advantages are one value per
episode, chunk-level ones vary along it."""

from __future__ import annotations

import torch
from learner_helpers import rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.spec.algo_types import GRPOConfig


def advantages(kind: str):
    # rollouts with a group that has a success (the default success filter drops groups that all fail)
    batch = collate(rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=12, group_size=4, seed=0))
    cfg = GRPOConfig(type="grpo", group_size=4, advantage=kind)
    learner = make_learner(cfg, tiny_policy(seed=1), DataParallel(None, 0, 1), seed=0)
    adv, used, _ = learner.advantages(batch)
    return adv, used


def distinct_per_row(adv: torch.Tensor, used: torch.Tensor) -> int:
    """The most distinct advantage values any one segment carries over its used steps."""
    return max(len(torch.unique(adv[i][used[i]])) for i in range(len(adv)))


def test_spec_advantage_reaches_the_learner():
    episode_adv, episode_used = advantages("episode")
    chunk_adv, chunk_used = advantages("chunk")
    assert episode_used.any() and torch.equal(episode_used, chunk_used)
    assert distinct_per_row(episode_adv, episode_used) == 1  # one value per episode (rows are episodes here)
    assert distinct_per_row(chunk_adv, chunk_used) > 1
