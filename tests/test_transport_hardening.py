"""The signed transport against a process on the cluster that lacks the run secret: real ZeroMQ sockets
on 127.0.0.1 and a real local run, no mocks.

Each channel has its own key, so a message recorded on one (the trainer's announcements, which anyone
may subscribe to) fails on another; a message replayed on its own channel, or one far older than the
newest of its sender, is refused; a socket refuses kinds it does not take and contents its kind's
decoder does not accept; receiving sockets refuse oversized frames before buffering them; routing ids
cannot be guessed. Every refusal is counted (by reason) and logged, and the rank goes on serving. The
real run also has its TCPStore tampered with (tests/test_store_hardening.py has the store's own tests).
"""

from __future__ import annotations

import json
import os
import re
import resource
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
import zmq
from conftest import LogRecords
from runtime_helpers import RawStream, check_trained_versions, raw_stream_send, run_spec, synthetic_spec, wait_for

from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime.transport import (
    Dealer,
    Message,
    Pub,
    Pull,
    Push,
    ReplayGuard,
    Router,
    channel_key,
    encode,
    rejection_counts,
    routing_id,
)
from vlaslurm.spec.env_types import EnvConfig, ObsConfig

SECRET = bytes(range(32))
LOOPBACK = "127.0.0.1"


def raw_socket(kind: int) -> zmq.Socket:
    """A keyless process's socket: plain ZeroMQ, no secret."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def recorded_announcement(pub: Pub) -> list[bytes]:
    """What a keyless subscriber of the trainer's announcements records (the replay of issue 19)."""
    spy = raw_socket(zmq.SUB)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    spy.connect(pub.endpoints[0])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # subscriptions propagate asynchronously
            pub.send(msgs.ctl(3, 100, False))
            if spy.poll(50):
                return spy.recv_multipart()
        raise AssertionError("the spy never heard an announcement")
    finally:
        spy.close()


def recorded_push(message: Message, channel: str) -> list[bytes]:
    """The frames an honest Push of `channel` sends, as a keyless process listening in records them."""
    tap = raw_socket(zmq.PULL)
    try:
        port = tap.bind_to_random_port(f"tcp://{LOOPBACK}")
        with Push(SECRET, channel=channel) as push:
            push.connect(f"tcp://{LOOPBACK}:{port}")
            push.send(message, timeout_ms=5000)
            assert tap.poll(5000)
            return tap.recv_multipart()
    finally:
        tap.close()


def replay(frames: list[bytes], endpoint: str, kind: int = zmq.PUSH, times: int = 1) -> None:
    replay_in_order([frames] * times, endpoint, kind)


def replay_in_order(messages: list[list[bytes]], endpoint: str, kind: int = zmq.PUSH) -> None:
    """`messages` through one connection, so they arrive in this order (a PULL fair-queues between connections)."""
    sock = raw_socket(kind)
    sock.setsockopt(zmq.LINGER, 10_000)  # delivered in the background, even to a slow peer
    try:
        sock.connect(endpoint)
        for frames in messages:
            sock.send_multipart(frames)
    finally:
        sock.close()


def offloaded(version: int = 1) -> Message:
    return msgs.offloaded(version, "generator", 0)


# --------------------------------------------------------------------------- channels


def test_a_message_signed_for_one_channel_is_refused_on_another(transport_log: LogRecords) -> None:
    """The issue's replay: a recorded announcement sent into a generator's request socket. Same secret,
    different channel: the MAC fails, and the generator's socket goes on serving."""
    channels = msgs.generator_channels("job-r0", 0, 1234)
    with (
        Pub(SECRET, channel=msgs.channel("job-r0", msgs.CTL)) as pub,
        Router(SECRET, **channels, accepts=msgs.GENERATOR_INTAKE) as router,
        Dealer(SECRET, **channels) as honest,
    ):
        pub.bind(LOOPBACK)
        endpoint = router.bind(LOOPBACK)
        recorded = recorded_announcement(pub)
        raw_stream_send(endpoint, [recorded])
        assert router.recv(500) is None
        assert router.rejections == {"mac": 1}
        honest.connect(endpoint)
        honest.send(msgs.encode_obs(obs_request()))
        got = router.recv(5000)
    assert got is not None and msgs.decode_obs(got[1]).env_ids == [0, 1]
    assert channel_key(SECRET, "a") != channel_key(SECRET, "b")
    assert any("bad MAC" in m for m in transport_log.messages)
    # Another generator's channel, a restarted generator's (another pid), another attempt of the job: all differ.
    names = {
        msgs.generator_channels("job-r0", 1, 1234)["channel"],
        msgs.generator_channels("job-r0", 0, 99)["channel"],
        msgs.generator_channels("job-r1", 0, 1234)["channel"],
        channels["channel"],
        channels["reply_channel"],
    }
    assert len(names) == 5


def test_replays_on_the_same_channel_are_refused_and_counted(transport_log: LogRecords) -> None:
    channel = msgs.channel("job-r0", "segments")
    recorded = recorded_push(offloaded(), channel)
    with Pull(SECRET, channel=channel, accepts=msgs.TRAINER_INTAKE) as pull:
        endpoint = pull.bind(LOOPBACK)
        replay(recorded, endpoint, times=3)
        first = pull.recv(5000)
        assert first is not None and first.kind == msgs.OFFLOADED  # it was never delivered here before
        assert pull.recv(500) is None  # the two repeats
    assert pull.rejections == {"replay": 2}
    assert rejection_counts(pull) == {"rejected_messages": 2, "rejected_replay": 2}
    assert any("repeated message 0 of sender session" in m for m in transport_log.messages)


def test_sequences_out_of_the_window_are_refused() -> None:
    channel = msgs.channel("job-r0", "segments")
    key = channel_key(SECRET, channel)
    session = os.urandom(16)

    def signed(seq: int) -> list:
        return encode(offloaded(seq), key, channel=channel, session=session, seq=seq)

    with Pull(SECRET, channel=channel, accepts=msgs.TRAINER_INTAKE) as pull:
        push = raw_socket(zmq.PUSH)  # replays what a key holder sent, in an order it chose
        push.connect(pull.bind(LOOPBACK))
        try:
            for seq in (5000, 4990, 1, 4990, 5001, 5001 - 1023, 5001 - 1024):
                push.send_multipart(signed(seq))
            got = [pull.recv(2000) for _ in range(4)]
            assert pull.recv(300) is None
        finally:
            push.close()
    assert [m.meta["version"] for m in got if m is not None] == [5000, 4990, 5001, 5001 - 1023]
    assert pull.rejections == {"out_of_window": 2, "replay": 1}


def test_replay_guard_windows_each_session_apart() -> None:
    guard = ReplayGuard(window=8, max_sessions=2)
    assert [guard.check(b"a", n) for n in (0, 1, 3, 2, 3, 0)] == [None, None, None, None, "replay", "replay"]
    assert guard.check(b"a", 20) is None and guard.check(b"a", 12) == "out_of_window"
    assert guard.check(b"a", 13) is None and guard.check(b"a", 13) == "replay"
    assert guard.check(b"b", 0) is None and guard.check(b"b", 0) == "replay"  # sessions are apart
    assert guard.check(b"c", 0) is None  # a third session forgets the least recently heard, "a"
    assert guard.check(b"b", 0) == "replay" and guard.check(b"a", 20) is None


def test_every_socket_signs_with_its_own_session_and_numbers() -> None:
    channel = msgs.channel("job-r0", "segments")
    with Pull(SECRET, channel=channel) as pull, Push(SECRET, channel=channel) as a, Push(SECRET, channel=channel) as b:
        endpoint = pull.bind(LOOPBACK)
        for push in (a, b):
            push.connect(endpoint)
            for _ in range(3):
                push.send(offloaded(), timeout_ms=5000)
        got = [pull.recv(5000) for _ in range(6)]
    assert all(m is not None for m in got) and pull.rejected == 0
    assert a.session != b.session and len(a.session) == 16


# --------------------------------------------------------------------------- kinds and contents


def obs_request(env_ids=(0, 1)) -> msgs.ObsRequest:
    from vlaslurm.envs.base import Observation

    n = len(env_ids)
    obs = Observation(np.zeros((n, 1, 4, 4, 3), np.uint8), np.zeros((n, 3), np.float32), ["go"] * n)
    return msgs.ObsRequest(list(env_ids), [0] * n, [0] * n, [7] * n, obs, 0, 0, sim_rank=0)


def test_wrong_kinds_and_bad_contents_are_refused_and_counted(transport_log: LogRecords) -> None:
    """Signed for the right channel, even: a kind the socket does not take, and an `obs` whose meta or
    arrays its decoder refuses, are counted rejections; the socket then serves an honest request."""
    channels = msgs.generator_channels("job-r0", 0, 1)
    bad_meta = msgs.encode_obs(obs_request())
    del bad_meta.meta["seeds"]
    short = msgs.encode_obs(obs_request())
    short.arrays["images"] = short.arrays["images"][:1]
    with (
        Router(SECRET, **channels, accepts=msgs.GENERATOR_INTAKE) as router,
        Dealer(SECRET, **channels) as client,
    ):
        client.connect(router.bind(LOOPBACK))
        for message in (msgs.ctl(1, 0, True), msgs.sim_done(0, 1, 1), bad_meta, short, Message(msgs.OBS, {"x": 1})):
            client.send(message)
        client.send(msgs.encode_obs(obs_request([4, 5])))
        got = router.recv(5000)
        assert router.recv(200) is None
    assert got is not None and msgs.decode_obs(got[1]).env_ids == [4, 5]
    assert router.rejections == {"kind": 2, "content": 3}
    assert rejection_counts(router)["rejected_messages"] == 5
    assert any("kind 'ctl' is not taken here" in m for m in transport_log.messages)
    assert any("'seeds' is not a list" in m for m in transport_log.messages)
    assert any("expected 2 rows" in m for m in transport_log.messages)


def assert_counts_are_checked(message: Message, decode_all, decode_one, what: str) -> None:
    """`message` holds three items over four rows: counts that do not split the rows are refused, and so is
    reading it as a message of one."""
    from vlaslurm.runtime.transport import WireError

    lying = Message(message.kind, {**message.meta, "counts": [1, 1, 1]}, message.arrays)
    with pytest.raises(WireError, match="do not split"):
        decode_all(lying)
    with pytest.raises(WireError, match=f"3 {what} where one was expected"):
        decode_one(message)


def test_one_act_message_carries_a_forwards_replies_to_one_simulator() -> None:
    """A forward answers all requests of one simulator in one message; the simulator reads each reply with its
    rows, and the decoding its socket did to check the message is the one the role gets (not a second one)."""

    def reply(env_ids: list, group: int, version: int = 3) -> msgs.ActReply:
        n = len(env_ids)
        rows = np.arange(n, dtype=np.float32) + env_ids[0]
        return msgs.ActReply(
            env_ids, group, version, np.tile(rows[:, None, None], (1, 4, 2)), np.tile(rows[:, None], (1, 4)), rows,
            1, np.zeros((n, 4, 2), np.float32), {"path": np.tile(rows[:, None], (1, 5))},
        )  # fmt: skip

    sent = [reply([4], 4), reply([7, 8], 0), reply([2], 2)]
    channels = msgs.generator_channels("job-r0", 1, 1)
    with Router(SECRET, **channels) as router, Dealer(SECRET, **channels, accepts=msgs.REPLIES) as sim:
        sim.connect(router.bind(LOOPBACK))
        sim.send(msgs.encode_obs(obs_request()))
        peer, _ = router.recv(5000)
        router.send(peer, msgs.encode_acts(sent))
        got = sim.recv(5000)
    assert got is not None and msgs.decode_acts(got) is got.decoded  # the socket's check, kept
    back = msgs.decode_acts(got)
    assert [(r.env_ids, r.sub_group, r.version, r.gen_rank) for r in back] == [
        ([4], 4, 3, 1),
        ([7, 8], 0, 3, 1),
        ([2], 2, 3, 1),
    ]
    for b, s in zip(back, sent):
        for name in ("actions", "logprob", "value", "token_logprob"):
            np.testing.assert_array_equal(getattr(b, name), getattr(s, name))
        np.testing.assert_array_equal(b.replay["path"], s.replay["path"])
    with pytest.raises(ValueError, match="one forward"):
        msgs.encode_acts([reply([1], 0), reply([2], 0, version=4)])
    assert_counts_are_checked(msgs.encode_acts(sent), msgs.decode_acts, msgs.decode_act, "replies")


def test_one_obs_message_carries_a_simulators_requests_to_one_generator() -> None:
    """Requests sent together (async environments whose steps ended at once) travel in one message; the
    generator reads each with its own rows, sub-group and version, as the socket's check decoded them."""

    def request(env_ids: list, group: int, min_version: int) -> msgs.ObsRequest:
        req = obs_request(env_ids)
        req.obs.images[:] = env_ids[0]  # type: ignore[index]
        req.obs.state[:] = np.asarray(env_ids, np.float32)[:, None]  # type: ignore[index]
        req.sub_group, req.min_version, req.sim_rank, req.sent_at = group, min_version, 2, 1.5
        return req

    sent = [request([4], 4, 0), request([7, 8], 0, 2), request([2], 2, 1)]
    channels = msgs.generator_channels("job-r0", 1, 1)
    with (
        Router(SECRET, **channels, accepts=msgs.GENERATOR_INTAKE) as router,
        Dealer(SECRET, **channels) as sim,
    ):
        sim.connect(router.bind(LOOPBACK))
        sim.send(msgs.encode_requests(sent))
        got = router.recv(5000)
        assert router.recv(200) is None  # one message
    assert got is not None and msgs.decode_requests(got[1]) is got[1].decoded  # the socket's check, kept
    back = msgs.decode_requests(got[1])
    assert [(r.env_ids, r.sub_group, r.min_version, r.sim_rank, r.sent_at) for r in back] == [
        ([4], 4, 0, 2, 1.5),
        ([7, 8], 0, 2, 2, 1.5),
        ([2], 2, 1, 2, 1.5),
    ]
    for b, s in zip(back, sent):
        np.testing.assert_array_equal(b.obs.images, s.obs.images)
        np.testing.assert_array_equal(b.obs.state, s.obs.state)
        assert (b.episodes, b.steps, b.seeds, b.obs.instructions) == (s.episodes, s.steps, s.seeds, s.obs.instructions)
    with pytest.raises(ValueError, match="one simulator rank"):
        msgs.encode_requests([request([1], 1, 0), obs_request([3])])
    assert_counts_are_checked(msgs.encode_requests(sent), msgs.decode_requests, msgs.decode_obs, "requests")


def test_every_decoder_refuses_bad_contents_with_a_wire_error() -> None:
    from vlaslurm.runtime.transport import WireError

    intakes = (msgs.TRAINER_INTAKE, msgs.GENERATOR_INTAKE, msgs.EVAL_GENERATOR_INTAKE, msgs.REPLIES, msgs.ANNOUNCEMENTS)
    for decoders in intakes:
        for name, decode in decoders.items():
            with pytest.raises(WireError):
                decode(Message(name, {"sim_rank": "0", "env_ids": [None], "version": None}))


# --------------------------------------------------------------------------- sizes


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_oversized_frames_are_refused_without_buffering_them() -> None:
    """The receiver's peak memory does not grow by the frame (without the limit it grows by all of it: the
    frame is read, then rejected), and nothing reaches the socket's reader; an honest sender goes on."""
    limit, size = 1 << 20, 96 << 20
    big = np.ones(size, np.uint8)  # touched in the sender's memory (this process) before the baseline
    with Pull(SECRET, channel="segments", max_frame_bytes=limit) as pull, Push(SECRET, channel="segments") as honest:
        endpoint = pull.bind(LOOPBACK)
        attacker = raw_socket(zmq.PUSH)
        try:
            attacker.connect(endpoint)
            peak, now = _peak_rss_bytes(), _rss_bytes()
            attacker.send_multipart([b"x", memoryview(big)], copy=False)
            assert pull.recv(1000) is None  # the peer is disconnected as the frame's size is read
            grown = _peak_rss_bytes() - max(peak, now)
        finally:
            attacker.close()
        assert pull.rejected == 0  # refused by ZeroMQ before anything reached the reader
        honest.connect(endpoint)
        honest.send(Message("ok", {}, {"a": np.zeros(limit // 2, np.uint8)}), timeout_ms=5000)
        got = pull.recv(5000)
    assert got is not None and got.kind == "ok"
    if peak < now + size // 2:  # else an earlier peak of this process hides what the frame would add
        assert grown < size // 4, f"the receiver's peak grew by {grown / 2**20:.0f} MiB: the frame was buffered"


def test_the_frame_bound_follows_the_spec_with_a_floor() -> None:
    state_only = EnvConfig(type="x", num_envs=4, obs=ObsConfig(image_size=0))
    assert msgs.max_frame_bytes(state_only) >= msgs.FRAME_FLOOR_BYTES
    images = EnvConfig(type="x", num_envs=256, obs=ObsConfig(image_size=224, cameras=["a", "b"]))
    request = 256 * 2 * 224 * 224 * 3  # every environment's images in one request
    segment = (msgs.MAX_SEGMENT_STEPS + 1) * 2 * 224 * 224 * 3
    assert msgs.max_frame_bytes(images, 8) >= 2 * max(request, segment)
    small = EnvConfig(type="x", num_envs=4, obs=ObsConfig(image_size=224, cameras=["a", "b"]))
    assert msgs.max_frame_bytes(small) >= 2 * segment


# --------------------------------------------------------------------------- routing ids


def test_routing_ids_are_unpredictable() -> None:
    ids = {routing_id("simulator-0") for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(rb"simulator-0-[0-9a-f]{24}", i) for i in ids)  # 96 random bits each
    with (
        Router(SECRET) as router,
        Dealer(SECRET, name="obs->generator[0]") as a,
        Dealer(SECRET, name="obs->generator[0]") as b,
    ):
        assert a.identity != b.identity
        a.connect(router.bind(LOOPBACK))
        a.send(Message("obs"))
        got = router.recv(5000)
        assert got is not None and got[0] == a.identity  # the id the Router routes replies by


def test_a_squatter_cannot_take_a_simulators_replies() -> None:
    """Squatting needs the id before the simulator connects: the old `simulator-<rank>-<pid>` could be
    guessed; a squatter holding it now gets nothing, and the simulator's own id is served."""
    channels = msgs.generator_channels("job-r0", 0, 1)
    with Router(SECRET, **channels) as router, Dealer(SECRET, identity=routing_id("simulator-0"), **channels) as sim:
        endpoint = router.bind(LOOPBACK)
        with RawStream(endpoint, identity=f"simulator-0-{os.getpid()}".encode()) as squatter:
            time.sleep(0.2)
            sim.connect(endpoint)
            sim.send(msgs.encode_obs(obs_request()))
            got = router.recv(5000)
            assert got is not None and got[0] == sim.identity
            router.send(got[0], Message(msgs.ACT))
            assert sim.recv(5000) is not None
            assert not squatter.has_input(0.2)


# --------------------------------------------------------------------------- a real run


def _member(run_dir: Path, role: str) -> tuple[str, dict]:
    files = list((run_dir / "rendezvous").glob(f"*/{role}-0.json"))
    return (files[0].parent.name, json.loads(files[0].read_text())) if files else ("", {})


class StoreTamperer(threading.Thread):
    """A foreign TCPStore client (no secret) on trainer[0]'s store during the run. It finds the weight
    handshake's key names with `list_keys()` and, every 50 ms: forges the `ready` and `go` flags of versions
    4 to 8 ahead of the newest `go` (keys the run will wait on; far enough ahead that the honest writer
    cannot have set them yet, so its `set` replaces them), and deletes the `ready` flags of the newest
    `go`'s version when it catches them (consumed: the trainer waited on them before it set `go`, and
    deletes them itself after the broadcast). At the start it deletes c10d's own keys (consumed when the
    world formed) and floods the store with 4000 keys."""

    def __init__(self, address: str, port: int) -> None:
        super().__init__(daemon=True)
        self.foreign: Any = dist.TCPStore(  # Any: c10d takes bytes values and has multi_set; the stubs say neither
            address, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
        self.done = threading.Event()
        self.forged: set[str] = set()
        self.deleted: list[str] = []
        self.error = ""

    def run(self) -> None:
        try:
            base = wait_for(
                lambda: next((n for n in self.foreign.list_keys() if n.endswith("/announce")), ""),
                20,
                "the weight announcement",
            )
            base = base.removesuffix("announce")
            prefix = base.split("/", 1)[0]
            for name in self.foreign.list_keys():
                if not name.startswith(base):  # c10d's gloo addresses and store barriers: read once, at the start
                    self._remove(name)
            for outside in ("", prefix + "/"):
                self.foreign.multi_set([f"{outside}flood/{i}" for i in range(2000)], [b"x" * 64] * 2000)
            while not self.done.wait(0.05):
                self._round(base)
        except (RuntimeError, AssertionError) as err:  # e.g. the run ended (and its store) before `done`
            self.error = str(err)

    def _round(self, base: str) -> None:
        names = set(self.foreign.list_keys())
        gos = [int(n.rsplit("/", 1)[1]) for n in names if n.startswith(base + "go/") and n not in self.forged]
        if not gos:
            return
        newest = max(gos)
        for name in names:
            if name.startswith(f"{base}ready/{newest}/"):
                self._remove(name)
        for version in range(newest + 4, newest + 9):
            for key in (f"go/{version}", *(f"ready/{version}/{rank}" for rank in (1, 2))):
                if base + key not in self.forged:
                    self.foreign.set(base + key, os.urandom(48))
                    self.forged.add(base + key)

    def _remove(self, name: str) -> None:
        if self.foreign.delete_key(name):
            self.deleted.append(name)


def test_a_running_job_survives_replays_wrong_kinds_and_counts_them(tmp_path: Path) -> None:
    """During a real local run: the trainer's recorded announcement replayed into the generator (the
    crash of issue 19), a wrong kind signed for the generator's own channel, a repeated and an
    out-of-window report into the trainer's intake, an oversized frame into each, and the store
    tampering of `StoreTamperer`. The run completes, its ledger agrees with the versions the generator
    served, and every rank counts what it refused in `counters/`."""
    spec = synthetic_spec("async", total_env_steps=6000, max_staleness=100)
    run_dir = tmp_path / "run"
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run=run_spec(tmp_path, spec, timeout_s=120)))
    runner.start()
    tamperer: StoreTamperer | None = None
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 90, "first update")
        job_key, gen = _member(run_dir, "generator")
        _, trainer = _member(run_dir, "trainer")
        gen_endpoint = f"tcp://{gen['address']}:{gen['ports']['obs']}"
        intake = f"tcp://{trainer['address']}:{trainer['ports']['segments']}"
        secret = bytes.fromhex((run_dir / "secret").read_text().strip())
        tamperer = StoreTamperer(trainer["address"], trainer["ports"]["store"])
        tamperer.start()

        spy = raw_socket(zmq.SUB)  # keyless: anyone may subscribe to the announcements
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        spy.connect(f"tcp://{trainer['address']}:{trainer['ports']['ctl']}")
        assert spy.poll(10_000), "no announcement heard"
        recorded = spy.recv_multipart()
        spy.close()
        raw_stream_send(gen_endpoint, [recorded] * 3)

        channels = msgs.generator_channels(job_key, 0, gen["pid"])
        with Dealer(secret, **channels, name="confused") as confused:  # a key holder's mistake: wrong kind
            confused.connect(gen_endpoint)
            confused.send(msgs.ctl(0, 0, True), timeout_ms=5000)
            time.sleep(0.3)

        segments = msgs.channel(job_key, "segments")
        key = channel_key(secret, segments)
        session = os.urandom(16)
        report = [encode(offloaded(10_000 + n), key, channel=segments, session=session, seq=n) for n in (2000, 1)]
        # Once taken (a harmless report), once a replay, then one far below the newest of its session.
        replay_in_order([report[0], report[0], report[1]], intake)

        raw_stream_send(gen_endpoint, [[bytes(32 << 20)]])  # well past the spec's bound: refused unread
        replay([bytes(32 << 20)], intake, zmq.PUSH)
        wait_for(lambda: len(tamperer.forged) >= 30, 30, "thirty forged weight flags")
    finally:
        if tamperer is not None:
            tamperer.done.set()
            tamperer.join(15)
        runner.join(150)
    run = result["run"]
    assert run.rc == 0, run.log("generator", 0)[-3000:] + run.log("trainer", 0)[-3000:]
    assert tamperer is not None and not tamperer.error, tamperer and tamperer.error
    assert any("//cpu//" in name for name in tamperer.deleted), tamperer.deleted[:5]  # c10d's gloo keys
    check_trained_versions(run, max_staleness=100)
    (generator,) = run.counters("generator")
    (trainer_counters,) = run.counters("trainer")
    assert generator["rejected_mac"] >= 3 and generator["rejected_kind"] >= 1, generator
    assert trainer_counters["rejected_replay"] >= 1 and trainer_counters["rejected_out_of_window"] >= 1
    assert trainer_counters["rejected_messages"] >= 2
    assert trainer_counters["rejected_store_values"] >= 1 and generator["rejected_store_values"] >= 1
    # Read and then refused, the oversized frames would be `malformed` rejections: the generator's Router
    # refused its frame from the length ahead of it (`oversized`), ZeroMQ dropped the trainer's unread.
    assert generator["rejected_oversized"] == 1, generator
    assert "rejected_malformed" not in generator and "rejected_malformed" not in trainer_counters
    gen_log = run.log("generator", 0)
    assert "bad MAC" in gen_log and "kind 'ctl' is not taken here" in gen_log
    assert "Traceback" not in gen_log
    assert "repeated message" in run.log("trainer", 0)
    assert "holds a value not sealed with this run's secret" in run.log("trainer", 0)
