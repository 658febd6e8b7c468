"""FSDP2 groundwork (vlaslurm/algos/sharding.py): on 2 gloo ranks a sharded update leaves the same parameters as
one replicated rank on the same global batch, each rank holding about half of the parameters and of the optimizer
state. Real torch.distributed in spawned processes; not yet reachable from a spec (see the module)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from learner_helpers import algo_config, rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.algos.sharding import ShardedDataParallel, full_state_dict, local_numel, shard_policy
from vlaslurm.spec.trainer_types import TrainerSpec

WORLD = 2
CASES = [("ppo", "action", None), ("grpo", "token", 3)]


def _rank(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        batch = torch.load(f"{tmp}/batch.pt", weights_only=False)
        for kind, level, micro in CASES:
            policy = shard_policy(tiny_policy(seed=3), dist.group.WORLD)
            dp = ShardedDataParallel(dist.group.WORLD, rank, WORLD)
            learner = make_learner(algo_config(kind, level), policy, dp, 7, TrainerSpec(micro_batch_size=micro))
            learner.update(batch, version=5)
            opt_local = sum(
                (v.to_local() if hasattr(v, "to_local") else v).numel()
                for state in learner.opt.state.values()
                for v in state.values()
                if torch.is_tensor(v) and v.ndim > 0
            )
            full = full_state_dict(policy)
            if rank == 0:
                torch.save(full, f"{tmp}/params-{kind}-{level}.pt")
            torch.save({"params": local_numel(policy), "optim": opt_local}, f"{tmp}/sizes-{kind}-{level}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def batch():
    segments = rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, group_size=4, version_every=3)
    return collate(segments)


@pytest.fixture(scope="module")
def ranked(tmp_path_factory, batch) -> Path:
    tmp = tmp_path_factory.mktemp("fsdp")
    torch.save(batch, tmp / "batch.pt")
    mp.start_processes(_rank, args=(str(tmp),), nprocs=WORLD, start_method="spawn", join=True)
    return tmp


@pytest.mark.parametrize("kind,level,micro", CASES)
def test_sharded_update_equals_one_replicated_rank(ranked: Path, batch, kind: str, level: str, micro: Optional[int]):
    policy = tiny_policy(seed=3)
    make_learner(algo_config(kind, level), policy, DataParallel(None, 0, 1), 7).update(batch, version=5)
    single = policy.state_dict()
    sharded = torch.load(ranked / f"params-{kind}-{level}.pt")
    assert set(sharded) == set(single)
    for name, value in single.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("kind,level,micro", CASES)
def test_each_rank_holds_about_half(ranked: Path, kind: str, level: str, micro: Optional[int]):
    total = sum(p.numel() for p in tiny_policy(seed=3).parameters())
    sizes = [torch.load(ranked / f"sizes-{kind}-{level}-{rank}.pt") for rank in range(WORLD)]
    assert sum(s["params"] for s in sizes) == total  # the shards partition the parameters
    for s in sizes:
        assert s["params"] <= 0.55 * total  # dim-0 shards of uneven sizes: about 1/2 each
        # Adam's two moments, of this rank's shards only (GRPO never steps the unused value head: no state for it)
        assert 1.9 * s["params"] <= s["optim"] <= 2 * s["params"]
