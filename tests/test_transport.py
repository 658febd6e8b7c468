"""Transport and run secret: real ZeroMQ sockets on 127.0.0.1, real processes, forged messages."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from conftest import LogRecords
from runtime_helpers import RawStream

from vlaslurm.rundir.secret import SecretError, create_secret, ensure_secret, load_secret, secret_path
from vlaslurm.runtime.transport import (
    OWN_TAG_BYTES,
    WIRE_VERSION,
    Dealer,
    Message,
    PeerUnreachable,
    Poller,
    Pub,
    Pull,
    Push,
    Router,
    SendTimeout,
    Sub,
    WireError,
    bind_address,
    decode,
    encode,
)

KEY = bytes(range(32))
LOOPBACK = "127.0.0.1"


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.integers(0, 255, (1, 224, 224, 3), dtype=np.uint8),
        "state": rng.standard_normal(8).astype(np.float32),
        "mask": np.array([True, False, True]),
        "half": np.arange(6, dtype=np.float16).reshape(2, 3),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 4), np.int64),
        "strided": np.arange(20, dtype=np.int32)[::2],
        "big_endian": np.arange(4, dtype=">u2"),
    }


def assert_same_arrays(got: dict[str, np.ndarray], sent: dict[str, np.ndarray]) -> None:
    assert list(got) == list(sent)
    for name, array in sent.items():
        assert got[name].shape == array.shape, name
        assert got[name].dtype == array.dtype.newbyteorder("<") or got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


# --------------------------------------------------------------------------- wire format


def test_encode_decode_round_trip_every_dtype() -> None:
    sent = Message("obs", {"env": 3, "nested": {"a": [1, 2.5, "x"]}, "raw": b"\x00\x01"}, sample_arrays())
    got = decode([bytes(f) for f in encode(sent, KEY)], KEY)
    assert (got.kind, got.meta) == (sent.kind, sent.meta)
    assert_same_arrays(got.arrays, sent.arrays)
    assert not got.arrays["image"].flags.writeable  # a view of the received frame, not a copy


def test_frame_zero_is_a_versioned_msgpack_envelope() -> None:
    frames = encode(Message("x", {}, {"a": np.ones(3, np.float32)}), KEY, channel="c", session=b"s" * 16, seq=7)
    envelope = msgpack.unpackb(frames[0])
    assert envelope["v"] == WIRE_VERSION == 4 and len(envelope["mac"]) == 16
    assert (envelope["sid"], envelope["seq"]) == (b"s" * 16, 7)
    assert msgpack.unpackb(envelope["h"]) == {
        "kind": "x",
        "meta": {},
        "arrays": [{"name": "a", "dtype": "<f4", "shape": [3]}],
        "ch": "c",
    }
    assert len(frames) == 2 and bytes(frames[1]) == np.ones(3, np.float32).tobytes()


@pytest.mark.parametrize("array", [np.array([1 + 2j]), np.array(["text"]), np.array([object()], dtype=object)])
def test_dtypes_outside_the_whitelist_are_refused(array: np.ndarray) -> None:
    with pytest.raises(ValueError, match="allowed"):
        encode(Message("x", {}, {"a": array}), KEY)


def test_tampering_and_wrong_keys_are_detected() -> None:
    frames = [bytes(f) for f in encode(Message("obs", {"n": 1}, {"a": np.arange(10, dtype=np.int64)}), KEY)]
    with pytest.raises(WireError, match="MAC"):
        decode(frames, b"w" * 32)
    flipped = bytearray(frames[1])
    flipped[3] ^= 1
    with pytest.raises(WireError, match="MAC"):
        decode([frames[0], bytes(flipped)], KEY)
    with pytest.raises(WireError, match="MAC"):
        decode(frames[:1], KEY)  # a dropped array frame
    envelope = msgpack.unpackb(frames[0])
    envelope["h"] = msgpack.packb({"kind": "obs", "meta": {"n": 2}, "arrays": []})
    with pytest.raises(WireError, match="MAC"):
        decode([msgpack.packb(envelope), frames[1]], KEY)
    for field, other in (("seq", 1), ("sid", b"t" * 16)):  # the session and number are the MAC's key and nonce
        moved = {**msgpack.unpackb(frames[0]), field: other}
        with pytest.raises(WireError, match="MAC"):
            decode([msgpack.packb(moved), frames[1]], KEY)
    two = encode(Message("x", {}, {"a": np.zeros(4, np.int32), "b": np.ones(4, np.int32)}), KEY)
    with pytest.raises(WireError, match="MAC"):
        decode([two[0], two[2], two[1]], KEY)  # frames swapped: each is tagged at its place
    with pytest.raises(WireError, match="MAC"):  # small frames join the message's MAC input, length first
        decode([two[0], bytes(two[1]) + bytes(two[2])[:4], bytes(two[2])[4:]], KEY)
    large = [bytes(f) for f in encode(Message("x", {}, {"a": np.ones(OWN_TAG_BYTES, np.uint8)}), KEY)]
    decode(large, KEY)
    flipped = bytearray(large[1])
    flipped[-1] ^= 1
    with pytest.raises(WireError, match="MAC"):  # a large frame has its own tag
        decode([large[0], bytes(flipped)], KEY)
    with pytest.raises(WireError, match="envelope"):
        decode([b"\xc1garbage"], KEY)
    with pytest.raises(WireError, match="version"):
        decode([msgpack.packb({"v": 2})], KEY)


def test_signed_but_inconsistent_headers_are_rejected() -> None:
    """Even a holder of the key cannot make the receiver misread a frame."""
    from vlaslurm.runtime.transport import _mac

    def forge(specs: list[dict], frames: list[bytes]) -> list[bytes]:
        signed = msgpack.packb({"kind": "x", "meta": {}, "arrays": specs, "ch": ""})
        mac = _mac(KEY, signed, [memoryview(f) for f in frames], b"s", 0)
        return [msgpack.packb({"v": WIRE_VERSION, "sid": b"s", "seq": 0, "h": signed, "mac": mac}), *frames]

    with pytest.raises(WireError, match="not allowed"):
        decode(forge([{"name": "a", "dtype": "|O", "shape": [1]}], [b"\0" * 8]), KEY)
    with pytest.raises(WireError, match="header says"):
        decode(forge([{"name": "a", "dtype": "<f4", "shape": [3]}], [b"\0" * 8]), KEY)
    with pytest.raises(WireError, match="frames arrived"):
        decode(forge([], [b"\0" * 8]), KEY)


# --------------------------------------------------------------------------- sockets


def _echo_server(endpoint_queue: mp.Queue, key: bytes, count: int) -> None:
    with Router(key, name="echo") as server:
        endpoint_queue.put(server.bind(LOOPBACK))
        served = 0
        while served < count:
            got = server.recv(10_000)
            if got is None:
                return
            peer, message = got
            server.send(peer, Message("reply", {"peer": peer.decode(), **message.meta}, message.arrays))
            served += 1


def test_router_dealer_round_trip_across_processes() -> None:
    ctx = mp.get_context("spawn")
    endpoints: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_echo_server, args=(endpoints, KEY, 3))
    server.start()
    try:
        endpoint = endpoints.get(timeout=15)
        assert endpoint.startswith("tcp://127.0.0.1:")
        with Dealer(KEY, identity=b"simulator-7") as client:
            client.connect(endpoint)
            for step in range(3):
                sent = Message("obs", {"step": step}, sample_arrays())
                client.send(sent)
                reply = client.recv(10_000)
                assert reply is not None and reply.kind == "reply"
                assert reply.meta == {"peer": "simulator-7", "step": step}
                assert_same_arrays(reply.arrays, sent.arrays)
    finally:
        server.join(5)
        if server.is_alive():
            server.kill()
    assert server.exitcode == 0


def test_forged_messages_are_dropped_counted_and_logged(transport_log: LogRecords) -> None:
    with (
        Router(KEY) as server,
        Dealer(b"x" * 32, identity=b"intruder") as forger,
        Dealer(KEY, identity=b"honest") as honest,
    ):
        endpoint = server.bind(LOOPBACK)
        for sock in (forger, honest):
            sock.connect(endpoint)
        with RawStream(endpoint, identity=b"garbage") as raw:  # a keyless peer: no envelope, no MAC
            forger.send(Message("obs", {}, {"a": np.zeros(4, np.float32)}))
            raw.send([b"not msgpack", b"junk"])
            assert server.recv(500) is None  # both dropped; the wait went on to its deadline
            honest.send(Message("obs", {"ok": True}))
            got = server.recv(5_000)
    assert got is not None and got[0] == b"honest" and got[1].meta == {"ok": True}
    assert server.rejected == 2
    assert any(b"intruder".hex() in m and "MAC" in m for m in transport_log.messages)
    assert any(b"garbage".hex() in m and "envelope" in m for m in transport_log.messages)


def test_recv_times_out_with_none_and_bad_input_does_not_end_the_wait() -> None:
    with Pull(KEY) as pull, Push(b"z" * 32) as push:
        push.connect(pull.bind(LOOPBACK))
        push.send(Message("bad"))
        start = time.monotonic()
        assert pull.recv(300) is None
        assert time.monotonic() - start >= 0.25
        assert pull.rejected == 1


def test_router_refuses_unknown_peer_and_push_send_has_a_deadline() -> None:
    with Router(KEY) as server:
        server.bind(LOOPBACK)
        with pytest.raises(PeerUnreachable, match="nobody"):
            server.send(b"nobody", Message("x"))
    with Push(KEY, name="trajectories") as push:
        with pytest.raises(SendTimeout, match="trajectories"):
            push.send(Message("x"), timeout_ms=100)  # no peer ever connected


def _push_trajectories(endpoint: str, key: bytes, worker: int, count: int) -> None:
    with Push(key, name=f"sim{worker}") as push:
        push.connect(endpoint)
        for i in range(count):
            push.send(
                Message("traj", {"worker": worker, "i": i}, {"reward": np.full(5, worker * 100 + i, np.float32)}),
                timeout_ms=10_000,
            )


def test_push_pull_from_two_processes() -> None:
    ctx = mp.get_context("spawn")
    with Pull(KEY) as pull:
        endpoint = pull.bind(LOOPBACK)
        workers = [ctx.Process(target=_push_trajectories, args=(endpoint, KEY, w, 5)) for w in range(2)]
        for w in workers:
            w.start()
        got = []
        try:
            while len(got) < 10:
                message = pull.recv(15_000)
                assert message is not None, f"only {len(got)} of 10 trajectories arrived"
                got.append(message)
        finally:
            for w in workers:
                w.join(10)
    assert sorted((m.meta["worker"], m.meta["i"]) for m in got) == [(w, i) for w in range(2) for i in range(5)]
    for m in got:
        assert (m.arrays["reward"] == m.meta["worker"] * 100 + m.meta["i"]).all()


def test_pub_sub_and_poller() -> None:
    with Pub(KEY) as pub, Sub(KEY) as sub, Router(KEY) as idle:
        sub.connect(pub.bind(LOOPBACK))
        idle.bind(LOOPBACK)
        poller = Poller(sub, idle)
        deadline = time.monotonic() + 5
        ready: list = []
        while not ready and time.monotonic() < deadline:  # subscriptions propagate asynchronously
            pub.send(Message("version", {"version": 4}))
            ready = poller.poll(50)
        assert ready == [sub]
        message = sub.recv(0)
        assert message is not None and message.meta == {"version": 4}


def test_bind_address_choices() -> None:
    assert bind_address("127.0.0.1") == "127.0.0.1"
    assert bind_address("lo") == "127.0.0.1"
    assert bind_address("localhost") == "127.0.0.1"
    chosen = bind_address(None)
    with Pull(KEY) as pull:
        assert pull.bind(chosen).startswith(f"tcp://{chosen}:")
    with pytest.raises(ValueError, match="bind_address"):
        bind_address("no-such-host.invalid")
    with pytest.raises(ValueError, match="cannot be bound"):
        bind_address("192.0.2.1")  # TEST-NET-1: not an address of this machine


def test_short_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Router(b"short")


# --------------------------------------------------------------------------- secret


def test_secret_is_private_and_loadable(tmp_path: Path) -> None:
    key = create_secret(tmp_path)
    path = secret_path(tmp_path)
    assert len(key) == 32 and load_secret(tmp_path) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == key.hex()
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]
    with pytest.raises(FileExistsError):
        create_secret(tmp_path)
    assert ensure_secret(tmp_path) == key


def test_secret_stays_private_under_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        create_secret(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(secret_path(tmp_path).stat().st_mode) == 0o600


def test_load_secret_refuses_readable_or_missing_files(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="does not exist"):
        load_secret(tmp_path)
    create_secret(tmp_path)
    os.chmod(secret_path(tmp_path), 0o640)
    with pytest.raises(SecretError, match="mode 0640.*chmod 600"):
        load_secret(tmp_path)
    os.chmod(secret_path(tmp_path), 0o600)
    secret_path(tmp_path).write_text("zz")
    with pytest.raises(SecretError, match="hex"):
        load_secret(tmp_path)


def _ensure(run_dir: str, out: mp.Queue) -> None:
    out.put(ensure_secret(run_dir))


def test_concurrent_ensure_secret_agrees_on_one_key(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    keys = {out.get(timeout=15) for _ in procs}
    for p in procs:
        p.join(10)
    assert len(keys) == 1 and keys == {load_secret(tmp_path)}
