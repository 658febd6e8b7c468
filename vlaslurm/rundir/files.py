"""Writing and reading run-directory files safely: atomic replaces, appended lines, torn-line-tolerant reads."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import List


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `path` so readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_quietly(path.parent)


def fsync_quietly(path: Path) -> None:
    """fsync a file or directory where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on directories
    finally:
        os.close(fd)


def append_line(path: Path, line: str, mode: int = 0o644) -> None:
    """Append one line with a single O_APPEND write, so concurrent writers never interleave."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> List[dict]:
    """The records of a JSON-lines file, [] if it does not exist (lines torn by a crash are skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
