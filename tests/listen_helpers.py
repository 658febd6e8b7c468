"""What a process really listens on, read from /proc (not from what the code says it bound)."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

LISTEN = "0A"


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process `pid` holds open (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.append(_decode(fields[1], family))
    return found


def _decode(local: str, family: int) -> tuple[str, int]:
    hex_ip, hex_port = local.split(":")
    raw = bytes.fromhex(hex_ip)
    # /proc prints each 32-bit word in host (little-endian) order
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(socket.inet_ntop(family, packed))), int(hex_port, 16)


def is_wildcard(address: str) -> bool:
    """0.0.0.0 or :: (listens on every interface)."""
    return ipaddress.ip_address(address).is_unspecified
