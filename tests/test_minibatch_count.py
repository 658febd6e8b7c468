"""`algo.minibatches` counts per `steps_per_update` env steps: a batch larger than that (async GRPO takes whole
groups, and every group the next update could no longer use) is split into proportionally more minibatches, so
that async makes as many optimizer steps per sample as sync (issue 17)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from learner_helpers import algo_config, rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner, minibatch_count, used_env_steps


def test_the_count_grows_with_the_batch_and_never_falls_below_the_setting() -> None:
    cfg = replace(algo_config("grpo", "action", minibatches=4), steps_per_update=2048)
    assert minibatch_count(cfg, 1900) == 4  # sync: partial episodes left out, a batch a little short
    assert minibatch_count(cfg, 2048) == 4
    assert minibatch_count(cfg, 4300) == 8  # async's batch when a version served two batches' worth
    assert minibatch_count(cfg, 3000) == 6


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_an_update_takes_an_optimizer_step_per_minibatch_of_that_count(kind: str) -> None:
    """One batch, learners whose `steps_per_update` is all the env steps they use and a quarter of them: the
    second takes four times the optimizer steps (counted at the optimizer): epochs x 2, then epochs x 8."""
    group = 4 if kind == "grpo" else 1
    batch = collate(rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=12, group_size=group, seed=0))
    t = batch.tensors
    probe = make_learner(algo_config(kind, "action"), tiny_policy(seed=1), DataParallel(None, 0, 1), 0)
    used = probe.advantages(batch)[1] if kind == "grpo" else t["step_valid"]  # GRPO: complete episodes only
    steps = used_env_steps(t, used)
    counts = []
    for spu in (steps, steps // 4):
        cfg = replace(algo_config(kind, "action", minibatches=2), steps_per_update=spu)
        learner = make_learner(cfg, tiny_policy(seed=1), DataParallel(None, 0, 1), 0)
        counts.append(0)
        learner.opt.register_step_post_hook(lambda *_: counts.__setitem__(-1, counts[-1] + 1))
        learner.update(batch, 0)
    epochs = algo_config(kind, "action").epochs
    if kind == "grpo":
        assert 0 < steps < int(t["mask"].sum())  # the episodes still running at the end are left out
    assert counts == [epochs * 2, epochs * 8]
