"""Shared helpers of the runtime tests: write a synthetic spec, run it locally, read what it left.

A run is the real thing: `run_local` starts every rank as its own process, as
`vlaslurm run` does. The synthetic workload sleeps instead of computing, so the
scheduling claims can be checked on two cores.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pandas as pd
import yaml

from vlaslurm.rundir import read_events, read_ledger
from vlaslurm.runtime import stream
from vlaslurm.runtime.local import run_local
from vlaslurm.spec import load_spec

RANKS_2 = "runtime.local_ranks={simulator: 2, generator: 2, trainer: 2}"


def synthetic_spec(
    mode: str = "sync",
    num_envs: int = 8,
    step_ms: float = 5.0,
    episode_steps: int = 10,
    action_chunk: int = 2,
    steps_per_update: int = 64,
    update_ms: float = 10.0,
    total_env_steps: int = 480,
    **rollout,
) -> dict:
    """A small synthetic experiment; `rollout` entries override the rollout section."""
    return {
        "name": "rt",
        "env": {
            "type": "synthetic",
            "num_envs": num_envs,
            "step_ms": {"dist": "constant", "mean": step_ms},
            "episode_steps": episode_steps,
        },
        "model": {"type": "synthetic", "action_chunk": action_chunk, "forward_ms": {"base": 1.0, "per_item": 0.1}},
        "algo": {"type": "synthetic", "steps_per_update": steps_per_update, "update_ms": update_ms},
        "rollout": {
            "mode": mode,
            "total_env_steps": total_env_steps,
            "weight_sync": "nccl",
            "batching": {"max_batch": 64, "max_wait_ms": 2},
            **rollout,
        },
        "runtime": {"first_meeting_timeout_s": 60, "timeout_s": 20},
    }


@dataclass
class Run:
    """What a finished local run left in its run directory."""

    rc: int
    run_dir: Path

    @property
    def ledger(self) -> pd.DataFrame:
        return read_ledger(self.run_dir)

    def events(self, kind: str, role: Optional[str] = None) -> List[dict]:
        return [e for e in read_events(self.run_dir) if e["ev"] == kind and (role is None or e["role"] == role)]

    def counters(self, role: str) -> List[dict]:
        paths = sorted(glob.glob(str(self.run_dir / "counters" / f"{role}-*.json")))
        return [json.loads(Path(p).read_text()) for p in paths]

    def exits(self) -> Dict[str, dict]:
        lines = (self.run_dir / "exit_record.jsonl").read_text().splitlines()
        return {rec["step"]: rec for rec in map(json.loads, lines)}

    def log(self, role: str, rank: int) -> str:
        return (self.run_dir / "logs" / role / f"{rank}.log").read_text(errors="replace")


def run_spec(
    tmp_path: Path,
    spec: dict,
    overrides: Sequence[str] = (),
    name: str = "run",
    timeout_s: float = 90,
) -> Run:
    """Write `spec` under `tmp_path` and run it locally to the end, without the simulators' rendering preflight
    (25-40 s per ManiSkill or LIBERO run on two cores): test_preflight checks it, and the experiment jobs on the
    local Slurm cluster show that a simulator rank runs it."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / name
    loaded = load_spec(path, list(overrides))
    with preflight_off():
        rc = run_local(loaded, tmp_path / "runs", run_dir, echo=False, timeout_s=timeout_s)
    return Run(rc, run_dir)


_preflight_lock = threading.Lock()
_preflight_runs = 0  # runs under way that asked for no preflight
_preflight_before: Optional[str] = None


@contextlib.contextmanager
def preflight_off() -> Iterator[None]:
    """VLASLURM_PREFLIGHT=off (the ranks inherit it) while any local run is under way, then as before. Tests run
    several at once from threads: a MonkeyPatch each restored what another had set, and `off` stayed for the
    worker's later tests (a job they submit to Slurm would inherit it and skip its preflight)."""
    global _preflight_runs, _preflight_before
    with _preflight_lock:
        if _preflight_runs == 0:
            _preflight_before = os.environ.get("VLASLURM_PREFLIGHT")
            os.environ["VLASLURM_PREFLIGHT"] = "off"
        _preflight_runs += 1
    try:
        yield
    finally:
        with _preflight_lock:
            _preflight_runs -= 1
            if _preflight_runs == 0:
                if _preflight_before is None:
                    os.environ.pop("VLASLURM_PREFLIGHT", None)
                else:
                    os.environ["VLASLURM_PREFLIGHT"] = _preflight_before


def served_versions(run: Run) -> Dict[Tuple[int, int, int], List[int]]:
    """(env_id, episode, step) -> versions of every batch that served it, leaving out serves by a process
    of a generator rank that was restarted and served it again: such a reply died with its process (or
    with the simulator's socket to it), and the simulator resent the request to the same rank."""
    serves: Dict[Tuple[int, int, int], List[Tuple[int, int, int]]] = {}
    for batch in run.events("batch", "generator"):
        for env_id, episode, step in batch["items"]:
            serves.setdefault((env_id, episode, step), []).append((batch["rank"], batch.get("inc", 0), batch["v"]))
    return {key: _newest_processes(found) for key, found in serves.items()}


def check_trained_versions(run: Run, max_staleness: int) -> int:
    """Every used sample's behaviour version equals the version of the one batch that served it."""
    served = served_versions(run)
    used = run.ledger[run.ledger.used]
    assert len(used) > 0
    for row in used.itertuples():
        for step in row.step_ids:
            versions = served.get((row.env_id, row.episode, int(step)))
            assert versions is not None, f"{row.traj_id} step {step} was never served"
            assert versions == [row.behavior_version], (
                f"{row.traj_id} step {step}: served {versions}, ledger says {row.behavior_version}"
            )
        assert row.lag == row.consumed_version - row.behavior_version
        assert 0 <= row.lag <= max_staleness, row
    return len(used)


def _newest_processes(serves: List[Tuple[int, int, int]]) -> List[int]:
    newest: Dict[int, int] = {}
    for rank, inc, _ in serves:
        newest[rank] = max(newest.get(rank, inc), inc)
    return [v for rank, inc, v in serves if inc == newest[rank]]


def overlaps(a: Tuple[float, float], b: Tuple[float, float]) -> bool:
    """Whether two open time intervals intersect."""
    return max(a[0], b[0]) < min(a[1], b[1])


def wait_for(predicate, timeout_s: float, what: str):
    """The first truthy value of `predicate()` within `timeout_s`; AssertionError naming `what` otherwise."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


def member_pid(run_dir: Path, role: str, rank: int) -> int:
    """The pid in the newest rendezvous file of role[rank] (0 until it has joined)."""
    files = sorted((run_dir / "rendezvous").glob(f"*/{role}-{rank}.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(files[-1].read_text())["pid"] if files else 0


class RawStream:
    """A keyless process on a Router's wire (`vlaslurm.runtime.stream`): a hello with any routing id, then
    whatever frames it likes (no envelope, no MAC unless it brings them)."""

    def __init__(self, endpoint: str, identity: Optional[bytes] = b"raw") -> None:
        self.sock = socket.create_connection(stream.parse_endpoint(endpoint), timeout=10)
        if identity is not None:
            self.sock.sendall(stream.hello(identity))

    def send(self, frames: Sequence[bytes]) -> None:
        header, views = stream.message_header(frames)
        self.sock.sendall(header)
        for view in views:
            self.sock.sendall(view)

    def has_input(self, timeout_s: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_stream_send(endpoint: str, messages: Sequence[Sequence[bytes]], identity: bytes = b"raw") -> None:
    """`messages` through one keyless connection, in this order; a peer that drops the connection (an
    oversized frame) ends the sending quietly."""
    with RawStream(endpoint, identity) as raw:
        try:
            for frames in messages:
                raw.send(frames)
            raw.sock.shutdown(socket.SHUT_WR)
            raw.has_input(5)  # the peer's end of stream once it read everything (or its drop)
        except OSError:
            pass
