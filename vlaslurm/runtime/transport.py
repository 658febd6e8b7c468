"""Authenticated, pickle-free messages over ZeroMQ.

A `Message` is a kind, a small msgpack-able `meta` dict and named numpy arrays, sent as a signed
header frame (HMAC-SHA256, keyed by the run secret) and one raw frame per array. Receivers drop
and count messages that are malformed or fail the MAC; received arrays are read-only views.
Sockets are not thread-safe: use each one from a single thread.
Details (wire format): docs/runtime.md
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Generic, Iterable, Sequence, TypeVar

import msgpack
import numpy as np
import zmq

from vlaslurm.runtime.netaddr import bind_address

log = logging.getLogger("vlaslurm.transport")

__all__ = [
    "ALLOWED_DTYPES",
    "Message",
    "WireError",
    "TransportError",
    "SendTimeout",
    "PeerUnreachable",
    "encode",
    "decode",
    "Router",
    "Dealer",
    "Push",
    "Pull",
    "Pub",
    "Sub",
    "Poller",
    "bind_address",
]

WIRE_VERSION = 1
MAC_BYTES = 32
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
_LOG_FIRST_REJECTS = 10
_LOG_EVERY_REJECTS = 1000


class WireError(ValueError):
    """A received message is malformed or not authentic."""


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


# --------------------------------------------------------------------------- encoding


def _wire_array(name: str, array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in ALLOWED_DTYPES:
        raise ValueError(f"array {name!r} has dtype {array.dtype}; allowed: {sorted(ALLOWED_DTYPES)}")
    return np.asarray(array, dtype=dtype, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d


def _raw(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data  # the array's buffer, as memoryview(...) gives it


def _mac(key: bytes, signed: bytes, frames: Iterable[memoryview]) -> bytes:
    digest = hmac.new(key, signed, hashlib.sha256)
    for frame in frames:
        digest.update(frame.nbytes.to_bytes(8, "little"))
        digest.update(frame)
    return digest.digest()


def encode(message: Message, key: bytes) -> list[Any]:
    """The frames of `message`, signed with `key` (frame 0 bytes, then array buffers)."""
    arrays = {name: _wire_array(name, a) for name, a in message.arrays.items()}
    specs = [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays.items()]
    signed = msgpack.packb({"kind": message.kind, "meta": message.meta, "arrays": specs}, use_bin_type=True)
    raws = [_raw(a) for a in arrays.values()]
    envelope = msgpack.packb({"v": WIRE_VERSION, "h": signed, "mac": _mac(key, signed, raws)}, use_bin_type=True)
    return [envelope, *raws]


def _unpack_envelope(frame0: bytes) -> tuple[bytes, bytes]:
    try:
        envelope = msgpack.unpackb(frame0, raw=False, max_array_len=0, max_map_len=8)
    except Exception as err:  # msgpack raises several types for garbage
        raise WireError(f"undecodable envelope ({type(err).__name__})") from None
    if not isinstance(envelope, dict) or envelope.get("v") != WIRE_VERSION:
        version = envelope.get("v") if isinstance(envelope, dict) else None
        raise WireError(f"unsupported wire version {version!r} (expected {WIRE_VERSION})")
    signed, mac = envelope.get("h"), envelope.get("mac")
    if not isinstance(signed, bytes) or not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
        raise WireError("envelope lacks a signed header or a MAC")
    return signed, mac


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


def decode(frames: Sequence[Any], key: bytes) -> Message:
    """The message in `frames` (bytes, memoryviews or zmq.Frame); WireError if malformed or forged."""
    if not frames:
        raise WireError("empty message")
    buffers = [memoryview(f.buffer if isinstance(f, zmq.Frame) else f).cast("B") for f in frames]
    signed, mac = _unpack_envelope(bytes(buffers[0]))
    if not hmac.compare_digest(mac, _mac(key, signed, buffers[1:])):
        raise WireError("bad MAC (wrong run secret or tampered message)")
    header = msgpack.unpackb(signed, raw=False)
    specs = header.get("arrays")
    if (
        not isinstance(header.get("kind"), str)
        or not isinstance(header.get("meta"), dict)
        or not isinstance(specs, list)
    ):
        raise WireError("signed header lacks kind/meta/arrays")
    if len(specs) != len(buffers) - 1:
        raise WireError(f"header lists {len(specs)} arrays but {len(buffers) - 1} frames arrived")
    arrays = dict(_array_from(spec, buf) for spec, buf in zip(specs, buffers[1:]))
    return Message(kind=header["kind"], meta=header["meta"], arrays=arrays)


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


_S = TypeVar("_S", bound="_Socket")


class _Socket:
    """What every wrapper shares: options, bind/connect, signed send, verified receive."""

    socket_type: int = -1
    default_hwm: int = 1000

    def __init__(
        self,
        key: bytes,
        *,
        name: str = "",
        hwm: int | None = None,
        linger_ms: int = DEFAULT_LINGER_MS,
        send_timeout_ms: int = DEFAULT_SEND_TIMEOUT_MS,
        context: zmq.Context | None = None,
    ) -> None:
        self.key = _check_key(key)
        self.name = name or type(self).__name__.lower()
        self.send_timeout_ms = send_timeout_ms
        self.rejected = 0
        self.endpoints: list[str] = []
        self.socket = (context or zmq.Context.instance()).socket(self.socket_type)
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        self._sndtimeo = -1  # the socket's current SNDTIMEO (ZeroMQ's default: block)
        self.socket.setsockopt(zmq.SNDHWM, hwm or self.default_hwm)
        self.socket.setsockopt(zmq.RCVHWM, hwm or self.default_hwm)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.endpoints})"

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    @property
    def port(self) -> int:
        """Port of the last bound endpoint."""
        return int(self.endpoints[-1].rsplit(":", 1)[1])

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
        try:
            self.socket.send_multipart(prefix + encode(message, self.key), copy=True)
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
                return frames[:prefix_len], decode(frames[prefix_len:], self.key)
            except WireError as err:
                self._reject(frames, prefix_len, err)
            if remaining_ms == 0:
                return None

    def _reject(self, frames: list[Any], prefix_len: int, err: WireError) -> None:
        self.rejected += 1
        if self.rejected <= _LOG_FIRST_REJECTS or self.rejected % _LOG_EVERY_REJECTS == 0:
            peer = frames[0].bytes.hex() if prefix_len else _peer_address(frames[-1])
            log.warning(
                "%s: dropped message from peer %s: %s (rejected so far: %d)", self.name, peer, err, self.rejected
            )


class Router(_Socket):
    """Serves many Dealers: ``recv`` returns (peer id, message); ``send`` replies to one peer."""

    socket_type = zmq.ROUTER

    def __init__(self, key: bytes, **kwargs: Any) -> None:
        super().__init__(key, **kwargs)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def recv(self, timeout_ms: int) -> tuple[bytes, Message] | None:
        got = self._recv(timeout_ms, prefix_len=1)
        return None if got is None else (got[0][0].bytes, got[1])

    def send(self, peer: bytes, message: Message, timeout_ms: int | None = None) -> None:
        try:
            self._send([peer], message, timeout_ms)
        except zmq.ZMQError as err:
            if err.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(
                    f"{self.name}: peer {peer!r} is not connected (it exited or never connected)"
                ) from None
            raise


class Dealer(_Socket):
    """Talks to a Router; `identity` (e.g. b"simulator-3") names it in the Router's logs."""

    socket_type = zmq.DEALER

    def __init__(self, key: bytes, identity: bytes | None = None, **kwargs: Any) -> None:
        super().__init__(key, **kwargs)
        if identity:
            self.socket.setsockopt(zmq.ROUTING_ID, identity)

    def send(self, message: Message, timeout_ms: int | None = None) -> None:
        self._send([], message, timeout_ms)

    def recv(self, timeout_ms: int) -> Message | None:
        got = self._recv(timeout_ms, prefix_len=0)
        return None if got is None else got[1]


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


class Poller(Generic[_S]):
    """Waits on several wrapped sockets at once; ``poll`` returns those with input ready.

    A ready socket may hold only a rejected message, so call ``recv(0)`` and
    accept None.
    """

    def __init__(self, *sockets: _S) -> None:
        self._poller = zmq.Poller()
        self._by_zmq: dict[zmq.Socket, _S] = {}
        for sock in sockets:
            self.register(sock)

    def register(self, sock: _S) -> None:
        self._poller.register(sock.socket, zmq.POLLIN)
        self._by_zmq[sock.socket] = sock

    def unregister(self, sock: _S) -> None:
        self._poller.unregister(sock.socket)
        del self._by_zmq[sock.socket]

    def poll(self, timeout_ms: int) -> list[_S]:
        return [self._by_zmq[s] for s, _ in self._poller.poll(timeout_ms)]


# --------------------------------------------------------------------------- benchmark


def benchmark(rounds: int = 2000, image_shape: tuple[int, ...] = (1, 224, 224, 3)) -> dict[str, float]:
    """Median loopback round trip (µs) of an image+state request and a small action reply.

    ``vlaslurm_us`` is this layer (msgpack, HMAC both ways, dtype checks);
    ``raw_zmq_us`` sends the same bytes with bare pyzmq; ``hmac_us`` is the
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
        "hmac_us": _median_us(_timed(rounds, lambda: _mac(key, b"", raws))),
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
