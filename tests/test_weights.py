"""Weight sync: broadcast over a real gloo group and atomic files, checked bit for bit."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from process_helpers import forkserver, run_ranks

from vlaslurm.runtime.weights import (
    FilesystemPublisher,
    FilesystemSubscriber,
    WeightSyncError,
    WeightSyncTimeout,
    make_publisher,
    make_subscriber,
    manifest_of,
    plan_buckets,
    wait_for_version,
)

EXPECTED = {"trainer": 1, "generator": 2}
KEYS = [("trainer", 0), ("generator", 0), ("generator", 1)]
BIG = 1_500_000  # floats per file in the filesystem test: big enough that a torn write would be seen


def make_state(version: int, big: int = 3000) -> dict[str, torch.Tensor]:
    """A state dict whose every bit depends on `version` (NaN and -0.0 included)."""
    g = torch.Generator().manual_seed(version)
    weight = torch.randn(17, 5, generator=g)
    weight[0, 0], weight[0, 1] = float("nan"), -0.0
    return {
        "layer.weight": weight,
        "layer.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 4, generator=g).half(),
        "big": torch.randn(big, generator=g),  # larger than the test bucket: a bucket of its own
        "steps": torch.randint(0, 10**12, (4,), generator=g),
        "mask": torch.rand(6, generator=g) > 0.5,
        "scale": torch.tensor(float(version)),
        "empty": torch.zeros(0, 3),
        "double": torch.randn(2, generator=g).double(),
    }


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    if list(got) != list(want):
        return False
    return all(
        g.dtype == w.dtype
        and g.shape == w.shape
        and torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
        for g, w in ((got[k], want[k]) for k in want)
    )


# --------------------------------------------------------------------------- plan


def test_buckets_group_by_dtype_and_respect_the_size() -> None:
    manifest = manifest_of(make_state(1))
    buckets = plan_buckets(manifest, bucket_bytes=400)
    assert [b.names for b in buckets] == [
        ("layer.weight",),
        ("big",),
        ("scale", "empty"),
        ("layer.bias",),
        ("half",),
        ("steps",),
        ("mask",),
        ("double",),
    ]
    assert all(len({b.dtype}) == 1 for b in buckets)
    assert sum(len(b.names) for b in buckets) == len(manifest)
    assert [b.names for b in plan_buckets(manifest, 1 << 20)][0] == ("layer.weight", "big", "scale", "empty")
    with pytest.raises(ValueError, match="complex64"):
        manifest_of({"z": torch.zeros(2, dtype=torch.complex64)})


def test_factories_validate_the_method() -> None:
    with pytest.raises(ValueError, match=re.escape("must be one of ['nccl', 'filesystem']")):
        make_publisher("rsync", run_dir="/nonexistent")
    with pytest.raises(ValueError, match="needs the distributed world"):
        make_subscriber("nccl", run_dir="/nonexistent")


# --------------------------------------------------------------------------- broadcast


def _broadcast_rank(run_dir: str, role: str, rank: int) -> dict[str, Any]:
    from vlaslurm.runtime.dist import host_store, init_world, store_ports
    from vlaslurm.runtime.rendezvous import Member, Rendezvous

    rdzv = Rendezvous(Path(run_dir) / "rdzv", EXPECTED)
    store = host_store("127.0.0.1", 30) if role == "trainer" else None
    rdzv.join(Member(role, rank, host="h", address="127.0.0.1", ports=store_ports(store), pid=os.getpid()))
    world = init_world(rdzv.wait(30), (role, rank), "gloo", 30, store=store, secret=bytes(32))
    try:
        if role == "trainer":
            return _trainer(run_dir, world)
        return _generator(run_dir, world, rank)
    finally:
        world.close()


def _trainer(run_dir: str, world: Any) -> dict[str, Any]:
    from vlaslurm.runtime.dist import world_barrier

    pub = make_publisher("nccl", run_dir=run_dir, world=world, timeout_s=20, bucket_bytes=400)
    for version in (1, 2):
        pub.publish(version, make_state(version))
    with pytest.raises(ValueError, match="must increase"):
        pub.publish(2, make_state(2))
    try:
        pub.publish(3, make_state(3), timeout_s=1.0)  # generator[1] stops polling after v2
        error = ""
    except WeightSyncTimeout as err:
        error = str(err)
    world_barrier()
    return {"error": error}


def _generator(run_dir: str, world: Any, rank: int) -> dict[str, Any]:
    from vlaslurm.runtime.dist import world_barrier

    sub = make_subscriber("nccl", run_dir=run_dir, world=world, timeout_s=20)
    seen, exact = [], []
    deadline = time.monotonic() + 20
    while sub.version < 2 and time.monotonic() < deadline:
        got = sub.poll()
        if got is not None:
            seen.append(got[0])
            exact.append(same_bits(got[1], make_state(got[0])))
        time.sleep(0.005 * (rank + 1))  # "serving a batch"; the two generators run at different speeds
    error = ""
    if rank == 0:
        try:
            wait_for_version(sub, 3, timeout_s=10)
        except WeightSyncError as err:
            error = str(err)
    world_barrier()
    return {"seen": seen, "exact": exact, "error": error}


def test_broadcast_delivers_exact_versions_and_names_a_missing_generator(tmp_path: Path) -> None:
    trainer, gen0, gen1 = run_ranks(_broadcast_rank, args=[(str(tmp_path), role, rank) for role, rank in KEYS])
    for gen in (gen0, gen1):
        assert gen["seen"] == [1, 2]  # lock-step: no generator skips a broadcast round
        assert gen["exact"] == [True, True]
    assert "weight broadcast v3: generator[1] (global ranks [2]) did not join within 1 s" in trainer["error"]
    assert "aborted weight broadcast v3" in gen0["error"]


# --------------------------------------------------------------------------- filesystem


def fs_state(version: int) -> dict[str, torch.Tensor]:
    """make_state plus a large tensor that is cheap to check, and a tied (shared-storage) weight."""
    state = make_state(version)
    state["tied"] = state["layer.weight"]  # shared storage, as with tied embeddings
    state["big"] = torch.full((BIG,), float(version))
    return state


def _write_versions(directory: str, count: int) -> int:
    pub = FilesystemPublisher(directory, keep=2)
    for version in range(1, count + 1):
        pub.publish(version, fs_state(version))
    return pub.version


def test_filesystem_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    directory = tmp_path / "weights dir"
    directory.mkdir()
    ctx = forkserver()
    count = 12
    writer = ctx.Process(target=_write_versions, args=(str(directory), count))
    writer.start()
    sub = FilesystemSubscriber(directory, check_interval_s=0.0)
    seen, files_checked = [], 0
    deadline = time.monotonic() + 30
    try:
        while sub.version < count and time.monotonic() < deadline:
            got = sub.poll()
            if got is not None:
                assert same_bits(got[1], fs_state(got[0])), f"v{got[0]} differs"
                seen.append(got[0])
            files_checked += _check_every_visible_file(directory)
    finally:
        writer.join(10)
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == 0
    assert seen and seen[-1] == count and seen == sorted(set(seen))
    assert files_checked > 0
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "v00000011.safetensors", "v00000012.safetensors"]


def _check_every_visible_file(directory: Path) -> int:
    """Open every final-named weights file; a torn one fails to parse or holds the wrong values."""
    from vlaslurm.runtime.weights import _open_safetensors

    checked = 0
    for path in directory.glob("v*.safetensors"):
        try:
            with _open_safetensors(path, torch.device("cpu")) as f:
                version = float(f.metadata()["version"])
                big = f.get_tensor("big")
        except FileNotFoundError:
            continue  # pruned between listing and opening
        assert big.shape == (BIG,) and bool((big == version).all()), f"{path.name} is torn"
        checked += 1
    return checked


def test_filesystem_final_name_appears_only_when_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is written under another name and renamed: the final name never holds a partial file."""
    import vlaslurm.runtime.weights as weights

    written: list[str] = []
    real_save = weights.save_file

    def spy(tensors: dict, filename: str, metadata: dict) -> None:
        written.append(filename)
        assert not (tmp_path / "v00000007.safetensors").exists()
        real_save(tensors, filename, metadata=metadata)
        assert not (tmp_path / "v00000007.safetensors").exists()

    monkeypatch.setattr(weights, "save_file", spy)
    FilesystemPublisher(tmp_path).publish(7, make_state(7))
    assert len(written) == 1 and Path(written[0]).name != "v00000007.safetensors"
    assert (tmp_path / "v00000007.safetensors").exists() and not Path(written[0]).exists()


def test_filesystem_poll_is_rate_limited_and_versions_increase(tmp_path: Path) -> None:
    pub = FilesystemPublisher(tmp_path)
    sub = FilesystemSubscriber(tmp_path, check_interval_s=60)
    assert sub.poll() is None  # nothing published; the next look is a minute away
    pub.publish(0, make_state(0))
    assert sub.poll() is None
    assert FilesystemSubscriber(tmp_path).poll()[0] == 0
    with pytest.raises(ValueError, match="must increase"):
        pub.publish(0, make_state(0))
    with pytest.raises(ValueError, match="keep must be >= 2"):
        FilesystemPublisher(tmp_path, keep=1)
