"""torch.distributed world over a file rendezvous: four real processes, gloo, loopback.

Also the locked-down store: it listens on the rank's address only (read from /proc), and a TCPStore
client without the run secret finds none of the names c10d writes and cannot forge a value.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from listen_helpers import is_wildcard, listening
from process_helpers import run_ranks

SECRET = bytes(range(32))
# What c10d writes for the default group over gloo: each rank's listener address, as
# "<group>//<device>//<gloo prefix>/<rank>" (seen with list_keys() on torch 2.13).
C10D_KEYS = [f"0//cpu//0/{rank}" for rank in range(4)]

EXPECTED = {"trainer": 1, "generator": 2, "simulator": 1}
KEYS = [("trainer", 0), ("generator", 0), ("generator", 1), ("simulator", 0)]


def _rank_main(run_dir: str, role: str, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from vlaslurm.runtime.dist import (
        host_store,
        init_world,
        new_subgroup,
        set_running_timeout,
        store_ports,
        world_barrier,
    )
    from vlaslurm.runtime.rendezvous import Member, Rendezvous, global_rank

    rdzv = Rendezvous(run_dir, EXPECTED)
    store = host_store("127.0.0.1", 30) if global_rank(role, rank, EXPECTED) == 0 else None
    rdzv.join(
        Member(role, rank, host=f"h-{role}{rank}", address="127.0.0.1", ports=store_ports(store), pid=os.getpid())
    )
    members = rdzv.wait(30)
    world = init_world(members, (role, rank), "gloo", 30, store=store, secret=SECRET)
    try:
        total = torch.tensor([float(world.rank + 1)])
        dist.all_reduce(total)
        seen = _what_a_rogue_sees(store, world.store) if store is not None else None
        set_running_timeout(10)  # after the first step, as the roles do
        world_barrier()
        pair = world.ranks_of("trainer") + world.ranks_of("generator")
        pair_sum = None
        if world.rank in pair:
            group = new_subgroup(pair)
            value = torch.tensor([10.0**world.rank])
            dist.all_reduce(value, group=group)
            pair_sum = value.item()
        world_barrier()
        return {
            "rank": world.rank,
            "size": world.world_size,
            "sum": total.item(),
            "pair_sum": pair_sum,
            "generators": world.ranks_of("generator"),
            "listening": listening(os.getpid()),
            "store_port": store.port if store is not None else None,
            "rogue": seen,
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }
    finally:
        world.close()


def _what_a_rogue_sees(store: Any, sealed: Any) -> dict[str, Any]:
    """A TCPStore client without the secret, on global rank 0 after the world formed."""
    from datetime import timedelta

    import torch.distributed as dist

    from vlaslurm.runtime.dist import store_prefix

    rogue = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    prefix = store_prefix(SECRET)
    names = rogue.list_keys()
    return {
        "names": names,
        "plain_found": [k for k in C10D_KEYS if rogue.check([k])],
        "prefixed_found": [k for k in C10D_KEYS if rogue.check([f"{prefix}/{k}"])],
        "values": [rogue.get(f"{prefix}/{k}") for k in C10D_KEYS],
        "plain": [sealed.get(k) for k in C10D_KEYS],
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of four real ranks saw of one world (formed once for the tests below)."""
    run_dir = tmp_path_factory.mktemp("dist") / "rdzv dir"
    return run_ranks(_rank_main, args=[(str(run_dir), role, rank) for role, rank in KEYS])


def test_four_ranks_meet_and_all_reduce(four_ranks: list[dict[str, Any]]) -> None:
    results = four_ranks
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["size"] == 4 and r["sum"] == 1 + 2 + 3 + 4 for r in results)
    assert [r["pair_sum"] for r in results] == [111.0, 111.0, 111.0, None]
    assert all(r["generators"] == [1, 2] for r in results)


def test_store_listens_on_the_given_address_only(four_ranks: list[dict[str, Any]]) -> None:
    results = four_ranks
    port = results[0]["store_port"]
    assert ("127.0.0.1", port) in results[0]["listening"]
    for result in results:  # the store's socket, and gloo's listeners: none on every interface
        assert result["listening"], "a rank of a gloo world listens for its peers"
        assert not [a for a, _ in result["listening"] if is_wildcard(a)], result["listening"]
        # gloo pinned to the interface of 127.0.0.1 (unless whoever runs the tests chose one)
        assert result["gloo_ifname"] == (os.environ.get("GLOO_SOCKET_IFNAME") or "lo")


def test_interface_of_an_address() -> None:
    from vlaslurm.runtime.netaddr import interface_of

    assert interface_of("127.0.0.1") == interface_of("127.0.1.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: held by no interface here
    assert interface_of("not an address") is None


def test_a_client_without_the_secret_finds_no_key_and_no_plaintext(four_ranks: list[dict[str, Any]]) -> None:
    from vlaslurm.runtime.dist import store_prefix

    rogue = four_ranks[0]["rogue"]
    assert rogue["plain_found"] == []
    assert rogue["prefixed_found"] == C10D_KEYS  # they exist, under the secret's prefix
    assert rogue["names"] and all(n.startswith(store_prefix(SECRET) + "/") for n in rogue["names"])
    # gloo writes its listener's address there: the job reads it back, the rogue reads only ciphertext
    assert all(rogue["plain"])
    assert not any(plain in value for plain, value in zip(rogue["plain"], rogue["values"]))


def test_a_forged_or_moved_value_is_refused_by_name() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from vlaslurm.runtime.dist import StoreTampered, host_store, job_store, store_prefix

    raw = host_store("127.0.0.1", 5)
    sealed = job_store(raw, SECRET)
    sealed.set("a", b"from the job")
    sealed.set("b", b"also from the job")
    assert sealed.get("a") == b"from the job"
    rogue = dist.TCPStore("127.0.0.1", raw.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    prefix = store_prefix(SECRET)
    rogue.set(f"{prefix}/a", b"forged")
    with pytest.raises(StoreTampered, match="key 'a' holds a value not sealed with this run's secret"):
        sealed.wait(["a"], timedelta(seconds=0.3))
    rogue.set(f"{prefix}/a", rogue.get(f"{prefix}/b"))  # a genuine value, moved to another key
    with pytest.raises(StoreTampered):
        sealed.wait(["a"], timedelta(seconds=0.3))
    assert job_store(raw, bytes(32)).check(["b"]) is False  # another secret, another namespace


def test_sealed_counters_and_compare_set_keep_c10d_semantics() -> None:
    from vlaslurm.runtime.dist import host_store, job_store

    store = job_store(host_store("127.0.0.1", 5), SECRET)
    assert [store.add("n", 2), store.add("n", 3), int(store.get("n"))] == [2, 5, 5]
    store.delete_key("n")
    assert store.add("n", 7) == 7
    assert store.compare_set("k", "", "v1") == b"v1"  # missing key, empty expectation: set
    assert store.compare_set("k", "v1", "v2") == b"v2"  # match: swap
    assert store.compare_set("k", "v1", "v3") == b"v2"  # mismatch: current value
    assert store.compare_set("gone", "x", "y") == b"x"  # missing key, non-empty expectation: expected
    assert not store.check(["gone"])


def test_store_binds_ipv6_addresses_too() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from vlaslurm.runtime.dist import host_store

    try:
        store = host_store("::1", 5)
    except Exception as err:  # no IPv6 loopback in this container
        pytest.skip(f"::1 not bindable: {err}")
    assert ("::1", store.port) in listening(os.getpid())
    client = dist.TCPStore("::1", store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    client.set("x", "y")
    assert store.get("x") == b"y"


def test_world_backend_is_gloo_without_cuda() -> None:
    import torch

    from vlaslurm.runtime.dist import world_backend

    assert world_backend(use_cuda=False) == "gloo"
    if not torch.cuda.is_available():
        assert world_backend(use_cuda=True) == "gloo"


def test_store_must_come_from_global_rank_zero() -> None:
    from vlaslurm.runtime.dist import WorldError, init_world
    from vlaslurm.runtime.rendezvous import Member

    members = {(role, rank): Member(role, rank, host="h", address="127.0.0.1") for role, rank in KEYS}
    with pytest.raises(WorldError, match="global rank 0 must pass the store"):
        init_world(members, ("trainer", 0), "gloo", 1, secret=SECRET)
    with pytest.raises(WorldError, match=r"trainer\[0\]@h \(global rank 0\) published no 'store' port"):
        init_world(members, ("generator", 0), "gloo", 1, secret=SECRET)
    del members[("generator", 0)]
    with pytest.raises(WorldError, match=r"lack generator ranks \[0\]"):
        init_world(members, ("simulator", 0), "gloo", 0.3, secret=SECRET)


def test_unreachable_store_names_rank_zero() -> None:
    from vlaslurm.runtime.dist import WorldError, init_world
    from vlaslurm.runtime.netaddr import free_port
    from vlaslurm.runtime.rendezvous import Member

    port = free_port()
    members = {
        (role, rank): Member(role, rank, host="node9", address="127.0.0.1", ports={"store": port})
        for role, rank in KEYS
    }
    with pytest.raises(WorldError, match=rf"TCPStore of trainer\[0\]@node9 at 127.0.0.1:{port}"):
        init_world(members, ("simulator", 0), "gloo", 0.3, secret=SECRET)
