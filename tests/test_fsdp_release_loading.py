"""A release folder loaded straight into FSDP2 shards on 2 gloo ranks: built on the meta device, sharded, then each
rank reads only its rows of the safetensors; the gathered weights equal the plain loader's bit for bit, and the
ranks' reads partition the file (each about half, none a full copy). The fsdp trainer's own build
(`build_sharded_policy`: an OFT policy whose heads are real beside a meta VLA) equals the replicated trainer's
policy, without ever loading the VLA whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_helpers import start_ranks
from tiny_checkpoints import write_tiny_release

from vlaslurm.algos.sharding import full_state_dict, load_release_slices, local_numel, materialize_sharded, shard_policy
from vlaslurm.models import build_policy
from vlaslurm.models.prismatic.release import build_vla, load_pretrained, read_release_config, stored_tensors
from vlaslurm.models.vla import build as vla_build
from vlaslurm.runtime.sharded import build_sharded_policy
from vlaslurm.spec.model_types import OpenVLAOFTConfig
from vlaslurm.spec.trainer_types import TrainerSpec

WORLD = 2
DIMS = {"action_dim": 7, "state_dim": 8, "image_size": 224, "num_cameras": 2}
# (model.precision, trainer.mixed_precision): a bf16 release gets float32 master shards under bf16 compute
PRECISIONS = [("fp32", "fp32"), ("bf16", "bf16")]


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
    start_ranks(_rank, (str(tmp), str(release)), WORLD)
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


def oft_config(release: str, precision: str) -> OpenVLAOFTConfig:
    return OpenVLAOFTConfig(type="openvla-oft", path=release, action_chunk=8, precision=precision)  # type: ignore[arg-type]


def _trainer_rank(rank: int, tmp: str, release: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-trainer", rank=rank, world_size=WORLD)

    def no_whole_load(*args, **kwargs):
        raise AssertionError("the sharded trainer loaded the whole VLA")

    vla_build.load_weights = no_whole_load  # this spawned process only
    try:
        for precision, mixed in PRECISIONS:
            torch.manual_seed(0)  # as the trainer role seeds every rank
            trainer = TrainerSpec(strategy="fsdp", mixed_precision=mixed)  # type: ignore[arg-type]
            policy = build_sharded_policy(
                oft_config(release, precision), DIMS, trainer, dist.group.WORLD, torch.device("cpu")
            )
            full = full_state_dict(policy)
            if rank == 0:
                torch.save(full, f"{tmp}/policy-{precision}.pt")
            torch.save(local_numel(policy), f"{tmp}/numel-{precision}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trainer_built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-trainer-build")
    release = write_tiny_release(tmp / "release", oft=True)
    start_ranks(_trainer_rank, (str(tmp), str(release)), WORLD)
    return tmp, release


@pytest.mark.parametrize("precision", [p for p, _ in PRECISIONS])
def test_the_fsdp_trainer_builds_a_release_into_shards_as_a_replicated_trainer_builds_it(trainer_built, precision):
    tmp, release = trainer_built
    torch.manual_seed(0)  # the value head and the learned std are initialised here, not read from the release
    expected = build_policy(oft_config(str(release), precision), **DIMS).state_dict()
    full = torch.load(tmp / f"policy-{precision}.pt")
    assert set(full) == set(expected)
    for name, value in expected.items():
        # float32 masters under bf16 compute hold the bf16 release's values exactly
        assert torch.equal(full[name], value.to(full[name].dtype)), name
    assert any(name.startswith("value_head.") for name in full) and "log_std" in full  # the heads, made for real
    counts = [torch.load(tmp / f"numel-{precision}-{rank}.pt") for rank in range(WORLD)]
    total = sum(value.numel() for value in expected.values())
    assert all(count <= 0.55 * total for count in counts), (counts, total)  # each rank holds about half
