"""Trainer scale-out: rank 0 shares a batch with the trainer's own `share_batch` (each of 2 gloo ranks, real
torch.distributed in spawned processes, receives the observations of the rows it owns only); one update on the 2
ranks then leaves the same parameters as one rank on the whole batch; the values and proximal log-probs before it
are computed once over the ranks (each the observations of its rows), not by every rank."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from learner_helpers import algo_config, assert_same_update, rollout_segments, tiny_policy
from process_helpers import start_ranks

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, evaluate_all, make_learner
from vlaslurm.runtime.roles.trainer import share_batch
from vlaslurm.spec.trainer_types import OptimizerConfig, TrainerSpec

WORLD = 2


def one_update(
    kind: str, level: str, batch, dp: DataParallel, micro: Optional[int] = None, progress: Optional[float] = None
) -> dict:
    """The parameters after one update; with `progress`, of a scheduled-std policy whose progress only rank 0
    sets (as the trainer does: the learner must hand it to the other ranks), stepped with Adam's eps far above the
    gradients' elements (`SCHEDULED_TRAINER`)."""
    torch.set_num_threads(1)
    policy = tiny_policy(seed=3, std="learned" if progress is None else "scheduled")
    if progress is not None and dp.rank == 0:
        policy.set_std_progress(progress)
    trainer = TrainerSpec(micro_batch_size=micro) if progress is None else SCHEDULED_TRAINER
    learner = make_learner(algo_config(kind, level), policy, dp, seed=7, trainer=trainer)
    learner.update(batch, version=5)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


# (algo, logprob level, trainer.micro_batch_size): a rank's share of a minibatch in micro-batches of 4 too
CASES = [
    ("ppo", "action", None),
    ("ppo", "chunk", None),
    ("ppo", "token", 4),
    ("grpo", "action", None),
    ("grpo", "token", 4),
]

SCHEDULED = ["ppo", "grpo"]  # a scheduled std part-way (PROGRESS) through the run, set on rank 0 only
PROGRESS = 0.6
# With the default eps Adam divides each gradient element by its own size, so the few elements near zero turn the
# ranks' other summation order into steps of either sign (30 of 9216 conv weights off by 3e-5 on one machine, where
# the same test passed on others): eps 1 makes the step about -lr * gradient, compared relative to its size below.
SCHEDULED_TRAINER = TrainerSpec(optimizer=OptimizerConfig(eps=1.0))


def _rank(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        dp = DataParallel(dist.group.WORLD, rank, WORLD)
        whole = torch.load(f"{tmp}/batch.pt", weights_only=False) if rank == 0 else None
        version, batch = share_batch(whole, 5, dp, src=0)
        assert version == 5 and batch is not None
        torch.save({"held": batch.held, "images": batch.tensors["images"]}, f"{tmp}/shared-{rank}.pt")
        for kind, level, micro in CASES:  # one spawn for every case: starting processes is the slow part
            params = one_update(kind, level, batch, dp, micro)
            torch.save(params, f"{tmp}/params-{kind}-{level}-{micro}-{rank}.pt")
        for kind in SCHEDULED:
            params = one_update(kind, "action", batch, dp, progress=PROGRESS)
            torch.save(params, f"{tmp}/params-{kind}-scheduled-{rank}.pt")
        torch.save(counted_evaluation(batch, dp), f"{tmp}/evaluated-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def batch():
    # Episodes in pieces (a version change every 3 chunks), partial last chunks, groups of 4.
    segments = rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, group_size=4, version_every=3)
    return collate(segments)


@pytest.fixture(scope="module")
def ranked(tmp_path_factory, batch) -> Path:
    """The parameters each of 2 gloo ranks holds after the update, for every case."""
    tmp = tmp_path_factory.mktemp("dp")
    torch.save(batch, tmp / "batch.pt")
    start_ranks(_rank, (str(tmp),), WORLD)
    return tmp


def test_each_rank_receives_the_observations_of_its_own_rows_only(ranked: Path, batch):
    shared = [torch.load(ranked / f"shared-{rank}.pt") for rank in range(WORLD)]
    held = torch.cat([s["held"] for s in shared])
    assert sorted(held.tolist()) == list(range(batch.size)), "every row's observations on exactly one rank"
    for s in shared:
        assert 0 < len(s["held"]) < batch.size
        assert torch.equal(s["images"], batch.tensors["images"][s["held"]])


@pytest.mark.parametrize("kind,level,micro", CASES)
def test_two_ranks_equal_one_rank(ranked: Path, batch, kind: str, level: str, micro: Optional[int]):
    single = one_update(kind, level, batch, DataParallel(None, 0, 1))  # one rank, the minibatch at once
    before = tiny_policy(seed=3).state_dict()
    moved = sum(int(not torch.equal(before[k], single[k])) for k in single)
    assert moved > len(single) // 2, "the update should change most parameters"
    for rank in range(WORLD):
        params = torch.load(ranked / f"params-{kind}-{level}-{micro}-{rank}.pt")
        assert_same_update(params, single, f"rank {rank}")


@pytest.mark.parametrize("kind", SCHEDULED)
def test_every_rank_evaluates_rank_0s_scheduled_std(ranked: Path, batch, kind: str):
    single = one_update(kind, "action", batch, DataParallel(None, 0, 1), progress=PROGRESS)
    assert float(single["std_progress"]) == pytest.approx(PROGRESS)
    before = tiny_policy(seed=3, std="scheduled").state_dict()
    steps = {name: value - before[name] for name, value in single.items() if value.is_floating_point()}
    assert sum(int(step.abs().max() > 0) for step in steps.values()) > len(steps) // 2, "most parameters move"
    for rank in range(WORLD):
        params = torch.load(ranked / f"params-{kind}-scheduled-{rank}.pt")
        for name, step in steps.items():
            # each rank's step equals one rank's to 2% of its largest element: the float32 parameters round the
            # smallest steps (~1e-6) to 0.2% here; the initial std on rank 1 (no buffer sync) made 46-100% of it
            tolerance = 2e-2 * float(step.abs().max()) + 1e-12
            torch.testing.assert_close(params[name] - before[name], step, rtol=0, atol=tolerance, msg=name)


CHUNK = 16  # observations per forward of the shared evaluation


def counted_evaluation(batch, dp: DataParallel) -> tuple:
    """(values, proximal log-probs per token, observations this rank evaluated) of the tiny policy."""
    torch.set_num_threads(1)
    policy = tiny_policy(seed=3)
    evaluated = []
    evaluate = policy.evaluate
    policy.evaluate = lambda inp, actions: (evaluated.append(len(actions)), evaluate(inp, actions))[1]
    values, prox = evaluate_all(policy, batch, True, dp, chunk=CHUNK, tokens=True)
    return values, prox, sum(evaluated)


def test_the_ranks_share_the_evaluation_before_an_update(ranked: Path, batch):
    values, prox, total = counted_evaluation(batch, DataParallel(None, 0, 1))
    assert (values != 0).any() and (prox != 0).any()
    for rank in range(WORLD):
        ranked_values, ranked_prox, evaluated = torch.load(ranked / f"evaluated-{rank}.pt")
        # another batch composition of the same rows: equal up to float32 rounding
        torch.testing.assert_close(ranked_values, values, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranked_prox, prox, rtol=1e-5, atol=1e-6)
        # each evaluates the observations of the rows it owns (T+1 per row), in chunks of 16, as many chunks as
        # the rank with the most (a short rank repeats one): none evaluates all of them
        owned = DataParallel(None, rank, WORLD).held_rows(batch.tensors["length"])
        own = int((batch.tensors["length"][owned] + 1).sum())
        assert own <= evaluated < total and evaluated - own < CHUNK * math.ceil(total / CHUNK), (evaluated, own, total)
