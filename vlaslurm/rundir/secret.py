"""The per-run secret that keys every message's MAC.

`create_secret(run_dir)` writes it once, born 0600 and published with ``os.link`` (no reader sees
a partial or readable secret; two creators cannot overwrite each other); `load_secret(run_dir)`
refuses a file that group or others could read; `derive_key(secret, label)` gives every other use
its own key. Details: docs/runtime.md
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

SECRET_FILE = "secret"
SECRET_BYTES = 32


class SecretError(RuntimeError):
    """The run secret is missing, malformed or not private."""


def secret_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where the secret of `run_dir` lives."""
    return Path(run_dir) / SECRET_FILE


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only remove bits; make the mode exact
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)


def create_secret(run_dir: str | os.PathLike[str]) -> bytes:
    """Create ``<run_dir>/secret`` (mode 0600) and return the key; FileExistsError if present."""
    final = secret_path(run_dir)
    key = secrets.token_bytes(SECRET_BYTES)
    tmp = final.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    _write_private(tmp, key.hex() + "\n")
    try:
        os.link(tmp, final)
    finally:
        os.unlink(tmp)
    return key


def ensure_secret(run_dir: str | os.PathLike[str]) -> bytes:
    """Load the run secret, creating it first if no one has yet (safe under races)."""
    try:
        return create_secret(run_dir)
    except FileExistsError:
        return load_secret(run_dir)


def load_secret(run_dir: str | os.PathLike[str]) -> bytes:
    """The key in ``<run_dir>/secret``; SecretError if missing, malformed or readable by others."""
    path = secret_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as err:
        raise SecretError(f"run secret {path} does not exist; the launcher creates it with create_secret()") from err
    try:
        info = os.fstat(fd)
        _check_private(path, info)
        text = os.read(fd, 4 * SECRET_BYTES).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    return _parse(path, text)


def _check_private(path: Path, info: os.stat_result) -> None:
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise SecretError(
            f"run secret {path} has mode {mode:04o}: group/others can read it; "
            f"refusing to use it (run `chmod 600 {path}` if the file is trustworthy, or create a new run)"
        )
    if info.st_uid != os.getuid():
        raise SecretError(f"run secret {path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")


def _parse(path: Path, text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError as err:
        raise SecretError(f"run secret {path} is not hex text") from err
    if len(key) != SECRET_BYTES:
        raise SecretError(f"run secret {path} holds {len(key)} bytes; expected {SECRET_BYTES}")
    return key


def derive_key(secret: bytes, label: str) -> bytes:
    """A 32-byte key for one use of the run secret, named by `label` (HMAC-SHA256 of the label)."""
    return hmac.new(secret, label.encode(), hashlib.sha256).digest()
