"""Authenticated, pickle-free messages over ZeroMQ.

A `Message` is a kind, a small msgpack-able `meta` dict and named numpy arrays, sent as a signed
header frame and one raw frame per array, authenticated with AES-256-GMAC (`_Sealer`). Each channel
has its own key derived from the run secret, each sending socket a random session (its own subkey) and
numbers its messages (the nonce); the signed header names the channel: receivers drop and count (by
reason) messages that are malformed, forged, meant for another channel, of a kind the socket does not
take, or replayed. Receiving sockets refuse frames larger than their `max_frame_bytes` before
buffering them; received arrays are read-only views. Sockets are not thread-safe: use each one from a
single thread.
Details (wire format): docs/runtime.md
"""

from __future__ import annotations

import functools
import hmac
import itertools
import logging
import math
import secrets
import select
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, Optional, Sequence, TypeVar

import msgpack
import numpy as np
import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vlaslurm.rundir.secret import derive_key
from vlaslurm.runtime import stream
from vlaslurm.runtime.netaddr import bind_address

log = logging.getLogger("vlaslurm.transport")

__all__ = [
    "ALLOWED_DTYPES",
    "Message",
    "WireError",
    "TransportError",
    "SendTimeout",
    "PeerUnreachable",
    "Origin",
    "ReplayGuard",
    "channel_key",
    "routing_id",
    "rejection_counts",
    "encode",
    "socket_encoder",
    "decode",
    "decode_signed",
    "Router",
    "Dealer",
    "Push",
    "Pull",
    "Pub",
    "Sub",
    "Poller",
    "bind_address",
]

WIRE_VERSION = 4
MAC_BYTES = 16
OWN_TAG_BYTES = 16 << 10  # array frames this large get a tag of their own; smaller ones join the message's
SESSION_BYTES = 16
MAX_SESSION_BYTES = 64
REPLAY_WINDOW = 1024  # sequence numbers per sender session below the highest seen that may still arrive
MAX_SESSIONS = 4096  # sender sessions a receiving socket remembers (the least recently heard go first)
DEFAULT_CHANNEL = "default"
REJECT_REASONS = ("malformed", "oversized", "mac", "channel", "kind", "replay", "out_of_window", "content")
MIN_KEY_BYTES = 16
ALLOWED_DTYPES = frozenset(
    np.dtype(name).newbyteorder("<").str
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)
"""Little-endian dtype strings (``np.dtype.str``) that may travel; everything else is refused."""

DEFAULT_LINGER_MS = 200
DEFAULT_SEND_TIMEOUT_MS = 120_000
QUEUED_BYTES = 64 << 20  # a stream sender blocks while a connection holds more than this (or two frames)
# A Dealer's connect blocks its thread (no I/O thread to hand it to) at most this long; a LAN peer answers in
# under a millisecond, and one that does not is tried again after the back-off.
CONNECT_TIMEOUT_S = 1.0
ACCEPT_PAUSE_S = 0.1  # a Router stops listening this long after an accept failed (out of descriptors)
RECONNECT_S = (0.1, 2.0)  # a Dealer's first and longest wait between attempts to connect
_LOG_FIRST_REJECTS = 10
_LOG_EVERY_REJECTS = 1000


class WireError(ValueError):
    """A received message is malformed, not authentic, or not for the socket; `reason` names which
    (one of `REJECT_REASONS`)."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class TransportError(RuntimeError):
    """A socket operation failed (bind, send)."""


class SendTimeout(TransportError):
    """A send could not be queued before its deadline (peer absent or not reading)."""


class PeerUnreachable(TransportError):
    """A Router was asked to send to a peer it is not connected to."""


@dataclass
class Message:
    """One message: `kind` says what it is, `meta` small msgpack-able data, `arrays` the payload."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # What the receiving socket's check of this kind returned, and that check: a decoder that is the check reads
    # it instead of decoding again (`messages` decoders do).
    decoded: Any = field(default=None, repr=False, compare=False)
    decoded_by: Optional[Callable[[Message], object]] = field(default=None, repr=False, compare=False)


# --------------------------------------------------------------------------- encoding


def channel_key(secret: bytes, channel: str) -> bytes:
    """The key that signs `channel`'s messages: a message signed for one channel fails on every other."""
    return derive_key(_check_key(secret), f"vlaslurm.transport:{channel}")


def routing_id(label: str) -> bytes:
    """A Dealer's routing id: `label` (for the logs) and 96 random bits, so no other process can claim it
    first and take the replies (a Router refuses a second peer with an id it already has)."""
    return f"{label[:200]}-{secrets.token_hex(12)}".encode()


def _wire_array(name: str, array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in ALLOWED_DTYPES:
        raise ValueError(f"array {name!r} has dtype {array.dtype}; allowed: {sorted(ALLOWED_DTYPES)}")
    return np.asarray(array, dtype=dtype, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d


def _raw(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data  # the array's buffer, as memoryview(...) gives it


class _Sealer:
    """AES-256-GMAC of one sender session's messages: GCM that encrypts nothing and authenticates everything.

    The session's key is derived from the channel key and the session id, and a message's number and a frame's
    index make the 96-bit nonce, so no (key, nonce) pair ever authenticates two different inputs (GCM's one
    rule: the sender never reuses a number; a forger cannot make it). A large array frame gets its own tag
    (no copy of it); the message's MAC is the tag of (session, number, signed header, then per frame its tag
    or, for a small one, its length and bytes), every variable-length part length-prefixed. One GCM call per
    message and per large frame: each call costs ~1 us before its first byte, the bytes ~0.06 us per KB (AES-NI,
    PCLMUL; ~9 us for a 150 KB image where HMAC-SHA256 took ~90 us). Strength: a 128-bit tag, a forgery
    succeeds with probability about (message blocks) / 2^128 per try.
    """

    def __init__(self, channel_key: bytes, session: bytes) -> None:
        self.session = session
        self._aead = AESGCM(derive_key(channel_key, "vlaslurm.transport.session:" + session.hex()))

    def mac(self, seq: int, signed: bytes, frames: Sequence[memoryview]) -> bytes:
        number = seq.to_bytes(8, "little")
        parts: list[Any] = [len(self.session).to_bytes(1, "little"), self.session, number]
        parts += [len(signed).to_bytes(8, "little"), signed, len(frames).to_bytes(4, "little")]
        for i, frame in enumerate(frames):
            if frame.nbytes >= OWN_TAG_BYTES:
                parts += [b"t", self._tag(number, i + 1, frame)]
            else:
                parts += [b"b", frame.nbytes.to_bytes(8, "little"), frame]
        return self._tag(number, 0, b"".join(parts))

    def _tag(self, number: bytes, index: int, data: Any) -> bytes:
        return self._aead.encrypt(number + index.to_bytes(4, "little"), b"", data)


@functools.lru_cache(maxsize=MAX_SESSIONS)
def _sealer(key: bytes, session: bytes) -> _Sealer:
    """The sealer of `session` under channel key `key`, kept for the sessions heard most recently."""
    return _Sealer(key, session)


def _mac(key: bytes, signed: bytes, frames: Sequence[memoryview], session: bytes, seq: int) -> bytes:
    return _sealer(key, session).mac(seq, signed, frames)


@dataclass(frozen=True)
class Origin:
    """Who signed a message: its channel, the sending socket's session and the message's number in it."""

    channel: str
    session: bytes
    seq: int


def encode(
    message: Message, key: bytes, *, channel: str = "", session: Optional[bytes] = None, seq: int = 0
) -> list[Any]:
    """The frames of `message`, signed with `key` (frame 0 bytes, then array buffers). `channel` travels in
    the signed header, the sender's `session` and the message's number `seq` beside it, authenticated by the
    MAC (a socket fills them in; without a session, a fresh one: a session never numbers two messages alike)."""
    session = secrets.token_bytes(SESSION_BYTES) if session is None else session
    if not 0 <= seq < 2**64 or len(session) > MAX_SESSION_BYTES:
        raise ValueError(f"seq must be in [0, 2**64) and a session at most {MAX_SESSION_BYTES} bytes")
    arrays = {name: _wire_array(name, a) for name, a in message.arrays.items()}
    specs = [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays.items()]
    signed = msgpack.packb(
        {"kind": message.kind, "meta": message.meta, "arrays": specs, "ch": channel}, use_bin_type=True
    )
    raws = [_raw(a) for a in arrays.values()]
    mac = _mac(key, signed, raws, session, seq)
    envelope = msgpack.packb(
        {"v": WIRE_VERSION, "sid": session, "seq": seq, "h": signed, "mac": mac}, use_bin_type=True
    )
    return [envelope, *raws]


def socket_encoder(key: bytes, channel: str = "") -> Callable[[Message], list[Any]]:
    """`encode` as one sending socket signs: one session, its messages numbered (costs per message as a
    socket's: the session's key is derived once)."""
    session, numbers = secrets.token_bytes(SESSION_BYTES), itertools.count()
    return lambda message: encode(message, key, channel=channel, session=session, seq=next(numbers))


def _unpack_envelope(frame0: bytes) -> tuple[bytes, bytes, bytes, int]:
    try:
        envelope = msgpack.unpackb(frame0, raw=False, max_array_len=0, max_map_len=8)
    except Exception as err:  # msgpack raises several types for garbage
        raise WireError(f"undecodable envelope ({type(err).__name__})") from None
    if not isinstance(envelope, dict) or envelope.get("v") != WIRE_VERSION:
        version = envelope.get("v") if isinstance(envelope, dict) else None
        raise WireError(f"unsupported wire version {version!r} (expected {WIRE_VERSION})")
    signed, mac, session, seq = envelope.get("h"), envelope.get("mac"), envelope.get("sid"), envelope.get("seq")
    if not isinstance(signed, bytes) or not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
        raise WireError("envelope lacks a signed header or a MAC")
    if not isinstance(session, bytes) or len(session) > MAX_SESSION_BYTES:
        raise WireError("envelope lacks a sender session")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**64:
        raise WireError("envelope lacks a message number")
    return signed, mac, session, seq


def _array_from(spec: Any, frame: memoryview) -> tuple[str, np.ndarray]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise WireError("bad array spec")
    name, dtype, shape = spec["name"], spec.get("dtype"), spec.get("shape")
    if dtype not in ALLOWED_DTYPES:
        raise WireError(f"array {name!r}: dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireError(f"array {name!r}: bad shape {shape!r}")
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if frame.nbytes != expected:
        raise WireError(f"array {name!r}: frame has {frame.nbytes} bytes, header says {expected}")
    return name, np.frombuffer(frame, dtype=dtype).reshape(shape)


def decode_signed(frames: Sequence[Any], key: bytes) -> tuple[Message, Origin]:
    """The message in `frames` and who signed it; WireError if malformed or forged."""
    if not frames:
        raise WireError("empty message")
    buffers = [memoryview(f.buffer if isinstance(f, zmq.Frame) else f).cast("B") for f in frames]
    signed, mac, session, seq = _unpack_envelope(bytes(buffers[0]))
    if not hmac.compare_digest(mac, _mac(key, signed, buffers[1:], session, seq)):
        raise WireError("bad MAC (wrong run secret, another channel's key, or a tampered message)", reason="mac")
    try:
        header = msgpack.unpackb(signed, raw=False)
    except Exception as err:  # signed by a key holder, yet not msgpack: still never a crash
        raise WireError(f"undecodable signed header ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise WireError("signed header is not a map")
    specs = header.get("arrays")
    if (
        not isinstance(header.get("kind"), str)
        or not isinstance(header.get("meta"), dict)
        or not isinstance(specs, list)
        or not isinstance(header.get("ch"), str)
    ):
        raise WireError("signed header lacks kind/meta/arrays/ch")
    if len(specs) != len(buffers) - 1:
        raise WireError(f"header lists {len(specs)} arrays but {len(buffers) - 1} frames arrived")
    arrays = dict(_array_from(spec, buf) for spec, buf in zip(specs, buffers[1:]))
    return Message(kind=header["kind"], meta=header["meta"], arrays=arrays), Origin(header["ch"], session, seq)


def decode(frames: Sequence[Any], key: bytes) -> Message:
    """The message in `frames` (bytes, memoryviews or zmq.Frame); WireError if malformed or forged."""
    return decode_signed(frames, key)[0]


class ReplayGuard:
    """Which (session, sequence number) pairs a receiving socket has taken.

    Per sender session: the highest number seen and which of the `window` numbers below it were
    seen. A number seen before is a replay; one `window` or more below the highest is out of the
    window (refused: it cannot be told from a replay). The first message of a session opens it; the
    least recently heard sessions are forgotten past `max_sessions`.
    """

    def __init__(self, window: int = REPLAY_WINDOW, max_sessions: int = MAX_SESSIONS) -> None:
        self.window, self.max_sessions = window, max_sessions
        self._mask = (1 << window) - 1
        self._sessions: OrderedDict[bytes, list[int]] = OrderedDict()  # session -> [highest, bitmap of seen]

    def check(self, session: bytes, seq: int) -> str | None:
        """None if (session, seq) is new (and remember it); else the reason to refuse it."""
        state = self._sessions.get(session)
        if state is None:
            self._sessions[session] = [seq, 1]
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return None
        self._sessions.move_to_end(session)
        highest, seen = state
        if seq > highest:
            shift = seq - highest
            state[0], state[1] = seq, ((seen << shift) | 1) & self._mask if shift < self.window else 1
            return None
        offset = highest - seq
        if offset >= self.window:
            return "out_of_window"
        if (seen >> offset) & 1:
            return "replay"
        state[1] = seen | (1 << offset)
        return None


def rejection_counts(*sockets: Any, store: Any = None) -> dict[str, float]:
    """What receiving `sockets` dropped, for a rank's counters: `rejected_messages` in all and
    `rejected_<reason>` per reason (`REJECT_REASONS`); with `store` (the world's `dist.SealedStore`), also
    `rejected_store_values`: forged values its waits refused (they are not messages, so apart)."""
    out: dict[str, float] = {"rejected_messages": float(sum(s.rejected for s in sockets))}
    for sock in sockets:
        for reason, count in getattr(sock, "rejections", {}).items():
            out[f"rejected_{reason}"] = out.get(f"rejected_{reason}", 0.0) + count
    if store is not None:
        out["rejected_store_values"] = float(store.rejected)
    return out


# --------------------------------------------------------------------------- sockets


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"transport key must be at least {MIN_KEY_BYTES} bytes (use secret.load_secret)")
    return bytes(key)


def _peer_address(frame: Any) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return "?"


_S = TypeVar("_S", bound="_Signed")
Accepts = Mapping[str, Optional[Callable[[Message], object]]]


class _Signed:
    """What every wrapper shares: keys, the sending session, verification and the count of refused messages.

    `key` is the run secret; each socket signs with `channel_key(key, send channel)` and verifies with
    `channel_key(key, receive channel)`. Both are `channel` unless `reply_channel` is given, which a
    Dealer receives on and a Router sends on. `accepts` maps each message kind a receiving socket takes
    to a check of its content (None: none; a check raises WireError, or anything, for a bad message);
    other kinds are refused. `max_frame_bytes` disconnects a peer that sends a larger frame, before it is
    buffered.
    """

    _receives_replies = True  # a Dealer receives on reply_channel; a Router receives on channel

    def __init__(
        self,
        key: bytes,
        *,
        channel: str = DEFAULT_CHANNEL,
        reply_channel: str | None = None,
        name: str = "",
        accepts: Accepts | None = None,
        max_frame_bytes: int | None = None,
        send_timeout_ms: int = DEFAULT_SEND_TIMEOUT_MS,
    ) -> None:
        secret = _check_key(key)
        reply = channel if reply_channel is None else reply_channel
        self.send_channel, self.recv_channel = (channel, reply) if self._receives_replies else (reply, channel)
        self._send_key = channel_key(secret, self.send_channel)
        self._recv_key = channel_key(secret, self.recv_channel)
        self.name = name or type(self).__name__.lower()
        self.accepts = None if accepts is None else dict(accepts)
        self.send_timeout_ms = send_timeout_ms
        self.session = secrets.token_bytes(SESSION_BYTES)  # names this socket's messages; never reused
        self._seq = 0
        self.replays = ReplayGuard()
        self.rejections: dict[str, int] = {}
        self.endpoints: list[str] = []
        self.max_frame_bytes = max_frame_bytes

    @property
    def rejected(self) -> int:
        """Messages dropped so far, for every reason."""
        return sum(self.rejections.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.endpoints})"

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        """Port of the last bound endpoint."""
        return int(self.endpoints[-1].rsplit(":", 1)[1])

    def close(self) -> None:
        raise NotImplementedError

    def _signed(self, message: Message) -> list[Any]:
        frames = encode(message, self._send_key, channel=self.send_channel, session=self.session, seq=self._seq)
        self._seq += 1  # a number is never signed twice, even if this send fails
        return frames

    def _verify(self, frames: list[Any]) -> Message:
        """The message in `frames` if it is authentic, for this socket, of a kind it takes, and new."""
        message, origin = decode_signed(frames, self._recv_key)
        if origin.channel != self.recv_channel:  # the key already differs; this names the mistake
            raise WireError(f"signed for channel {origin.channel!r}, not {self.recv_channel!r}", reason="channel")
        if self.accepts is not None and message.kind not in self.accepts:
            raise WireError(f"kind {message.kind!r} is not taken here (takes {sorted(self.accepts)})", reason="kind")
        why = self.replays.check(origin.session, origin.seq)
        if why is not None:
            raise WireError(
                f"{'repeated' if why == 'replay' else 'out-of-window'} message {origin.seq} of sender session "
                f"{origin.session.hex()[:12]} (a replay)",
                reason=why,
            )
        check = None if self.accepts is None else self.accepts[message.kind]
        if check is not None:
            try:
                message.decoded, message.decoded_by = check(message), check
            except WireError as err:
                raise WireError(f"bad {message.kind!r} message: {err}", reason="content") from None
            except Exception as err:  # noqa: BLE001 - a check that trips over odd content refuses it
                what = f"{type(err).__name__}: {err}"
                raise WireError(f"bad {message.kind!r} message: {what}", reason="content") from None
        return message

    def _reject(self, peer: str, err: WireError) -> None:
        count = self.rejections[err.reason] = self.rejections.get(err.reason, 0) + 1
        if count <= _LOG_FIRST_REJECTS or count % _LOG_EVERY_REJECTS == 0:
            log.warning(
                "%s: dropped message from peer %s: %s (rejected so far: %d, %d for %s)",
                self.name,
                peer,
                err,
                self.rejected,
                count,
                err.reason,
            )


class _Socket(_Signed):
    """A ZeroMQ socket (Push, Pull, Pub, Sub): options, bind/connect, signed send, verified receive.
    `max_frame_bytes` is ZMQ_MAXMSGSIZE."""

    socket_type: int = -1
    default_hwm: int = 1000

    def __init__(
        self,
        key: bytes,
        *,
        hwm: int | None = None,
        linger_ms: int = DEFAULT_LINGER_MS,
        context: zmq.Context | None = None,
        **kwargs: Any,  # `_Signed`'s
    ) -> None:
        super().__init__(key, **kwargs)
        self.socket = (context or zmq.Context.instance()).socket(self.socket_type)
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        self._sndtimeo = -1  # the socket's current SNDTIMEO (ZeroMQ's default: block)
        self.socket.setsockopt(zmq.SNDHWM, hwm or self.default_hwm)
        self.socket.setsockopt(zmq.RCVHWM, hwm or self.default_hwm)
        if self.max_frame_bytes:  # before bind/connect: the limit is read per connection
            self.socket.setsockopt(zmq.MAXMSGSIZE, int(self.max_frame_bytes))

    def bind(self, address: str, port: int | None = None) -> str:
        """Bind ``tcp://address:port`` (a random free port if None/0); returns the bound endpoint."""
        wanted = f"tcp://{address}:{port or '*'}"
        try:
            self.socket.bind(wanted)
        except zmq.ZMQError as err:
            raise TransportError(f"{self.name}: cannot bind {wanted}: {err}") from err
        endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints.append(endpoint)
        return endpoint

    def connect(self, endpoint: str) -> None:
        """Connect to a peer's bound endpoint (returns at once; ZeroMQ reconnects in the background)."""
        self.socket.connect(endpoint)
        self.endpoints.append(endpoint)

    def close(self) -> None:
        self.socket.close()

    def _send(self, prefix: list[bytes], message: Message, timeout_ms: int | None) -> None:
        timeout_ms = self.send_timeout_ms if timeout_ms is None else timeout_ms
        if timeout_ms != self._sndtimeo:
            self.socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self._sndtimeo = timeout_ms
        frames = self._signed(message)
        try:
            self.socket.send_multipart(prefix + frames, copy=True)
        except zmq.Again:
            raise SendTimeout(
                f"{self.name}: sending {message.kind!r} to {self.endpoints} timed out after "
                f"{timeout_ms / 1000:g} s "
                "(no peer connected, or the peer stopped reading)"
            ) from None

    def _recv(self, timeout_ms: int, prefix_len: int) -> tuple[list[Any], Message] | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if remaining_ms == 0 or not self.socket.poll(remaining_ms, zmq.POLLIN):
                    return None
                continue
            try:
                if len(frames) < prefix_len + 1:
                    raise WireError(f"{len(frames)} frames, expected at least {prefix_len + 1}")
                return frames[:prefix_len], self._verify(frames[prefix_len:])
            except WireError as err:
                self._reject(frames[0].bytes.hex() if prefix_len else _peer_address(frames[-1]), err)
            if remaining_ms == 0:
                return None


class _Stream(_Signed):
    """A socket on direct connections (`stream`): the caller's thread reads and writes, no I/O thread, so a hop
    wakes one thread, the receiver's. Received messages wait in `inbox` until `recv`; a message that the
    kernel cannot take at once waits in its connection's queue, flushed whenever the socket is used or
    polled. A peer that announces a frame over `max_frame_bytes` (counted `oversized`, its bytes unread) or
    does not speak the protocol (`malformed`) is dropped with its connection."""

    def __init__(
        self,
        key: bytes,
        *,
        hwm: int | None = None,
        linger_ms: int = DEFAULT_LINGER_MS,
        context: zmq.Context | None = None,  # taken for the ZeroMQ sockets' signature; unused
        **kwargs: Any,
    ) -> None:
        super().__init__(key, **kwargs)
        self.watch = stream.Watch()
        self.conns: dict[int, stream.Connection] = {}
        self.inbox: deque[tuple[stream.Connection, stream.Frames]] = deque()
        self.linger_ms = linger_ms
        self.hwm = hwm or 1000  # a Dealer's messages that may wait for a connection
        # A sender blocks (pumping its input, so two senders never wait on each other) while a connection holds more.
        self.max_queued_bytes = max(QUEUED_BYTES, 2 * (self.max_frame_bytes or 0))

    def fileno(self) -> int:
        """Readable while a connection has input or room for queued output (Poller registers this)."""
        return self.watch.fileno()

    def has_input(self) -> bool:
        return bool(self.inbox)

    def service(self) -> float | None:
        """What an I/O thread would do between calls; returns in how many seconds to do it again (None: no need)."""
        return None

    def _connection(self, sock: socket.socket, expect_hello: bool) -> stream.Connection:
        conn = stream.Connection(
            sock,
            expect_hello=expect_hello,
            max_frame_bytes=self.max_frame_bytes,
            max_message_bytes=2 * self.max_frame_bytes if self.max_frame_bytes else None,
        )
        self.conns[conn.fd] = conn
        self.watch.add(conn.fd)
        return conn

    def _dropped(self, conn: stream.Connection) -> None:
        """A connection went away (peer closed, broke, or broke the protocol)."""

    def _pump(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for any connection; read what arrived, write what they take, accept."""
        for fd, events in self.watch.ready(timeout_s):
            conn = self.conns.get(fd)
            if conn is None:
                self._on_listener(fd)
                continue
            if events & select.EPOLLOUT:
                self._flush(conn)
            if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not conn.closed:
                self._read(conn)

    def _on_listener(self, fd: int) -> None:
        self.watch.remove(fd)  # not ours any more (closed while the event was in flight)

    def _read(self, conn: stream.Connection) -> None:
        try:
            messages = conn.read()
        except stream.BadStream as err:
            self._reject(self._peer(conn), WireError(f"dropped the connection: {err}", reason=err.reason))
            self._forget(conn)
            return
        self.inbox.extend((conn, frames) for frames in messages)
        if conn.closed:
            self._forget(conn)

    def _forget(self, conn: stream.Connection) -> None:
        """Take a connection out, closing it if it is still open."""
        self.conns.pop(conn.fd, None)
        self.watch.remove(conn.fd)  # before closing, while the descriptor is still this connection's
        if not conn.closed:
            conn.close()
        self._dropped(conn)

    def _flush(self, conn: stream.Connection) -> bool:
        try:
            done = conn.flush()
        except stream.StreamClosed:
            self._forget(conn)
            return False
        self.watch.add(conn.fd, write=not done)
        return done

    def _queue(self, conn: stream.Connection, frames: list[Any], timeout_ms: int | None) -> None:
        """Queue `frames` on `conn` and write what goes now; block only past `max_queued_bytes`."""
        conn.queue(frames)
        self._flush(conn)
        if conn.pending <= self.max_queued_bytes:
            return
        timeout_ms = self.send_timeout_ms if timeout_ms is None else timeout_ms
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while conn.pending > self.max_queued_bytes and not conn.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SendTimeout(
                    f"{self.name}: {conn.pending} bytes queued for {self._peer(conn)} after "
                    f"{timeout_ms / 1000:g} s (the peer stopped reading)"
                )
            self._pump(min(left, 0.1))

    def _take(self, timeout_ms: int) -> tuple[stream.Connection, Message] | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            while self.inbox:
                conn, frames = self.inbox.popleft()
                try:
                    return conn, self._verify(frames)
                except WireError as err:
                    self._reject(self._peer(conn), err)
                if time.monotonic() >= deadline:  # a flood of refused messages does not hold the caller
                    return None
            left = deadline - time.monotonic()
            self._pump(max(0.0, left))
            if left <= 0 and not self.inbox:
                return None

    def _peer(self, conn: stream.Connection) -> str:
        try:
            host, port = conn.sock.getpeername()[:2]
            where = f"{host}:{port}"
        except OSError:
            where = "?"
        return f"{conn.identity.hex() if conn.identity else '-'}@{where}"

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._linger(conn)
            conn.close()
        self.conns.clear()
        self.watch.close()

    def _linger(self, conn: stream.Connection) -> None:
        """Give queued output up to `linger_ms` to go out (as ZeroMQ's linger)."""
        deadline = time.monotonic() + self.linger_ms / 1000
        while conn.pending and not conn.closed and time.monotonic() < deadline:
            try:
                if conn.flush():
                    return
            except stream.StreamClosed:
                return
            waiter = select.poll()  # not select.select: it refuses descriptors of 1024 and above
            waiter.register(conn.fd, select.POLLOUT)
            waiter.poll(max(0, int((deadline - time.monotonic()) * 1000)))


class Router(_Stream):
    """Serves many Dealers: ``recv`` returns (peer id, message); ``send`` replies to one peer.
    Receives on `channel`, replies on `reply_channel`. A second peer that claims a routing id already
    connected is refused (its connection closed)."""

    _receives_replies = False

    def __init__(self, key: bytes, **kwargs: Any) -> None:
        super().__init__(key, **kwargs)
        self.listeners: dict[int, socket.socket] = {}
        self.peers: dict[bytes, stream.Connection] = {}
        self._paused: dict[int, float] = {}  # listeners that could not accept, and when to listen again

    def service(self) -> float | None:
        """Listen again on listeners paused by a failed accept; in how long to look again."""
        now = time.monotonic()
        for fd, until in list(self._paused.items()):
            if now >= until:
                del self._paused[fd]
                self.watch.add(fd)
        return max(0.0, min(self._paused.values()) - now) if self._paused else None

    def bind(self, address: str, port: int | None = None) -> str:
        """Bind ``tcp://address:port`` (a random free port if None/0); returns the bound endpoint."""
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port or 0))
            listener.listen(128)
        except OSError as err:
            listener.close()
            raise TransportError(
                f"{self.name}: cannot bind {stream.format_endpoint(address, port or 0)}: {err}"
            ) from err
        listener.setblocking(False)
        self.listeners[listener.fileno()] = listener
        self.watch.add(listener.fileno())
        endpoint = stream.format_endpoint(address, listener.getsockname()[1])
        self.endpoints.append(endpoint)
        return endpoint

    def _on_listener(self, fd: int) -> None:
        listener = self.listeners.get(fd)
        if listener is None:
            return super()._on_listener(fd)
        for _ in range(64):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of file descriptors, for one: stop listening a moment, not spin
                log.warning("%s: accepting a connection failed (%s); pausing for %g s", self.name, err, ACCEPT_PAUSE_S)
                self.watch.remove(fd)
                self._paused[fd] = time.monotonic() + ACCEPT_PAUSE_S
                return
            self._connection(sock, expect_hello=True)

    def _read(self, conn: stream.Connection) -> None:
        known = conn.identity is not None
        super()._read(conn)
        if known or conn.identity is None or conn.closed:
            return
        holder = self.peers.get(conn.identity)
        if holder is not None and not holder.closed:
            log.warning("%s: refused a second peer with routing id %s", self.name, conn.identity.hex())
            self.inbox = deque((c, f) for c, f in self.inbox if c is not conn)
            self._forget(conn)
            return
        self.peers[conn.identity] = conn

    def _dropped(self, conn: stream.Connection) -> None:
        if conn.identity is not None and self.peers.get(conn.identity) is conn:
            del self.peers[conn.identity]

    def recv(self, timeout_ms: int) -> tuple[bytes, Message] | None:
        self.service()
        got = self._take(timeout_ms)
        if got is None:
            return None
        conn, message = got
        return conn.identity or b"", message

    def send(self, peer: bytes, message: Message, timeout_ms: int | None = None) -> None:
        conn = self.peers.get(peer)
        if conn is None or conn.closed:
            raise PeerUnreachable(f"{self.name}: peer {peer!r} is not connected (it exited or never connected)")
        self._queue(conn, self._signed(message), timeout_ms)
        if conn.closed:
            raise PeerUnreachable(f"{self.name}: peer {peer!r} went away while we sent to it")

    def close(self) -> None:
        super().close()
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()


class Dealer(_Stream):
    """Talks to one Router: sends on `channel`, receives replies on `reply_channel`. Its routing id is
    `identity`, or by default `routing_id(name)` (unpredictable: nobody can claim it first).
    As ZeroMQ's: `connect` returns at once; messages sent while no connection is up wait (up to `hwm`)
    and go out when one is made; a lost connection is made again on the next send or poll."""

    def __init__(self, key: bytes, identity: bytes | None = None, **kwargs: Any) -> None:
        super().__init__(key, **kwargs)
        self.identity = identity or routing_id(self.name)
        stream.hello(self.identity)  # checks its length
        self.conn: stream.Connection | None = None
        self.backlog: deque[list[Any]] = deque()  # signed, owned frames waiting for a connection
        self._next_attempt = 0.0
        self._backoff = RECONNECT_S[0]

    def connect(self, endpoint: str) -> None:
        """Connect to a Router's bound endpoint (returns at once; connects, and reconnects, when it can)."""
        if self.endpoints:
            raise TransportError(f"{self.name}: a Dealer connects to one endpoint (has {self.endpoints[0]})")
        self.address = stream.parse_endpoint(endpoint)
        self.endpoints.append(endpoint)
        self._reconnect()

    def _reconnect(self) -> bool:
        """Connected now? Tries once if none is up and the back-off allows."""
        if self.conn is not None and not self.conn.closed:
            return True
        now = time.monotonic()
        if not self.endpoints or now < self._next_attempt:
            return False
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError as err:
            log.debug("%s: cannot connect to %s yet: %s", self.name, self.endpoints[0], err)
            self._retry_later()
            return False
        self.conn = self._connection(sock, expect_hello=False)
        self.conn.queue_raw(stream.hello(self.identity))
        while self.backlog:
            self.conn.queue(self.backlog.popleft())
        self._flush(self.conn)
        return True

    def _dropped(self, conn: stream.Connection) -> None:
        if conn is self.conn:
            self.conn = None
            self._retry_later()

    def _retry_later(self) -> None:
        """The next attempt to connect after the back-off, which doubles until a reply arrives (`recv`), so a
        Router that refuses us is not hammered."""
        self._next_attempt = time.monotonic() + self._backoff
        self._backoff = min(RECONNECT_S[1], 2 * self._backoff)

    def send(self, message: Message, timeout_ms: int | None = None) -> None:
        frames = self._signed(message)
        if self._reconnect() and self.conn is not None:
            self._queue(self.conn, frames, timeout_ms)
            return
        if len(self.backlog) >= self.hwm:
            raise SendTimeout(
                f"{self.name}: sending {message.kind!r} to {self.endpoints}: {self.hwm} messages wait for a "
                "connection (no peer listening)"
            )
        self.backlog.append([bytes(memoryview(f).cast("B")) for f in frames])

    def recv(self, timeout_ms: int) -> Message | None:
        self._reconnect()
        got = self._take(timeout_ms)
        if got is None:
            return None
        self._backoff = RECONNECT_S[0]  # the connection works
        return got[1]

    def service(self) -> float | None:
        """Make a lost connection again if messages wait for it."""
        if not self.backlog or self._reconnect():
            return None
        return max(0.0, self._next_attempt - time.monotonic())


class Push(_Socket):
    """Sends work (trajectories) to Pulls; blocks at the HWM, which is the back-pressure."""

    socket_type = zmq.PUSH
    default_hwm = 64

    def send(self, message: Message, timeout_ms: int | None = None) -> None:
        self._send([], message, timeout_ms)


class Pull(_Socket):
    """Receives from many Pushes (fair-queued)."""

    socket_type = zmq.PULL
    default_hwm = 64

    def recv(self, timeout_ms: int) -> Message | None:
        got = self._recv(timeout_ms, prefix_len=0)
        return None if got is None else got[1]


class Pub(_Socket):
    """Broadcasts announcements; never blocks, drops for subscribers that are absent or full.

    Subscribers that connect late miss earlier messages (ZeroMQ's slow joiner),
    so publish state ("latest version is 12"), not events, and repeat it.
    """

    socket_type = zmq.PUB
    default_hwm = 100

    def send(self, message: Message, timeout_ms: int | None = None) -> None:
        self._send([], message, timeout_ms)


class Sub(_Socket):
    """Receives every message of the Pubs it connects to."""

    socket_type = zmq.SUB
    default_hwm = 100

    def __init__(self, key: bytes, **kwargs: Any) -> None:
        super().__init__(key, **kwargs)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")

    def recv(self, timeout_ms: int) -> Message | None:
        got = self._recv(timeout_ms, prefix_len=0)
        return None if got is None else got[1]


def _poll_key(sock: Any) -> Any:
    """What zmq.Poller polls for a wrapped socket, and answers with: a stream socket's epoll descriptor, else its
    ZeroMQ socket."""
    return sock.fileno() if isinstance(sock, _Stream) else sock.socket


class Poller(Generic[_S]):
    """Waits on several wrapped sockets at once; ``poll`` returns those with input ready.

    A ready socket may hold only a rejected message, so call ``recv(0)`` and
    accept None.
    """

    def __init__(self, *sockets: _S) -> None:
        self._poller = zmq.Poller()
        self._by_key: dict[Any, _S] = {}
        self._streams: list[_Stream] = []
        for sock in sockets:
            self.register(sock)

    def register(self, sock: _S) -> None:
        key = _poll_key(sock)
        self._poller.register(key, zmq.POLLIN)
        self._by_key[key] = sock
        if isinstance(sock, _Stream):
            self._streams.append(sock)

    def unregister(self, sock: _S) -> None:
        key = _poll_key(sock)
        self._poller.unregister(key)
        del self._by_key[key]
        self._streams = [s for s in self._streams if s is not sock]

    def poll(self, timeout_ms: int) -> list[_S]:
        """The sockets with input, waiting up to `timeout_ms` for one. Stream sockets are serviced here (their
        connections accepted, read and flushed), and count as ready only with a whole message to take."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            for s in self._streams:
                again = s.service()
                if again is not None:
                    wait_ms = min(wait_ms, int(again * 1000) + 1)
            ready: list[_S] = [self._by_key[s.fileno()] for s in self._streams if s.has_input()]
            for key, _ in self._poller.poll(0 if ready else wait_ms):
                sock = self._by_key[key]
                if isinstance(sock, _Stream):
                    sock._pump(0)
                    if not sock.has_input():
                        continue
                if sock not in ready:
                    ready.append(sock)
            if ready or time.monotonic() >= deadline:
                return ready


# --------------------------------------------------------------------------- benchmark


def benchmark(rounds: int = 2000, image_shape: tuple[int, ...] = (1, 224, 224, 3)) -> dict[str, float]:
    """Median loopback round trip (µs) of an image+state request and a small action reply.

    ``vlaslurm_us`` is this layer (msgpack, MAC both ways, dtype checks);
    ``raw_zmq_us`` sends the same bytes with bare pyzmq; ``mac_us`` is the
    MAC of the request alone, once.
    """
    key = b"k" * 32
    image = np.random.default_rng(0).integers(0, 255, image_shape, dtype=np.uint8)
    request = Message("obs", {"env": 3, "step": 17}, {"image": image, "state": np.zeros(8, np.float32)})
    reply = Message("action", {"version": 1}, {"action": np.zeros(7, np.float32)})
    raws = [_raw(a) for a in request.arrays.values()]
    return {
        "raw_zmq_us": _median_us(_raw_round_trips(rounds, image)),
        "vlaslurm_us": _median_us(_wrapped_round_trips(rounds, request, reply, key)),
        "mac_us": _median_us(_timed(rounds, lambda: _mac(key, b"", raws, b"s" * SESSION_BYTES, 0))),
    }


def _median_us(times: list[float]) -> float:
    return float(np.median(times) * 1e6)


def _timed(rounds: int, step: Any) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def _wrapped_round_trips(rounds: int, request: Message, reply: Message, key: bytes) -> list[float]:
    with Router(key) as server, Dealer(key) as client:
        client.connect(server.bind("127.0.0.1"))

        def step() -> None:
            client.send(request)
            got = server.recv(5000)
            if got is None:
                raise TimeoutError("transport round trip: the router got no request within 5 s")
            server.send(got[0], reply)
            client.recv(5000)

        _timed(100, step)  # warm up
        return _timed(rounds, step)


def _raw_round_trips(rounds: int, image: np.ndarray) -> list[float]:
    ctx: zmq.Context = zmq.Context.instance()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        server.bind("tcp://127.0.0.1:*")
        client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))

        def step() -> None:
            client.send_multipart([bytes(80), image, bytes(32)])
            peer, *_ = server.recv_multipart()
            server.send_multipart([peer, bytes(80), bytes(28)])
            client.recv_multipart()

        _timed(100, step)
        return _timed(rounds, step)
    finally:
        server.close(0)
        client.close(0)


if __name__ == "__main__":
    for name, value in benchmark().items():
        print(f"{name}: {value:.1f}")
