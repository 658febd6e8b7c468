"""One torch.distributed world over every rank of every role.

Global ranks are role-major (trainer, generator, simulator); the TCPStore lives in global rank 0
(trainer[0]) and is published through the rendezvous. Every rank runs gloo for CPU tensors, NCCL
only on subgroups that all have it. The store binds the rank's own address and every value is
sealed (AES-GCM, keyed by the run secret): a waiter takes only sealed values, so a client without the
secret cannot satisfy a wait; deleting or overwriting a live key fails the waiter at its deadline.
Details (order of operations, what the seal does not protect): docs/runtime.md
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence, cast

import torch
import torch.distributed as dist
from cryptography.exceptions import InvalidTag  # installed with mlflow; AES-GCM is not in the stdlib
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vlaslurm.rundir.secret import derive_key
from vlaslurm.runtime.netaddr import interface_of
from vlaslurm.runtime.rendezvous import ROLE_ORDER, Key, Member, global_rank, role_rank

log = logging.getLogger("vlaslurm.dist")

STORE_PORT = "store"
_LIVE_STORES: list[dist.Store] = []


class WorldError(RuntimeError):
    """The distributed world could not be formed; the message says who or what is wrong."""


class StoreTampered(RuntimeError):
    """A value in the TCPStore was not written by a holder of the run secret."""


class StoreTimeout(StoreTampered, dist.DistStoreError):
    """A store wait reached its deadline; the message names each key it lacked, as missing or forged
    (a peer that is late or gone, or another client that deleted or overwrote the key)."""


@dataclass
class World:
    """This rank's view of the initialised default process group."""

    role: str
    role_rank: int
    rank: int
    world_size: int
    backend: str
    expected: dict[str, int]
    store: SealedStore
    """The sealed store over global rank 0's TCPStore, shared by all ranks (use a PrefixStore for your keys)."""

    def ranks_of(self, role: str) -> list[int]:
        """Global ranks of every rank of `role`, in role-rank order."""
        return [global_rank(role, r, self.expected) for r in range(self.expected.get(role, 0))]

    def describe(self, rank: int) -> str:
        """``role[rank]`` of a global rank, for error messages."""
        role, local = role_rank(rank, self.expected)
        return f"{role}[{local}]"

    def close(self) -> None:
        """Destroy the default process group (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        _LIVE_STORES.clear()


def world_backend(use_cuda: bool) -> str:
    """``cpu:gloo,cuda:nccl`` for a rank that has a GPU and NCCL, else ``gloo``."""
    if use_cuda and torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def host_store(address: str, timeout_s: float) -> dist.TCPStore:
    """Global rank 0 only, before joining the rendezvous: start the TCPStore on a free port of `address`.

    `address` is the rank's bind address (what it advertises in its Member); the
    store listens there only, not on every interface.
    """
    last: RuntimeError | None = None
    for use_libuv in (True, False):  # libuv is torch's default server; the other one also takes a socket
        listener = _listen(address)
        try:
            return dist.TCPStore(
                address,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                use_libuv=use_libuv,
                master_listen_fd=listener.detach(),
            )  # the store owns (and closes) the fd
        except RuntimeError as err:
            log.warning("TCPStore(use_libuv=%s) on %s failed: %s", use_libuv, address, err)
            last = err
    raise WorldError(f"cannot start the TCPStore on {address}: {last}")


def _listen(address: str) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as err:
        listener.close()
        raise WorldError(f"cannot bind the TCPStore to {address}: {err}") from err
    return listener


def store_ports(store: dist.TCPStore | None) -> dict[str, int]:
    """``{"store": port}`` to merge into rank 0's Member.ports; empty for other ranks."""
    return {STORE_PORT: int(store.port)} if store is not None else {}


def expected_from(members: Mapping[Key, Member]) -> dict[str, int]:
    """Ranks per role, checking every role has ranks 0..n-1 and only known roles appear."""
    counts = Counter(role for role, _ in members)
    for role, count in counts.items():
        if role not in ROLE_ORDER:
            raise WorldError(f"unknown role {role!r} among members; valid roles are {list(ROLE_ORDER)}")
        missing = sorted(set(range(count)) - {r for ro, r in members if ro == role})
        if missing:
            raise WorldError(f"members lack {role} ranks {missing}; pass the complete result of Rendezvous.wait()")
    return dict(counts)


def _connect_store(members: Mapping[Key, Member], expected: Mapping[str, int], timeout_s: float) -> dist.TCPStore:
    master = members[role_rank(0, expected)]
    if STORE_PORT not in master.ports:
        raise WorldError(
            f"{master.role}[{master.rank}]@{master.host} (global rank 0) published no {STORE_PORT!r} port; "
            "it must call host_store() and join with store_ports(store)"
        )
    port = master.ports[STORE_PORT]
    try:
        return dist.TCPStore(
            master.address, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
    except (RuntimeError, TimeoutError) as err:
        raise WorldError(
            f"cannot reach the TCPStore of {master.role}[{master.rank}]@{master.host} "
            f"at {master.address}:{port} within {timeout_s:g} s: {err}"
        ) from err


def init_world(
    members: Mapping[Key, Member],
    me: Member | Key,
    backend: str,
    timeout_s: float,
    store: dist.TCPStore | None = None,
    device_id: torch.device | None = None,
    *,
    secret: bytes,
) -> World:
    """Initialise the default process group over all `members` (the result of Rendezvous.wait).

    `store` is the TCPStore from `host_store` on global rank 0 and must be None elsewhere;
    `secret` is the run secret: every key the world writes goes under `store_prefix(secret)`
    and every value is sealed with a key derived from it (see the module docstring).
    """
    role, local = me.key if isinstance(me, Member) else me
    expected = expected_from(members)
    rank = global_rank(role, local, expected)
    if rank == 0 and store is None:
        raise WorldError("global rank 0 must pass the store it created with host_store() before joining")
    if rank != 0 and store is not None:
        raise WorldError(f"{role}[{local}] is global rank {rank}; only global rank 0 hosts the store")
    sealed = job_store(store or _connect_store(members, expected, timeout_s), secret)
    _LIVE_STORES.append(sealed)  # c10d keeps only the C++ half of a Python store: keep the Python half alive
    _pin_gloo(members[(role, local)].address)
    size = sum(expected.values())
    dist.init_process_group(
        backend, store=sealed, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), device_id=device_id
    )
    log.info("%s[%d]: joined world as rank %d/%d (%s)", role, local, rank, size, backend)
    return World(
        role=role, role_rank=local, rank=rank, world_size=size, backend=backend, expected=expected, store=sealed
    )


def _pin_gloo(address: str) -> None:
    """Make gloo listen on the interface of `address` (it would use the hostname's address otherwise)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return  # the user's choice (e.g. a site profile) wins
    interface = interface_of(address)
    if interface is None:
        log.warning("no network interface holds %s; gloo listens on the hostname's address", address)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface


STORE_LABEL = "vlaslurm/tcpstore/v1"


def store_prefix(secret: bytes) -> str:
    """The namespace of every key the job writes: hex HMAC of a fixed label under the run secret."""
    return derive_key(secret, STORE_LABEL + "/prefix").hex()


def job_store(raw: dist.Store, secret: bytes) -> SealedStore:
    """`raw` (the TCPStore) as the job sees it: keys under `store_prefix`, values sealed."""
    return SealedStore(dist.PrefixStore(store_prefix(secret), raw), derive_key(secret, STORE_LABEL + "/seal"))


class SealedStore(dist.Store):
    """A store whose values are AES-GCM sealed, bound to their key name; c10d and gloo use it like any store.

    Only a sealed value counts: a waiter (`wait`, `get`, `check`, `add`) treats a key whose value does not
    open as absent, counts it (`rejected`) and logs it, and keeps waiting until its deadline (a forged
    `ready` flag passes no handshake; the honest writer's `set` replaces it). A wait that reaches its
    deadline raises `StoreTimeout` naming each key as missing or forged. Counters (`add`) and
    `compare_set` are compare-and-swap loops over sealed values, so they stay atomic.
    """

    def __init__(self, inner: dist.Store, key: bytes, rejections: dict[str, int] | None = None) -> None:
        super().__init__()
        self._inner, self._key, self._aead = inner, key, AESGCM(key)
        self.rejections = {} if rejections is None else rejections  # shared with clones
        self._refused: dict[str, bytes] = {}  # the last forged value seen per key: each one is counted once

    @property
    def rejected(self) -> int:
        """Forged (or moved) values refused so far, each distinct value once per key."""
        return self.rejections.get("store_values", 0)

    def _seal(self, name: str, value: bytes | str) -> bytes:
        nonce = os.urandom(12)  # random, so two writes of one value differ (the CAS loops rely on it)
        plain = value.encode() if isinstance(value, str) else bytes(value)
        return nonce + self._aead.encrypt(nonce, plain, name.encode())

    def _raw(self, name: str) -> bytes | None:
        """The stored bytes of `name`, or None: one round trip that neither blocks on a missing key (get
        would, for the store's whole timeout) nor races a delete between a check and a get."""
        got = bytes(self._inner.compare_set(name, cast(str, _PROBE), cast(str, _PROBE)))
        return None if got == _PROBE else got  # c10d: a missing key returns the (non-empty) expectation

    def _open(self, name: str, raw: bytes | None) -> bytes | None:
        """The plain value of `raw`, or None if it is absent or not sealed for `name` (counted, logged)."""
        if raw is None:
            return None
        try:
            return self._aead.decrypt(raw[:12], raw[12:], name.encode())
        except (InvalidTag, ValueError):
            if self._refused.get(name) != raw:
                self._refused[name] = raw
                self._count_forged(name)
            return None

    def _count_forged(self, name: str) -> None:
        count = self.rejections["store_values"] = self.rejected + 1
        if count <= _LOG_FIRST_REJECTS or count % _LOG_EVERY_REJECTS == 0:
            log.warning(
                "TCPStore key %r holds a value not sealed with this run's secret: another client wrote it "
                "(the store may have been tampered with); treated as absent (refused so far: %d)",
                name,
                count,
            )

    def _read(self, name: str) -> bytes | None:
        return self._open(name, self._raw(name))

    def _await(self, keys: list[str], timeout: timedelta | None) -> list[bytes]:
        """The sealed values of every key, waiting for them until the deadline (StoreTimeout)."""
        limit = self._inner.timeout if timeout is None else timeout  # type: ignore[attr-defined]
        deadline = time.monotonic() + limit.total_seconds()
        delay = _POLL_MIN_S
        while True:
            raws = [self._raw(k) for k in keys]
            values = [self._open(k, raw) for k, raw in zip(keys, raws)]
            if all(v is not None for v in values):
                return cast(list[bytes], values)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _timeout(keys, raws, values, limit)
            absent = [k for k, raw in zip(keys, raws) if raw is None]
            if absent:  # the server answers when they are set: no polling
                with contextlib.suppress(RuntimeError):  # DistStoreError at the deadline: named below
                    self._inner.wait(absent, timedelta(seconds=remaining))
            else:  # only forged values left: poll until the honest writer replaces them
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, _POLL_MAX_S)

    # c10d's Store methods take bytes as well as str; torch's stubs say str only, hence the casts below.
    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, cast(str, self._seal(key, value)))

    def get(self, key: str) -> bytes:
        value = self._read(key)
        return value if value is not None else self._await([key], None)[0]

    def add(self, key: str, amount: int) -> int:
        raw = self._raw(key)
        if amount == 0:  # a poll (c10d's store barrier, the weight announcement): read it, never rewrite it
            value = self._open(key, raw)
            return int(value) if value is not None else 0
        while True:
            value = self._open(key, raw)  # a forged value counts as absent, and the swap replaces it
            total = (int(value) if value is not None else 0) + amount
            new = self._seal(key, str(total))
            got = bytes(self._inner.compare_set(key, cast(str, raw or b""), cast(str, new)))
            if got == new:
                return total
            raw = None if got == (raw or b"") else got  # got == expectation: the key was deleted meanwhile

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        raw = self._raw(key)
        while True:
            current = self._open(key, raw)
            if current is None and expected:  # c10d: a missing key only matches an empty expectation
                return expected
            if current is not None and current != expected:
                return current
            new = self._seal(key, desired)
            got = bytes(self._inner.compare_set(key, cast(str, raw or b""), cast(str, new)))
            if got == new:
                return desired.encode() if isinstance(desired, str) else bytes(desired)
            raw = None if got == (raw or b"") else got

    def check(self, keys: list[str]) -> bool:
        return all(self._read(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(list(keys), timeout)

    # c10d's trampoline calls these two by their C++ names (store.delete_key / num_keys land here)
    def deleteKey(self, key: str) -> bool:  # noqa: N802
        self._refused.pop(key, None)
        return self._inner.delete_key(key)

    def getNumKeys(self) -> int:  # noqa: N802
        return self._inner.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._inner.multi_set(keys, [self._seal(k, v) for k, v in zip(keys, values)])  # type: ignore[attr-defined]

    def clone(self) -> SealedStore:
        return SealedStore(self._inner.clone(), self._key, self.rejections)  # type: ignore[attr-defined]


_PROBE = b"\x00vlaslurm:absent"  # shorter than any sealed value (nonce + tag are 28 bytes): never a real one
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.1  # while only forged values are there: cheap round trips
_LOG_FIRST_REJECTS, _LOG_EVERY_REJECTS = 10, 1000


def _timeout(keys: list[str], raws: list[bytes | None], values: list[bytes | None], limit: timedelta) -> StoreTimeout:
    missing = [k for k, raw in zip(keys, raws) if raw is None]
    forged = [k for k, raw, v in zip(keys, raws, values) if raw is not None and v is None]
    parts = [f"key {k!r} is missing (never set, or deleted by another client)" for k in missing]
    parts += [f"key {k!r} holds a value not sealed with this run's secret" for k in forged]
    return StoreTimeout(
        f"TCPStore wait timed out after {limit.total_seconds():g} s: {'; '.join(parts)}. Either its writer is "
        "late or gone, or the store may have been tampered with (its port is reachable from this network)"
    )


def new_subgroup(ranks: Sequence[int], backend: str | None = None, timeout_s: float | None = None) -> dist.ProcessGroup:
    """A process group over global `ranks`.

    Only the members call it (local synchronisation; a non-member gets
    WorldError), in the same order as their other `new_subgroup` calls.
    `backend` None = the world's.
    """
    members = sorted(set(ranks))
    if dist.get_rank() not in members:
        raise WorldError(f"global rank {dist.get_rank()} called new_subgroup({members}) but is not a member")
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    return dist.new_group(ranks=members, backend=backend, timeout=timeout, use_local_synchronization=True)


def world_barrier(group: dist.ProcessGroup | None = None) -> None:
    """A barrier that uses gloo on every rank (a CPU all_reduce), whatever each rank's GPU backend."""
    dist.all_reduce(torch.zeros(1), group=group)


def set_running_timeout(timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
    """Tighten a group's collective timeout after the first step (as torchtitan does)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout  # private, stable since torch 2.2

    _set_pg_timeout(timedelta(seconds=timeout_s), group)
