"""The world's TCPStore against a client that reaches its port without the run secret: a real
`dist.TCPStore` on 127.0.0.1 and a foreign `dist.TCPStore` client that finds the job's key names with
`list_keys()` (torch 2.13), then forges, deletes and floods them. No mocks.

Every wait takes only sealed values: a forged one counts as absent (counted once, logged) until the
honest writer replaces it, so a forged `ready` or `go` flag passes no weight handshake; a key deleted
under a waiter fails it at its deadline with an error that names the key and says the store may have
been tampered with. Whole file: about 6 s.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List

import pytest
import torch
import torch.distributed as dist

from vlaslurm.runtime.dist import SealedStore, StoreTimeout, host_store, job_store, store_prefix
from vlaslurm.runtime.transport import rejection_counts
from vlaslurm.runtime.weights import BroadcastPublisher, BroadcastSubscriber, WeightSyncTimeout

SECRET = bytes(range(32))
LOOPBACK = "127.0.0.1"
ROLES = ("trainer", "generator")


def stores(timeout_s: float = 10) -> tuple[SealedStore, Any]:
    """The job's sealed view of a fresh store, and a foreign client of the same port (typed Any: c10d
    takes bytes values and has multi_set, torch's stubs say neither)."""
    raw = host_store(LOOPBACK, timeout_s)
    foreign = dist.TCPStore(LOOPBACK, raw.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    return job_store(raw, SECRET), foreign


def found(foreign: Any, suffix: str, timeout_s: float = 5.0) -> str:
    """The full name of the job's key ending in `suffix`, as the foreign client lists it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = [n for n in foreign.list_keys() if n.endswith(suffix)]
        if names:
            return names[0]
        time.sleep(0.01)
    raise AssertionError(f"no key ending in {suffix!r} appeared")


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    def act() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def test_a_forged_value_is_absent_until_the_job_writes_the_key(package_warnings: List[str]) -> None:
    sealed, foreign = stores()
    name = f"{store_prefix(SECRET)}/k"
    foreign.set(name, b"forged")
    assert not sealed.check(["k"])
    writer = later(0.3, lambda: sealed.set("k", b"honest"))
    start = time.monotonic()
    sealed.wait(["k"], timedelta(seconds=5))  # polls the forged value until the set replaces it
    writer.join()
    assert 0.25 < time.monotonic() - start < 3
    assert sealed.get("k") == b"honest"
    assert sealed.rejected == 1  # one forged value, however often the wait looked at it
    assert rejection_counts(store=sealed) == {"rejected_messages": 0.0, "rejected_store_values": 1.0}
    assert any("key 'k' holds a value not sealed" in message for message in package_warnings)


def test_a_wait_on_a_forged_value_times_out_naming_it() -> None:
    sealed, foreign = stores()
    sealed.set("b", b"the job's")
    foreign.set(f"{store_prefix(SECRET)}/a", foreign.get(f"{store_prefix(SECRET)}/b"))  # genuine, but moved
    with pytest.raises(StoreTimeout, match="key 'a' holds a value not sealed with this run's secret"):
        sealed.wait(["a", "b"], timedelta(seconds=0.3))
    assert sealed.rejected == 1 and sealed.get("b") == b"the job's"


def test_a_deleted_key_fails_the_waiter_at_its_deadline_naming_it() -> None:
    sealed, foreign = stores()
    sealed.set("go/3", b"go")
    foreign.delete_key(found(foreign, "go/3"))
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"key 'go/3' is missing.*may have been tampered with") as err:
        sealed.wait(["go/3"], timedelta(seconds=0.5))
    assert 0.4 < time.monotonic() - start < 3
    assert isinstance(err.value, dist.DistStoreError)  # callers that catch c10d's store errors still do
    short, _ = stores(timeout_s=0.5)
    with pytest.raises(StoreTimeout, match="key 'gone' is missing"):
        short.get("gone")  # get waits for the store's own timeout


def test_counters_replace_a_forged_value_and_polls_never_write() -> None:
    sealed, foreign = stores()
    prefix = store_prefix(SECRET)
    foreign.set(f"{prefix}/n", b"999")  # a pre-empted counter (c10d's barrier counts with add)
    assert sealed.add("n", 0) == 0  # a poll reads it as absent and leaves it alone
    assert foreign.get(f"{prefix}/n") == b"999"
    assert [sealed.add("n", 2), sealed.add("n", 3)] == [2, 5]  # the first add swaps the forged value out
    foreign.set(f"{prefix}/k", b"forged")
    assert sealed.compare_set("k", "x", "y") == b"x"  # a forged value is a missing key
    assert sealed.compare_set("k", "", "v") == b"v" and sealed.get("k") == b"v"
    assert sealed.rejected == 2
    assert sealed.clone().rejections is sealed.rejections  # c10d's clones count into the same place


def test_a_key_flood_leaves_the_job_store_working() -> None:
    sealed, foreign = stores()
    prefix = store_prefix(SECRET)
    start = time.monotonic()
    foreign.multi_set([f"{prefix}/flood/{i}" for i in range(2000)], [b"x" * 256] * 2000)
    foreign.multi_set([f"flood/{i}" for i in range(2000)], [b"x" * 256] * 2000)
    sealed.set("a", b"1")
    assert sealed.add("c", 1) == 1 and sealed.get("a") == b"1" and sealed.check(["a", "c"])
    assert not sealed.check(["flood/7"])
    assert time.monotonic() - start < 10


# --------------------------------------------------------------------------- the weight handshake


def test_a_forged_ready_flag_does_not_pass_the_weight_handshake() -> None:
    """Before, a presence-only wait let trainer[0] start a broadcast no generator had joined (here it
    would reach `dist.broadcast` without a process group and fail otherwise); now it waits for a sealed
    `ready` and, at its deadline, names the generator and the forged key."""
    sealed, foreign = stores()
    publisher = BroadcastPublisher(sealed, None, 0, [1], "cpu", 1.0, names={1: "generator[0]"})  # type: ignore[arg-type]

    def forge_ready() -> None:
        foreign.set(found(foreign, "announce").removesuffix("announce") + "ready/1/1", b"1")

    attacker = later(0.0, forge_ready)
    with pytest.raises(WeightSyncTimeout, match=r"generator\[0\].*did not join.*ready/1/1' holds a value not sealed"):
        publisher.publish(1, {"w": torch.zeros(2)})
    attacker.join()
    assert sealed.rejected >= 1


def test_a_stop_ends_the_wait_for_generators_that_will_never_join() -> None:
    """A TERM to every rank at once ends the generators before they join a publication; the trainer's signal
    handler cannot interrupt the store's wait, so the publisher looks at `stopped` between slices of it and
    gives up within one (before: the whole 60 s deadline, past the launcher's grace, and a KILL)."""
    sealed, _ = stores()
    stop: List[str] = []
    publisher = BroadcastPublisher(
        sealed,
        None,  # type: ignore[arg-type]  # no process group: the handshake never reaches the broadcast
        0,
        [1],
        "cpu",
        60.0,
        names={1: "generator[0]"},
        stopped=lambda: stop[0] if stop else None,
    )
    later(0.3, lambda: stop.append("SIGTERM"))
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"generator\[0\].*did not join.*SIGTERM received"):
        publisher.publish(1, {"w": torch.zeros(2)})
    assert time.monotonic() - start < 20  # one slice (1 s) after the stop; the margin is a loaded machine's


class _BrokenWaits(dist.Store):
    """A store whose waits fail at once, as a TCPStore's do once its server is gone (sets and checks work)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict = {}
        self.waits = 0

    def set(self, key: str, value: Any) -> None:
        self.values[key] = value

    def check(self, keys: List[str]) -> bool:
        return all(k in self.values for k in keys)

    def wait(self, keys: List[str], timeout: Any = None) -> None:
        self.waits += 1
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")


def test_a_wait_that_fails_at_once_is_not_retried_until_the_deadline() -> None:
    """The handshake waits in slices only to look at `stopped`; an error that is no timeout (a store that is
    gone) ends it at once, as before the slices, instead of a busy loop for the whole deadline."""
    store = _BrokenWaits()
    publisher = BroadcastPublisher(store, None, 0, [1], "cpu", 60.0, names={1: "generator[0]"})  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"generator\[0\].*Connection was likely closed"):
        publisher.publish(1, {"w": torch.zeros(2)})
    assert store.waits == 1 and time.monotonic() - start < 10


def test_a_forged_go_does_not_start_a_generators_receive() -> None:
    """The generator says ready; the foreign client, seeing that key, forges the trainer's `go`."""
    sealed, foreign = stores()
    subscriber = BroadcastSubscriber(sealed, None, 0, 1, "cpu", 1.0)  # type: ignore[arg-type]
    attacker = later(0.0, lambda: foreign.set(found(foreign, "ready/0/1").removesuffix("ready/0/1") + "go/0", b"go"))
    with pytest.raises(WeightSyncTimeout, match=r"never started broadcast v0.*go/0' holds a value not sealed"):
        subscriber.receive(0)
    attacker.join()
    assert sealed.rejected == 1


# --------------------------------------------------------------------------- c10d's own waits


def _world_rank(run_dir: str, role: str) -> dict[str, Any]:
    """One of two real ranks forming the world. On trainer[0], a foreign client first forges c10d's gloo
    address keys (the names c10d writes, seen with list_keys in tests/test_dist.py); generator[0] joins a
    second late, so trainer[0] must read its key while only the forged value is there."""
    import os

    import torch
    import torch.distributed as dist

    from vlaslurm.runtime.dist import host_store, init_world, store_ports, world_barrier
    from vlaslurm.runtime.rendezvous import Member, Rendezvous

    rdzv = Rendezvous(run_dir, {"trainer": 1, "generator": 1})
    store = host_store(LOOPBACK, 30) if role == "trainer" else None
    if store is not None:
        foreign = dist.TCPStore(LOOPBACK, store.port, is_master=False, wait_for_workers=False)
        for rank in (0, 1):
            foreign.set(f"{store_prefix(SECRET)}/0//cpu//0/{rank}", "forged gloo address")
    rdzv.join(Member(role, 0, host="h", address=LOOPBACK, ports=store_ports(store), pid=os.getpid()))
    members = rdzv.wait(30)
    if store is None:
        time.sleep(1.0)
    world = init_world(members, (role, 0), "gloo", 30, store=store, secret=SECRET)
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        world_barrier()
        return {"sum": total.item(), "rejected": world.store.rejected}
    finally:
        world.close()


def test_forged_c10d_keys_do_not_stop_the_world_from_forming(tmp_path: Path) -> None:
    from process_helpers import run_ranks

    trainer, generator = run_ranks(_world_rank, args=[(str(tmp_path), r) for r in ROLES])
    assert trainer["sum"] == generator["sum"] == 2.0
    assert trainer["rejected"] >= 1  # it read generator[0]'s forged address and waited for the real one
