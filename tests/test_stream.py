"""Router and Dealer on direct connections (vlaslurm.runtime.stream): what ZeroMQ's I/O thread did for them
(queueing a send the kernel cannot take, connecting late, reconnecting, refusing oversized frames and
duplicate routing ids) done by the caller's thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from runtime_helpers import RawStream

from vlaslurm.runtime import stream
from vlaslurm.runtime.netaddr import free_port
from vlaslurm.runtime.transport import Dealer, Message, Poller, Router, Sub

KEY = bytes(range(32))
LOOPBACK = "127.0.0.1"
MIB = 1 << 20


def pump_until(predicate, sockets, timeout_s: float = 10.0) -> None:
    """Poll `sockets` (flushing and reading them, as a role's loop does) until `predicate()`."""
    poller = Poller(*sockets)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        poller.poll(20)


def test_a_send_the_peer_cannot_take_yet_is_queued_as_a_copy_and_goes_out_in_order() -> None:
    with Router(KEY) as router, Dealer(KEY) as dealer:
        dealer.connect(router.bind(LOOPBACK))
        image = np.arange(4 * MIB, dtype=np.uint8)
        started = time.monotonic()
        for n in range(3):  # 12 MiB: more than the kernel's buffers hold while the router reads nothing
            image[0] = n
            dealer.send(Message("obs", {"n": n}, {"image": image}))
        assert time.monotonic() - started < 5  # queued, not waited for
        assert dealer.conn is not None and dealer.conn.pending > 0
        image[:] = 7  # the caller may reuse its buffer once send returned
        got: list = []
        pump_until(lambda: got.extend(filter(None, [router.recv(0)])) or len(got) == 3, [dealer, router])
    assert [m.meta["n"] for _, m in got] == [0, 1, 2]
    for n, (_, message) in enumerate(got):
        assert message.arrays["image"][0] == n and message.arrays["image"][1:5].tolist() == [1, 2, 3, 4]
        assert not message.arrays["image"].flags.writeable


def test_a_dealer_that_connects_before_its_router_binds_delivers_once_it_does() -> None:
    port = free_port(LOOPBACK)
    with Dealer(KEY) as dealer:
        dealer.connect(f"tcp://{LOOPBACK}:{port}")  # nothing listens yet: the message waits
        dealer.send(Message("obs", {"early": True}))
        assert dealer.conn is None and len(dealer.backlog) == 1
        with Router(KEY) as router:
            router.bind(LOOPBACK, port)
            got: list = []
            pump_until(lambda: got.extend(filter(None, [router.recv(0)])) or bool(got), [dealer, router])
            assert got[0][1].meta == {"early": True} and got[0][0] == dealer.identity


def test_a_dealer_reconnects_to_a_router_that_came_back_on_its_port() -> None:
    with Dealer(KEY) as dealer:
        first = Router(KEY)
        endpoint = first.bind(LOOPBACK)
        dealer.connect(endpoint)
        dealer.send(Message("obs", {"n": 1}))
        assert first.recv(5000) is not None
        first.close()
        pump_until(lambda: dealer.recv(0) is None and dealer.conn is None, [dealer])  # it saw the end
        with Router(KEY) as second:
            second.bind(LOOPBACK, int(endpoint.rsplit(":", 1)[1]))
            dealer.send(Message("obs", {"n": 2}))  # waits for the reconnection (after the back-off), then goes out
            got: list = []
            pump_until(lambda: got.extend(filter(None, [second.recv(0)])) or bool(got), [dealer, second])
    got = got[0]
    assert got is not None and got[1].meta == {"n": 2}


def test_two_sockets_sending_to_each_other_past_their_queue_bound_do_not_deadlock() -> None:
    """Each blocks once its connection holds more than `max_queued_bytes`, reading its own input meanwhile,
    so neither waits for the other forever."""
    with Router(KEY) as router, Dealer(KEY) as dealer:
        dealer.connect(router.bind(LOOPBACK))
        dealer.send(Message("hello"))
        peer, _ = router.recv(5000) or pytest.fail("no hello")
        for sock in (router, dealer):
            sock.max_queued_bytes = MIB
        chunk = np.ones(MIB, np.uint8)
        errors: list = []
        dealer_done = threading.Event()

        def flood(send) -> None:
            try:
                for n in range(8):
                    send(Message("bulk", {"n": n}, {"a": chunk}))
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

        def router_side() -> None:
            flood(lambda m: router.send(peer, m, timeout_ms=20_000))
            pump_until(dealer_done.is_set, [router], timeout_s=30)  # it goes on reading, as a role's loop does

        other = threading.Thread(target=router_side)
        other.start()
        flood(lambda m: dealer.send(m, timeout_ms=20_000))
        dealer_done.set()
        pump_until(lambda: not other.is_alive(), [dealer], timeout_s=30)
        assert not errors, errors
        got_router: list = []
        got_dealer: list = []
        pump_until(
            lambda: (
                (
                    got_router.extend(filter(None, [router.recv(0)])),
                    got_dealer.extend(filter(None, [dealer.recv(0)])),
                )
                and len(got_router) == 8
                and len(got_dealer) == 8
            ),
            [router, dealer],
            timeout_s=30,
        )
    assert [m.meta["n"] for _, m in got_router] == list(range(8)) == [m.meta["n"] for m in got_dealer]


def test_an_oversized_frame_is_refused_from_its_length_and_its_connection_dropped() -> None:
    with Router(KEY, max_frame_bytes=MIB) as router, Dealer(KEY) as honest:
        endpoint = router.bind(LOOPBACK)
        with RawStream(endpoint, identity=b"big") as raw:
            header, _ = stream.message_header([bytes(16)])
            raw.sock.sendall(header[:4] + (64 * MIB).to_bytes(8, "little"))  # announces 64 MiB, sends none
            assert router.recv(300) is None
            assert raw.has_input(5) and raw.sock.recv(1) == b""  # the router closed it
        with RawStream(endpoint, identity=b"many") as raw:
            raw.sock.sendall((stream.MAX_FRAMES + 1).to_bytes(4, "little"))
            assert router.recv(300) is None
        with RawStream(endpoint, identity=None) as raw:
            raw.sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not this protocol at all
            assert router.recv(300) is None
        honest.connect(endpoint)
        honest.send(Message("obs", {}, {"a": np.zeros(MIB // 2, np.uint8)}))
        got = router.recv(5000)
    assert got is not None and got[1].arrays["a"].nbytes == MIB // 2
    assert router.rejections == {"oversized": 2, "malformed": 1}


def test_a_second_peer_with_a_connected_routing_id_is_refused() -> None:
    with Router(KEY) as router, Dealer(KEY) as sim:
        endpoint = router.bind(LOOPBACK)
        sim.connect(endpoint)
        sim.send(Message("obs", {"from": "sim"}))
        got = router.recv(5000)
        assert got is not None and got[0] == sim.identity
        with RawStream(endpoint, identity=sim.identity) as thief:
            assert router.recv(300) is None  # the router reads the hello and closes the connection
            assert thief.has_input(5) and thief.sock.recv(1) == b""
            router.send(sim.identity, Message("act"))
            reply = sim.recv(5000)
            assert reply is not None and reply.kind == "act"
            assert thief.sock.recv(64) == b""  # the reply went to the simulator, nothing to the thief


def test_a_poller_waits_on_stream_and_zeromq_sockets_together() -> None:
    with Router(KEY) as router, Dealer(KEY) as dealer, Sub(KEY) as sub:
        dealer.connect(router.bind(LOOPBACK))
        poller = Poller(router, sub)
        assert poller.poll(50) == []
        dealer.send(Message("obs"))
        ready = poller.poll(5000)
        assert ready == [router]
        assert router.recv(0) is not None


def test_empty_arrays_travel_and_do_not_stall_the_sender() -> None:
    """A message whose last array is empty: its frame is a length alone (a zero-byte write never completes)."""
    with Router(KEY) as router, Dealer(KEY) as dealer:
        dealer.connect(router.bind(LOOPBACK))
        dealer.send(Message("obs", {}, {"image": np.ones(3, np.uint8), "state": np.zeros((4, 0), np.float32)}))
        got = router.recv(5000)
        assert got is not None and got[1].arrays["state"].shape == (4, 0)
        router.send(got[0], Message("act", {}, {"empty": np.zeros(0, np.int64)}))
        reply = dealer.recv(5000)
    assert reply is not None and reply.arrays["empty"].shape == (0,)


def test_a_flood_of_refused_messages_does_not_hold_recv_past_its_deadline() -> None:
    with Router(KEY) as router:
        endpoint = router.bind(LOOPBACK)
        with RawStream(endpoint, identity=b"flood") as raw:
            for _ in range(2000):
                raw.send([b"junk"])
            pump_until(lambda: len(router.inbox) > 100, [router])  # read, not yet taken
        assert router.recv(0) is None
        assert router.rejected == 1  # one refusal, then the deadline (0) ended the call
