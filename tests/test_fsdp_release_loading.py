"""A release folder loaded straight into FSDP2 shards on 2 gloo ranks: built on the meta device, sharded, then each
rank reads only its rows of the safetensors; the gathered weights equal the plain loader's bit for bit, and the
ranks' reads partition the file (each about half, none a full copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_checkpoints import write_tiny_release

from vlaslurm.algos.sharding import full_state_dict, load_release_slices, materialize_sharded, shard_policy
from vlaslurm.models.prismatic.release import build_vla, load_pretrained, read_release_config, stored_tensors

WORLD = 2


def _rank(rank: int, tmp: str, release: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        vla = build_vla(read_release_config(Path(release) / "config.json"), device="meta")
        shard_policy(vla, dist.group.WORLD)
        materialize_sharded(vla, torch.device("cpu"))
        read = load_release_slices(vla, release, torch.float32)
        full = full_state_dict(vla)
        if rank == 0:
            torch.save(full, f"{tmp}/full.pt")
        torch.save(read, f"{tmp}/read-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-load")
    release = write_tiny_release(tmp / "release")
    mp.start_processes(_rank, args=(str(tmp), str(release)), nprocs=WORLD, start_method="spawn", join=True)
    return tmp, release


def test_sharded_loading_equals_the_plain_loader(loaded):
    tmp, release = loaded
    reference = load_pretrained(release).model
    full = torch.load(tmp / "full.pt")
    expected = reference.state_dict()
    assert set(full) == set(expected)
    for name, value in expected.items():
        assert torch.equal(full[name], value), name
    # the rotary frequencies survive the meta build and the allocation of the shards
    for name, buffer in reference.named_buffers():
        assert torch.equal(full.get(name, buffer), buffer), name


def test_each_rank_reads_only_its_rows(loaded):
    tmp, release = loaded
    total = 0
    for entry in stored_tensors(release).values():
        total += int(torch.tensor(entry.shape).prod()) * 4  # float32 in the tiny release
    reads = [torch.load(tmp / f"read-{rank}.pt") for rank in range(WORLD)]
    assert sum(reads) == total  # the ranks' rows partition every tensor
    assert all(r <= 0.55 * total for r in reads)  # dim-0 shards: about half each, never the whole file
