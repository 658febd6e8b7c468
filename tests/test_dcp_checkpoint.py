"""Sharded checkpoints (torch.distributed.checkpoint) of an fsdp trainer: saved on 2 gloo ranks, resumed on 1 and
on 4 with the same parameters and optimizer state; every rank's shards are in the manifest, and a checkpoint with a
missing shard is refused in favour of the previous complete one. One spawn of 4 real processes: the 2-rank save and
the 1-rank resume run on sub-groups of the same world. About 25 s on 2 busy cores."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from learner_helpers import algo_config, rollout_segments, tiny_policy
from process_helpers import start_ranks

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import make_learner
from vlaslurm.algos.sharding import ShardedDataParallel, shard_policy
from vlaslurm.rundir import layout
from vlaslurm.runtime import checkpoint as ckpt

WORLD = 4


def _full(policy, optimizer):
    """Parameters and optimizer state in full (a collective), keyed by parameter names: comparable across N."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True))


def _learner(group, seed: int):
    policy = shard_policy(tiny_policy(seed=seed), group=group)
    size = dist.get_world_size(group)
    learner = make_learner(
        algo_config("grpo", "token"), policy, ShardedDataParallel(group, dist.get_rank(group), size), 7
    )
    return policy, learner


def _save_on_two(tmp: str, run: Path, group) -> None:
    batch = torch.load(f"{tmp}/batch.pt", weights_only=False)
    policy, learner = _learner(group, seed=3)
    for version in (1, 2):
        learner.update(batch, version=version)
        folder = ckpt.fresh_tmp(run, version) if dist.get_rank(group) == 0 else None
        name = [str(folder)]
        dist.broadcast_object_list(name, src=0, group=group)  # the test's own plumbing (the runtime's Command)
        state = ckpt.TrainerState(version=version) if dist.get_rank(group) == 0 else None
        if state is not None:
            Path(name[0]).mkdir(mode=0o700)
        dist.barrier(group=group)
        ckpt.save_sharded(run, Path(name[0]), state, policy, learner.opt, [], 3, group)
    model, optim = _full(policy, learner.opt)
    if dist.get_rank(group) == 0:
        torch.save({"model": model, "optim": optim}, f"{tmp}/saved.pt")


def _resume(tmp: str, run: Path, group, size: int) -> None:
    # The run's seed (the frozen embeddings come from it, as in a resumed run), every trained parameter moved: the
    # load must overwrite them all.
    policy, learner = _learner(group, seed=3)
    with torch.no_grad():
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(1.0)
    path = ckpt.resume_point(run, record=False, required=ckpt.SHARDED_REQUIRED)
    assert path is not None
    state = ckpt.load_sharded(path, policy, learner.opt, group)
    model, optim = _full(policy, learner.opt)
    if dist.get_rank(group) == 0:
        torch.save({"version": state.version, "model": model, "optim": optim}, f"{tmp}/resumed-{size}.pt")


def _rank(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    run = Path(tmp) / "run"
    try:
        two = dist.new_group([0, 1], use_local_synchronization=False)
        one = dist.new_group([0], use_local_synchronization=False)
        if rank < 2:
            _save_on_two(tmp, run, two)
        dist.barrier()
        if rank == 0:
            _resume(tmp, run, one, 1)
        dist.barrier()
        _resume(tmp, run, dist.group.WORLD, 4)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranked(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dcp")
    (tmp / "run").mkdir()
    segments = rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, group_size=4, version_every=3)
    torch.save(collate(segments), tmp / "batch.pt")
    start_ranks(_rank, (str(tmp),), WORLD)
    return tmp


def _assert_same(a, b) -> None:
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], dict):
            _assert_same(a[key], b[key])
        elif torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("size", [1, 4])
def test_resume_on_another_rank_count_restores_parameters_and_optimizer(ranked: Path, size: int):
    saved = torch.load(ranked / "saved.pt", weights_only=False)
    resumed = torch.load(ranked / f"resumed-{size}.pt", weights_only=False)
    assert resumed["version"] == 2
    _assert_same(saved["model"], resumed["model"])
    assert saved["optim"]["state"], "the optimizer had state to restore"
    _assert_same(saved["optim"]["state"], resumed["optim"]["state"])
    assert [g["lr"] for g in saved["optim"]["param_groups"]] == [g["lr"] for g in resumed["optim"]["param_groups"]]


def test_every_rank_s_shards_are_in_the_manifest(ranked: Path):
    folder = ranked / "run" / "checkpoints" / "v00000002"
    listed = {entry.path for entry in ckpt.verify(folder, ckpt.SHARDED_REQUIRED)}
    assert {"__0_0.distcp", "__1_0.distcp", ckpt.DCP_METADATA, layout.CKPT_STATE, layout.CKPT_RNG} <= listed
    assert ckpt.is_sharded(folder)


def test_a_missing_shard_is_refused_and_the_previous_checkpoint_used(ranked: Path, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(ranked / "run", run)
    (run / "checkpoints" / "v00000002" / "__1_0.distcp").unlink()
    point = ckpt.latest_verified(run, ckpt.SHARDED_REQUIRED)
    assert point.path is not None and point.path.name == "v00000001"
    assert "__1_0.distcp" in point.skipped["v00000002"] and "missing" in point.skipped["v00000002"]


def test_a_resume_with_the_other_strategy_says_which_to_set(ranked: Path):
    ckpt.check_sharding(ranked / "run", sharded=True)
    with pytest.raises(ckpt.CheckpointError, match="trainer.strategy: fsdp"):
        ckpt.check_sharding(ranked / "run", sharded=False)
