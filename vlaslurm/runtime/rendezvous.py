"""File-based rendezvous of simulator, generator and trainer ranks.

Each rank writes ``<run_dir>/rendezvous/<job_key>/<role>-<rank>.json`` atomically (mode 0600)
and polls for every expected rank's file by name; the job key includes Slurm's restart count, so
a requeued job meets in a fresh directory.
Details and typical use: docs/runtime.md
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from vlaslurm.rundir import RunDir, write_atomic

log = logging.getLogger("vlaslurm.rendezvous")

ROLE_ORDER = ("trainer", "generator", "simulator")
"""Role-major global rank order: trainer rank 0 is global rank 0."""

Key = tuple[str, int]


class RendezvousTimeout(TimeoutError):
    """Not every expected rank joined before the deadline; the message names them."""


@dataclass(frozen=True)
class Deadlines:
    """The two deadlines of a run (as in torchtitan): generous first, tight once running."""

    first_s: float = 600.0
    """First meeting: ranks may wait for queues, imports and model loading."""
    running_s: float = 120.0
    """Every wait after the first meeting: a peer that is this late is treated as dead."""

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.running_s <= 0:
            raise ValueError(f"Deadlines must be positive, got first_s={self.first_s}, running_s={self.running_s}")


@dataclass(frozen=True)
class Member:
    """One rank as announced to its peers."""

    role: str
    rank: int
    host: str
    """Hostname, for humans and error messages."""
    address: str
    """The address its sockets are bound to; peers connect here."""
    ports: dict[str, int] = field(default_factory=dict)
    """Named ports it listens on, e.g. {"obs": 5555, "store": 29500}."""
    pid: int = 0
    node: str = ""
    """Slurm node name (SLURMD_NODENAME), if any."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else JSON-serialisable peers need (e.g. device, policy version)."""

    @property
    def key(self) -> Key:
        return (self.role, self.rank)

    def endpoint(self, port_name: str) -> str:
        """``tcp://address:port`` of a named port; KeyError naming the ports it has."""
        if port_name not in self.ports:
            raise KeyError(
                f"{self.role}[{self.rank}]@{self.host} publishes no port {port_name!r}; it has {sorted(self.ports)}"
            )
        return f"tcp://{self.address}:{self.ports[port_name]}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Member:
        data = json.loads(text)
        data["ports"] = {str(k): int(v) for k, v in data.get("ports", {}).items()}
        return cls(**data)


def job_key_from_env(environ: Mapping[str, str], local_id: str) -> str:
    """``<SLURM_JOB_ID or local_id>-r<SLURM_RESTART_COUNT or 0>``.

    For a heterogeneous job every component sees the same SLURM_JOB_ID (the
    leader's), so all roles agree on the key.
    """
    job_id = environ.get("SLURM_JOB_ID") or local_id
    if not job_id:
        raise ValueError("job_key_from_env: SLURM_JOB_ID is not set and local_id is empty")
    restarts = environ.get("SLURM_RESTART_COUNT") or "0"
    return f"{job_id}-r{int(restarts)}"


def rendezvous_dir(run_dir: str | os.PathLike[str], job_key: str) -> Path:
    """``<run_dir>/rendezvous/<job_key>``."""
    return RunDir(run_dir).rendezvous(job_key)


def _check_expected(expected: Mapping[str, int]) -> None:
    unknown = sorted(set(expected) - set(ROLE_ORDER))
    if unknown:
        raise ValueError(f"unknown roles {unknown}; valid roles are {list(ROLE_ORDER)}")
    negative = {r: n for r, n in expected.items() if n < 0}
    if negative:
        raise ValueError(f"rank counts must be >= 0, got {negative}")


def world_size(expected: Mapping[str, int]) -> int:
    """Total ranks over all roles."""
    _check_expected(expected)
    return sum(expected.values())


def global_rank(role: str, rank: int, expected: Mapping[str, int]) -> int:
    """Role-major global rank (trainer, generator, simulator); trainer[0] is 0."""
    _check_expected(expected)
    if role not in expected or not 0 <= rank < expected[role]:
        raise ValueError(f"{role}[{rank}] is not an expected rank; expected {dict(expected)}")
    offset = sum(expected.get(r, 0) for r in ROLE_ORDER[: ROLE_ORDER.index(role)])
    return offset + rank


def role_rank(global_rank_: int, expected: Mapping[str, int]) -> Key:
    """Inverse of `global_rank`: (role, rank) of a global rank."""
    remaining = global_rank_
    for role in ROLE_ORDER:
        count = expected.get(role, 0)
        if 0 <= remaining < count:
            return (role, remaining)
        remaining -= count
    raise ValueError(f"global rank {global_rank_} is outside world size {world_size(expected)}")


def expected_keys(expected: Mapping[str, int]) -> list[Key]:
    """All (role, rank) pairs in global-rank order."""
    return [(role, rank) for role in ROLE_ORDER for rank in range(expected.get(role, 0))]


def _describe(keys: list[Key]) -> str:
    return ", ".join(f"{role}[{rank}]" for role, rank in keys) or "none"


def _describe_present(members: Mapping[Key, Member]) -> str:
    return ", ".join(f"{m.role}[{m.rank}]@{m.host}" for m in members.values()) or "none"


class Rendezvous:
    """One rendezvous directory and the ranks expected to meet in it."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        expected: Mapping[str, int],
        poll_min_s: float = 0.01,
        poll_max_s: float = 0.5,
    ) -> None:
        _check_expected(expected)
        self.directory = Path(directory)
        self.expected = dict(expected)
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s

    def path_of(self, role: str, rank: int) -> Path:
        return self.directory / f"{role}-{rank}.json"

    def join(self, member: Member) -> None:
        """Announce `member` (overwrites an earlier file of the same rank, e.g. a restarted worker)."""
        global_rank(member.role, member.rank, self.expected)  # validates role and rank
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self.path_of(member.role, member.rank), member.to_json().encode())
        log.debug("joined %s as %s[%d]@%s", self.directory, member.role, member.rank, member.host)

    def read(self, role: str, rank: int) -> Member | None:
        """The member file of one rank, or None if it has not joined (yet)."""
        try:
            text = self.path_of(role, rank).read_text()
        except FileNotFoundError:
            return None
        member = Member.from_json(text)
        if member.key != (role, rank):
            raise ValueError(f"{self.path_of(role, rank)} describes {member.role}[{member.rank}]")
        return member

    def present(self) -> dict[Key, Member]:
        """Every expected rank that has joined so far, in global-rank order."""
        found = {}
        for role, rank in expected_keys(self.expected):
            member = self.read(role, rank)
            if member is not None:
                found[(role, rank)] = member
        return found

    def wait(self, timeout_s: float) -> dict[Key, Member]:
        """All expected members, keyed (role, rank); RendezvousTimeout naming who is missing."""
        return self._wait_keys(expected_keys(self.expected), timeout_s)

    def wait_for(self, role: str, rank: int, timeout_s: float) -> Member:
        """One member; RendezvousTimeout naming it if it does not join in time."""
        global_rank(role, rank, self.expected)
        return self._wait_keys([(role, rank)], timeout_s)[(role, rank)]

    def _wait_keys(self, keys: list[Key], timeout_s: float) -> dict[Key, Member]:
        deadline = time.monotonic() + timeout_s
        found: dict[Key, Member] = {}
        delay = self.poll_min_s
        while True:
            for key in keys:
                if key not in found and (member := self.read(*key)) is not None:
                    found[key] = member
            if len(found) == len(keys):
                return {key: found[key] for key in keys}
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(keys, found, timeout_s)
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, self.poll_max_s)

    def _timeout(self, keys: list[Key], found: dict[Key, Member], timeout_s: float) -> RendezvousTimeout:
        missing = [key for key in keys if key not in found]
        present = {key: found[key] for key in keys if key in found} if len(keys) > 1 else self.present()
        return RendezvousTimeout(
            f"rendezvous timed out after {timeout_s:g} s in {self.directory}: "
            f"missing {_describe(missing)}; present: {_describe_present(present)}"
        )
