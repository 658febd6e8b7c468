"""Versioned weights from trainer[0] to every generator rank.

Two backends behind one API (`make_publisher` / `make_subscriber`), chosen by
``rollout.weight_sync``: ``filesystem`` (atomic safetensors files and a ``latest`` pointer; the
trainer never waits) and ``nccl`` (bucketed broadcasts after a handshake through the TCPStore,
with a timeout that names the missing generators). `publish` takes full (unsharded) tensors.
Details and usage: docs/runtime.md
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, cast

import msgpack
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from vlaslurm.rundir import RunDir, write_atomic
from vlaslurm.runtime.dist import World, new_subgroup

log = logging.getLogger("vlaslurm.weights")

WEIGHT_SYNCS = ("nccl", "filesystem")
LATEST = "latest"
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
_READY_SLICE_S = 1.0  # the publisher's wait for ready generators looks at `stopped` this often
_FILE_RE = re.compile(r"v(\d{8,})\.safetensors")
_MAGIC = 0x564C4157  # "VLAW"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

StateDict = dict[str, torch.Tensor]


class WeightSyncError(RuntimeError):
    """Weight sync failed (an aborted round, an inconsistent header, a bad file)."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """Generators did not join a broadcast in time; the message names them."""


class WeightPublisher(Protocol):
    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None: ...
    def close(self) -> None: ...


class WeightSubscriber(Protocol):
    version: int
    """Newest version received so far (-1 before the first)."""

    def poll(self) -> tuple[int, StateDict] | None: ...
    def close(self) -> None: ...


def weights_dir(run_dir: str | os.PathLike[str]) -> Path:
    return RunDir(run_dir).weights


def _check_version(version: int, last: int) -> None:
    if version <= last:
        raise ValueError(f"weight versions must increase: publishing {version} after {last}")


def wait_for_version(
    sub: WeightSubscriber, version: int, timeout_s: float, interval_s: float = 0.01
) -> tuple[int, StateDict]:
    """Poll until `sub` delivers `version` or newer (sync mode); WeightSyncTimeout otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = sub.poll()
        if got is not None and got[0] >= version:
            return got
        time.sleep(interval_s)
    raise WeightSyncTimeout(f"weights v{version} did not arrive within {timeout_s:g} s (newest: v{sub.version})")


# --------------------------------------------------------------------------- filesystem


def _file_name(version: int) -> str:
    return f"v{version:08d}.safetensors"


def _cpu_tensors(state_dict: Mapping[str, torch.Tensor]) -> StateDict:
    """Detached contiguous CPU tensors; tied weights are cloned (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return out


class FilesystemPublisher:
    """Writes ``v<version>.safetensors`` + ``latest`` atomically; keeps the last `keep` files."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (readers may still be loading the previous file), got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.version = -1

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        _check_version(version, self.version)
        final = self.directory / _file_name(version)
        tmp = self.directory / f".{final.name}.{os.getpid()}.tmp"
        tensors = _cpu_tensors(state_dict)
        metadata = {"version": str(version), "names": json.dumps(list(tensors))}  # safetensors sorts keys
        save_file(tensors, str(tmp), metadata=metadata)
        _fsync_file(tmp)
        os.replace(tmp, final)
        pointer = {"version": version, "file": final.name}
        write_atomic(self.directory / LATEST, json.dumps(pointer).encode(), mode=0o644)
        self.version = version
        self._prune()
        log.info("published weights v%d to %s", version, final)

    def _prune(self) -> None:
        files = sorted(p for p in self.directory.iterdir() if _FILE_RE.fullmatch(p.name))
        for old in files[: -self.keep]:
            old.unlink(missing_ok=True)

    def close(self) -> None:
        pass


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_safetensors(path: Path, device: torch.device) -> Any:
    """safe_open, but FileNotFoundError (not RuntimeError) when the file was pruned meanwhile."""
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except RuntimeError as err:
        if not path.exists():
            raise FileNotFoundError(str(path)) from err
        raise


class FilesystemSubscriber:
    """Loads the file ``latest`` names when its version is newer than ours."""

    def __init__(
        self, directory: str | os.PathLike[str], device: torch.device | str = "cpu", check_interval_s: float = 0.2
    ) -> None:
        self.directory = Path(directory)
        self.device = torch.device(device)
        self.check_interval_s = check_interval_s
        self.version = -1
        self._next_check = 0.0

    def _latest(self) -> tuple[int, str] | None:
        try:
            pointer = json.loads((self.directory / LATEST).read_text())
        except FileNotFoundError:
            return None
        return int(pointer["version"]), str(pointer["file"])

    def poll(self) -> tuple[int, StateDict] | None:
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.check_interval_s
        for _ in range(3):  # the file may be pruned between reading `latest` and opening it
            latest = self._latest()
            if latest is None or latest[0] <= self.version:
                return None
            try:
                return self._load(*latest)
            except FileNotFoundError:
                continue
        return None

    def _load(self, version: int, name: str) -> tuple[int, StateDict]:
        path = self.directory / name
        with _open_safetensors(path, self.device) as f:
            metadata = f.metadata() or {}
            if metadata.get("version") != str(version):
                raise WeightSyncError(
                    f"{path} is tagged version {metadata.get('version')!r}, but {LATEST} says {version}"
                )
            names = json.loads(metadata["names"]) if "names" in metadata else list(f.keys())
            state_dict = {key: f.get_tensor(key) for key in names}
        self.version = version
        log.info("loaded weights v%d from %s", version, path)
        return version, state_dict

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- broadcast ("nccl")


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of one dtype, flattened into one buffer."""

    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numels(self) -> list[int]:
        return [int(torch.Size(s).numel()) for s in self.shapes]

    @property
    def nbytes(self) -> int:
        return sum(self.numels) * _itemsize(self.dtype)


Manifest = list[tuple[str, str, tuple[int, ...]]]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def manifest_of(state_dict: Mapping[str, torch.Tensor]) -> Manifest:
    """(name, dtype name, shape) of every tensor; ValueError for dtypes that cannot travel."""
    out = []
    for name, t in state_dict.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; weight sync supports {sorted(_DTYPES)}")
        out.append((name, dtype, tuple(t.shape)))
    return out


def plan_buckets(manifest: Manifest, bucket_bytes: int) -> list[Bucket]:
    """Group tensors by dtype (first-seen order) and pack each group into buckets of <= bucket_bytes.

    A tensor larger than `bucket_bytes` gets a bucket of its own. Both sides
    compute the same plan from the same manifest.
    """
    by_dtype: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dtype_name, shape in manifest:
        by_dtype.setdefault(dtype_name, []).append((name, tuple(shape)))
    buckets = []
    for dtype_name, entries in by_dtype.items():
        dtype, size = _DTYPES[dtype_name], 0
        current: list[tuple[str, tuple[int, ...]]] = []
        for name, shape in entries:
            nbytes = int(torch.Size(shape).numel()) * _itemsize(dtype)
            if current and size + nbytes > bucket_bytes:
                buckets.append(_bucket(dtype, current))
                current, size = [], 0
            current.append((name, shape))
            size += nbytes
        if current:
            buckets.append(_bucket(dtype, current))
    return buckets


def _bucket(dtype: torch.dtype, entries: list[tuple[str, tuple[int, ...]]]) -> Bucket:
    return Bucket(dtype, tuple(n for n, _ in entries), tuple(s for _, s in entries))


class _Keys:
    """TCPStore keys of the handshake (under a private prefix of the world store)."""

    ANNOUNCE = "announce"  # (newest announced version + 1), set by trainer[0]; absent (read as 0) = none yet

    @staticmethod
    def ready(version: int, rank: int) -> str:
        return f"ready/{version}/{rank}"

    @staticmethod
    def go(version: int) -> str:
        return f"go/{version}"


def _prefixed(store: dist.Store) -> dist.Store:
    return dist.PrefixStore("vlaslurm/weights/", store)


class BroadcastPublisher:
    """trainer[0]'s side of the ``nccl`` weight sync."""

    def __init__(
        self,
        store: dist.Store,
        group: dist.ProcessGroup,
        src: int,
        receivers: Sequence[int],
        device: torch.device | str,
        timeout_s: float,
        names: Mapping[int, str] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        stopped: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = _prefixed(store)
        self.group = group
        self.src = src
        self.receivers = sorted(receivers)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.names = dict(names or {})
        self.bucket_bytes = bucket_bytes
        # Why the publisher's process is stopping (a drain signal), or None: the handshake then gives up at once,
        # since a TERM that ends every rank together leaves generators that never join, and the signal's
        # handler cannot interrupt the store's wait.
        self.stopped = stopped
        self.version = -1

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor], timeout_s: float | None = None) -> None:
        """Announce, wait for every generator (deadline), then broadcast; see the module docstring."""
        _check_version(version, self.version)
        manifest = manifest_of(state_dict)
        # set, not add: trainer[0] is its only writer, and each announcement replaces a forged or deleted one
        self.store.set(_Keys.ANNOUNCE, str(version + 1))
        self._await_ready(version, self.timeout_s if timeout_s is None else timeout_s)
        self.store.set(_Keys.go(version), cast(str, b"go"))  # c10d takes bytes; torch's stubs say str
        self._broadcast(version, manifest, state_dict)
        self._forget(version)
        self.version = version
        log.info("broadcast weights v%d to %d generator ranks", version, len(self.receivers))

    def _await_ready(self, version: int, timeout_s: float) -> None:
        """Every receiver's sealed `ready` (the world store refuses forged ones) or WeightSyncTimeout naming who
        is missing, with the store's account of each key (missing or forged). Waits in slices of
        `_READY_SLICE_S` so that a stop (`stopped`) ends it within one."""
        keys = [_Keys.ready(version, r) for r in self.receivers]
        deadline = time.monotonic() + timeout_s
        while True:
            started = time.monotonic()
            left = deadline - started
            wait_s = max(0.001, min(left, _READY_SLICE_S))
            try:
                self.store.wait(keys, timedelta(seconds=wait_s))
                return
            except (RuntimeError, TimeoutError) as err:  # StoreTimeout, or DistStoreError from a plain store
                why = str(err)
            stop = self.stopped()
            if stop is not None:
                why = f"{stop} received: given up"
                break
            if left <= _READY_SLICE_S or time.monotonic() - started < wait_s / 2:  # the end, or not a timeout
                break
        missing = [r for r, k in zip(self.receivers, keys) if not self.store.check([k])]
        if not missing:
            return
        self.store.set(_Keys.go(version), cast(str, b"abort"))
        who = ", ".join(self.names.get(r, f"rank {r}") for r in missing)
        raise WeightSyncTimeout(
            f"weight broadcast v{version}: {who} (global ranks {missing}) did not join within {timeout_s:g} s; "
            f"a generator joins when its poll() sees the announcement between batches ({why})"
        )

    def _broadcast(self, version: int, manifest: Manifest, state_dict: Mapping[str, torch.Tensor]) -> None:
        packed = msgpack.packb([[n, d, list(s)] for n, d, s in manifest])
        buckets = plan_buckets(manifest, self.bucket_bytes)
        header = torch.tensor([_MAGIC, version, len(packed), len(buckets), self.bucket_bytes], dtype=torch.int64)
        dist.broadcast(header.to(self.device), self.src, group=self.group)
        manifest_bytes = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(self.device)
        dist.broadcast(manifest_bytes, self.src, group=self.group)
        for bucket in buckets:
            flat = torch.cat([state_dict[n].detach().reshape(-1).to(self.device) for n in bucket.names])
            dist.broadcast(flat.view(torch.uint8), self.src, group=self.group)

    def _forget(self, version: int) -> None:
        for rank in self.receivers:
            self.store.delete_key(_Keys.ready(version, rank))
        if self.version >= 0:
            self.store.delete_key(_Keys.go(self.version))

    def close(self) -> None:
        pass


class BroadcastSubscriber:
    """A generator's side of the ``nccl`` weight sync."""

    def __init__(
        self,
        store: dist.Store,
        group: dist.ProcessGroup,
        src: int,
        rank: int,
        device: torch.device | str,
        timeout_s: float,
        check_interval_s: float = 0.0,
    ) -> None:
        self.store = _prefixed(store)
        self.group = group
        self.src = src
        self.rank = rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        self.version = -1
        self._next_check = 0.0

    def announced(self) -> int:
        """Newest announced version (-1 if none); one store round trip."""
        return int(self.store.add(_Keys.ANNOUNCE, 0)) - 1

    def poll(self) -> tuple[int, StateDict] | None:
        """None unless a newer version is announced; then join its broadcast and return it."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.check_interval_s
        version = self.announced()
        if version <= self.version:
            return None
        return version, self.receive(version)

    def receive(self, version: int) -> StateDict:
        """Say ready for `version`, wait for go (deadline), receive every bucket."""
        self.store.set(_Keys.ready(version, self.rank), cast(str, b"1"))  # c10d takes bytes; the stubs say str
        go_key = _Keys.go(version)
        try:
            self.store.wait([go_key], timedelta(seconds=self.timeout_s))  # a sealed go: forged ones are refused
        except (RuntimeError, TimeoutError) as err:
            raise WeightSyncTimeout(
                f"rank {self.rank}: trainer never started broadcast v{version} within {self.timeout_s:g} s ({err})"
            ) from err
        if self.store.get(go_key) != b"go":
            raise WeightSyncError(
                f"rank {self.rank}: trainer aborted weight broadcast v{version} (another generator was missing)"
            )
        state_dict = self._receive_buckets(version)
        self.version = version
        log.info("received weights v%d by broadcast", version)
        return state_dict

    def _receive_buckets(self, version: int) -> StateDict:
        header = torch.zeros(5, dtype=torch.int64, device=self.device)
        dist.broadcast(header, self.src, group=self.group)
        magic, got_version, manifest_len, n_buckets, bucket_bytes = (int(x) for x in header.cpu())
        if magic != _MAGIC or got_version != version:
            raise WeightSyncError(f"rank {self.rank}: broadcast header {header.tolist()} does not match v{version}")
        packed = torch.empty(manifest_len, dtype=torch.uint8, device=self.device)
        dist.broadcast(packed, self.src, group=self.group)
        manifest = [(n, d, tuple(s)) for n, d, s in msgpack.unpackb(packed.cpu().numpy().tobytes())]
        buckets = plan_buckets(manifest, bucket_bytes)
        if len(buckets) != n_buckets:
            raise WeightSyncError(f"rank {self.rank}: planned {len(buckets)} buckets, trainer sent {n_buckets}")
        out: StateDict = {}
        for bucket in buckets:
            flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, self.src, group=self.group)
            typed = flat.view(bucket.dtype)
            for name, shape, part in zip(bucket.names, bucket.shapes, typed.split(bucket.numels)):
                out[name] = part.view(shape)
        return {name: out[name] for name, _, _ in manifest}  # the trainer's order, not the bucket order

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- factories


def _check_method(method: str) -> None:
    if method not in WEIGHT_SYNCS:
        raise ValueError(f"rollout.weight_sync must be one of {list(WEIGHT_SYNCS)}, got {method!r}")


def sync_ranks(world: World) -> tuple[int, list[int]]:
    """(trainer[0]'s global rank, generator global ranks) of the weight-sync group."""
    return world.ranks_of("trainer")[0], world.ranks_of("generator")


def _sync_group(world: World, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    src, receivers = sync_ranks(world)
    backend = "nccl" if device.type == "cuda" else "gloo"
    return new_subgroup([src, *receivers], backend=backend, timeout_s=timeout_s)


def make_publisher(
    method: str,
    *,
    run_dir: str | os.PathLike[str],
    world: World | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = 120.0,
    keep: int = 3,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stopped: Callable[[], str | None] = lambda: None,
) -> WeightPublisher:
    """trainer[0]'s publisher for `method` (``nccl`` needs `world`; creates the sync group); `stopped` says
    why the trainer is stopping, which ends a handshake waiting for generators (`BroadcastPublisher`)."""
    _check_method(method)
    if method == "filesystem":
        return FilesystemPublisher(weights_dir(run_dir), keep=keep)
    world = _need_world(world)
    device = torch.device(device)
    src, receivers = sync_ranks(world)
    if world.rank != src:
        raise ValueError(f"only trainer[0] (global rank {src}) publishes weights; this is {world.describe(world.rank)}")
    group = _sync_group(world, device, timeout_s)
    names = {r: world.describe(r) for r in receivers}
    return BroadcastPublisher(world.store, group, src, receivers, device, timeout_s, names, bucket_bytes, stopped)


def make_subscriber(
    method: str,
    *,
    run_dir: str | os.PathLike[str],
    world: World | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = 120.0,
    check_interval_s: float | None = None,
) -> WeightSubscriber:
    """A generator's subscriber for `method` (``nccl`` needs `world`; creates the sync group)."""
    _check_method(method)
    device = torch.device(device)
    if method == "filesystem":
        return FilesystemSubscriber(weights_dir(run_dir), device, 0.2 if check_interval_s is None else check_interval_s)
    world = _need_world(world)
    if world.rank not in sync_ranks(world)[1]:
        raise ValueError(f"only generator ranks subscribe to weights; this is {world.describe(world.rank)}")
    group = _sync_group(world, device, timeout_s)
    src = sync_ranks(world)[0]
    return BroadcastSubscriber(world.store, group, src, world.rank, device, timeout_s, check_interval_s or 0.0)


def _need_world(world: World | None) -> World:
    if world is None:
        raise ValueError(
            "rollout.weight_sync: nccl needs the distributed world (dist.init_world) on trainer[0] and generators"
        )
    return world
