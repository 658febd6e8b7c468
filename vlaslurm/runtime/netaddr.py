"""Which address a rank binds to and advertises to its peers.

Every role binds its sockets to one concrete address and publishes that same
address in its rendezvous `Member`, so what a peer connects to is exactly what
was bound. `bind_address(None)` picks the address the hostname resolves to
(the usual cluster address on Slurm nodes); `runtime.bind_address` in the spec
overrides it with an IP, a hostname or an interface name (e.g. ``ib0``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct

log = logging.getLogger("vlaslurm.netaddr")

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def is_bindable(address: str) -> bool:
    """True if a TCP socket can bind to `address` on some free port."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port that was free on `address` a moment ago (racy; prefer binding to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux), or None if it has none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = struct.pack("256s", name[:15].encode())
            raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 `address` (``lo`` for any loopback address), or None."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    for _, name in socket.if_nameindex():
        held = interface_address(name)
        if held is not None and (held == address or (ip.is_loopback and ipaddress.ip_address(held).is_loopback)):
            return name
    return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def _resolve(configured: str) -> str:
    """An IPv4 address for an IP, an interface name or a hostname."""
    if _is_ip(configured):
        return configured
    from_interface = interface_address(configured)
    if from_interface is not None:
        return from_interface
    try:
        return socket.gethostbyname(configured)
    except OSError as err:
        raise ValueError(
            f"runtime.bind_address {configured!r} is neither an IPv4 address, a network interface "
            f"nor a resolvable hostname ({err}); set it to e.g. 10.0.0.5, ib0 or leave it empty"
        ) from err


def bind_address(configured: str | None = None) -> str:
    """The address this rank binds to and advertises.

    `configured` (the spec's ``runtime.bind_address``) wins and must be bindable.
    Otherwise: the address the hostname resolves to, falling back to 127.0.0.1
    (with a warning) when that is not bindable. A hostname that resolves to a
    loopback address (Debian's 127.0.1.1) is kept but warned about, because
    ranks on other nodes cannot reach it.
    """
    if configured:
        address = _resolve(configured)
        if not is_bindable(address):
            raise ValueError(
                f"runtime.bind_address {configured!r} ({address}) cannot be bound on {socket.gethostname()}"
            )
        return address
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        log.warning("hostname %s does not resolve; binding to %s (single-node only)", hostname, LOOPBACK)
        return LOOPBACK
    if not is_bindable(address):
        log.warning("%s (from hostname %s) is not bindable; using %s (single-node only)", address, hostname, LOOPBACK)
        return LOOPBACK
    if ipaddress.IPv4Address(address).is_loopback:
        log.warning(
            "hostname %s resolves to loopback %s: other nodes cannot reach this rank; "
            "set runtime.bind_address for multi-node jobs",
            hostname,
            address,
        )
    return address
