"""Length-prefixed frames over TCP, read and written by the caller's own thread (no I/O thread).

ZeroMQ hands every message to an I/O thread on each side, so one hop between two idle processes wakes three
threads; on a VM each wake-up of an idle vCPU costs tens to hundreds of microseconds. The request/reply hot
path (transport's Router and Dealer) runs on these connections instead: one wake-up per hop, the receiver's.
A connection carries a hello (magic, the dealer's routing id) and then messages, each
``u32 frame count, u64 length per frame, the frames``. Sockets are non-blocking; a message that cannot be
written at once waits in the connection's queue (its caller-owned buffers copied) and is flushed whenever
its socket is used or polled. Authentication is the transport's business, not this module's.
"""

from __future__ import annotations

import select
import socket
import struct
from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple

import numpy as np

MAGIC = b"VLSD\x01"
MAX_FRAMES = 64  # a message's arrays plus its envelope; far more than any message of a run has
MAX_ID_BYTES = 255
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_COUNT = struct.Struct("<I")
_HELLO = len(MAGIC) + 1

Frames = List[memoryview]


class StreamClosed(ConnectionError):
    """The peer closed the connection or it broke."""


class BadStream(ValueError):
    """The peer sent bytes that are not this protocol (`reason` malformed), or announced a message over the
    limits (`oversized`, refused before its bytes are read); the connection is dropped."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


def parse_endpoint(endpoint: str) -> Tuple[str, int]:
    """``tcp://host:port`` as (host, port); IPv6 hosts in brackets."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
    host, port = endpoint[6:].rsplit(":", 1)
    return host.strip("[]"), int(port)


def format_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def hello(identity: bytes) -> bytes:
    if not 0 < len(identity) <= MAX_ID_BYTES:
        raise ValueError(f"a routing id has 1 to {MAX_ID_BYTES} bytes")
    return MAGIC + bytes([len(identity)]) + identity


def message_header(frames: Sequence[Any]) -> Tuple[bytes, List[memoryview]]:
    views = [memoryview(f).cast("B") for f in frames]
    if not 0 < len(views) <= MAX_FRAMES:
        raise ValueError(f"a message has 1 to {MAX_FRAMES} frames, not {len(views)}")
    return struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views)), views


class Connection:
    """One non-blocking stream: reads whole messages, queues and flushes written ones.

    `expect_hello`: the accepting side reads the peer's routing id first (`identity`). Frames larger than
    `max_frame_bytes`, messages larger than `max_message_bytes` or with more than `MAX_FRAMES` frames raise
    BadStream before their bytes are read.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        expect_hello: bool,
        max_frame_bytes: Optional[int] = None,
        max_message_bytes: Optional[int] = None,
    ) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self.sock = sock
        self.fd = sock.fileno()  # kept: a closed socket's fileno() is -1
        self.identity: Optional[bytes] = None
        self.max_frame_bytes = max_frame_bytes
        self.max_message_bytes = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        self.closed = False
        self._out: Deque[memoryview] = deque()
        self._queued = 0
        self._stage = "hello" if expect_hello else "count"
        self._lengths: List[int] = []
        self._expect(_HELLO if expect_hello else _COUNT.size)

    @property
    def pending(self) -> int:
        """Bytes queued and not yet written."""
        return self._queued

    def close(self) -> None:
        self.closed = True
        self._out.clear()
        self._queued = 0
        self.sock.close()

    # ----------------------------------------------------------------- reading

    def _expect(self, n: int) -> None:
        # np.empty, not bytearray: a zero-filled buffer commits its pages at once, so a peer's header alone
        # (announcing a frame under the limit) would take the memory; these are committed as bytes arrive.
        self._buf = np.empty(n, np.uint8).data.cast("B")
        self._got = 0

    def read(self) -> List[Frames]:
        """The complete messages the socket holds now, in order (frames are read-only views). Marks the
        connection `closed` at the peer's end of stream; raises BadStream for bytes that break the protocol."""
        messages: List[Frames] = []
        while not self.closed:
            want = len(self._buf) - self._got
            if want:
                try:
                    n = self.sock.recv_into(self._buf[self._got :], want)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    n = 0
                if n == 0:
                    self.close()
                    break
                self._got += n
                if n < want:
                    break  # drained for now: level-triggered polling calls again when more arrives
            message = self._advance()
            if message is not None:
                messages.append(message)
        return messages

    def _advance(self) -> Optional[Frames]:
        data = self._buf
        if self._stage == "hello":
            if bytes(data[: len(MAGIC)]) != MAGIC:
                raise BadStream("not a vlaslurm stream (bad magic)")
            if not data[-1]:
                raise BadStream("an empty routing id")
            self._stage = "identity"
            self._expect(data[-1])
        elif self._stage == "identity":
            self.identity = bytes(data)
            self._stage = "count"
            self._expect(_COUNT.size)
        elif self._stage == "count":
            (count,) = _COUNT.unpack(data)
            if not 0 < count <= MAX_FRAMES:
                raise BadStream(f"a message of {count} frames (at most {MAX_FRAMES})", "oversized")
            self._stage = "lengths"
            self._expect(8 * count)
        elif self._stage == "lengths":
            self._lengths = list(struct.unpack(f"<{len(data) // 8}Q", data))
            self._check_sizes(self._lengths)
            self._stage = "body"
            self._expect(sum(self._lengths))
            if self._lengths and not len(self._buf):
                return self._message()
        else:
            return self._message()
        return None

    def _check_sizes(self, lengths: List[int]) -> None:
        largest, total = max(lengths), sum(lengths)
        if self.max_frame_bytes and largest > self.max_frame_bytes:
            raise BadStream(f"a frame of {largest} bytes (at most {self.max_frame_bytes})", "oversized")
        if total > self.max_message_bytes:
            raise BadStream(f"a message of {total} bytes (at most {self.max_message_bytes})", "oversized")

    def _message(self) -> Frames:
        body, frames, start = self._buf.toreadonly(), [], 0
        for length in self._lengths:
            frames.append(body[start : start + length])
            start += length
        self._stage = "count"
        self._expect(_COUNT.size)
        return frames

    # ----------------------------------------------------------------- writing

    def queue(self, frames: Sequence[Any]) -> None:
        header, views = message_header(frames)
        self._out.append(memoryview(header))
        self._out.extend(v for v in views if v.nbytes)  # an empty frame is its length alone: nothing to write
        self._queued += len(header) + sum(v.nbytes for v in views)

    def queue_raw(self, data: bytes) -> None:
        """Bytes outside any message (the hello)."""
        self._out.append(memoryview(data))
        self._queued += len(data)

    def flush(self) -> bool:
        """Write what the socket takes now; True once nothing is queued. Raises StreamClosed if it broke.
        Whatever stays queued is copied first: the caller may reuse its arrays once `send` returned."""
        while self._out:
            try:
                sent = self.sock.sendmsg(list(_first(self._out, 64)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:
                self.close()
                raise StreamClosed(str(err)) from None
            self._consume(sent)
        if self._out:
            self._own_queued()
        return not self._out

    def _consume(self, sent: int) -> None:
        self._queued -= sent
        while self._out and (sent or not self._out[0].nbytes):
            head = self._out[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                self._out.popleft()
            else:
                self._out[0] = head[sent:]
                sent = 0

    def _own_queued(self) -> None:
        self._out = deque(v if isinstance(v.obj, bytes) else memoryview(bytes(v)) for v in self._out)


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 30 s, so a peer whose host went away without a word (a half-open
    connection) is noticed in about a minute instead of holding its routing id for hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _first(items: Deque[memoryview], n: int) -> List[memoryview]:
    out = []
    for item in items:
        out.append(item)
        if len(out) == n:
            break
    return out


class Watch:
    """An epoll set a socket keeps its connections in: its own file descriptor is readable while any of them
    is ready, so one registration in a Poller covers a changing set of connections."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._fds: dict[int, int] = {}

    def fileno(self) -> int:
        return self._epoll.fileno()

    def add(self, fd: int, write: bool = False) -> None:
        mask = select.EPOLLIN | (select.EPOLLOUT if write else 0)
        if fd in self._fds:
            if self._fds[fd] != mask:
                self._epoll.modify(fd, mask)
        else:
            self._epoll.register(fd, mask)
        self._fds[fd] = mask

    def remove(self, fd: int) -> None:
        if self._fds.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):  # already closed: the kernel dropped it
                pass

    def ready(self, timeout_s: float) -> List[Tuple[int, int]]:
        try:
            return self._epoll.poll(timeout_s)
        except InterruptedError:
            return []

    def close(self) -> None:
        self._epoll.close()
