"""Rendezvous: keys, rank order, atomic member files, deadlines that name who is missing."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import stat
import time
from pathlib import Path

import pytest

from vlaslurm.runtime.rendezvous import (
    Deadlines,
    Member,
    Rendezvous,
    RendezvousTimeout,
    expected_keys,
    global_rank,
    job_key_from_env,
    rendezvous_dir,
    role_rank,
    world_size,
)

EXPECTED = {"simulator": 2, "generator": 2, "trainer": 1}


def member(role: str, rank: int, host: str = "node1", **extra: object) -> Member:
    return Member(
        role=role,
        rank=rank,
        host=host,
        address="127.0.0.1",
        ports={"obs": 5000 + rank},
        pid=os.getpid(),
        node=host,
        extra=dict(extra),
    )


@pytest.fixture
def odd_dir(tmp_path: Path) -> Path:
    """A run directory with spaces and quotes in its path, on purpose."""
    return tmp_path / "run dir 'quoted' \"x\""


def test_job_key_uses_job_id_and_restart_count() -> None:
    assert job_key_from_env({"SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": "2"}, "local") == "123-r2"
    assert job_key_from_env({"SLURM_JOB_ID": "123"}, "local") == "123-r0"
    assert job_key_from_env({}, "abc") == "abc-r0"
    with pytest.raises(ValueError, match="SLURM_JOB_ID"):
        job_key_from_env({}, "")


def test_requeued_job_does_not_see_stale_files(odd_dir: Path) -> None:
    first = Rendezvous(rendezvous_dir(odd_dir, job_key_from_env({"SLURM_JOB_ID": "7"}, "x")), {"trainer": 1})
    first.join(member("trainer", 0))
    restarted = job_key_from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}, "x")
    again = Rendezvous(rendezvous_dir(odd_dir, restarted), {"trainer": 1})
    with pytest.raises(RendezvousTimeout, match=r"missing trainer\[0\]"):
        again.wait(0.05)


def test_global_rank_is_role_major_trainer_first() -> None:
    order = [global_rank(role, rank, EXPECTED) for role, rank in expected_keys(EXPECTED)]
    assert order == list(range(5))
    assert global_rank("trainer", 0, EXPECTED) == 0
    assert global_rank("generator", 1, EXPECTED) == 2
    assert global_rank("simulator", 0, EXPECTED) == 3
    assert world_size(EXPECTED) == 5
    assert [role_rank(g, EXPECTED) for g in range(5)] == expected_keys(EXPECTED)
    with pytest.raises(ValueError, match="not an expected rank"):
        global_rank("generator", 2, EXPECTED)
    with pytest.raises(ValueError, match="valid roles"):
        world_size({"controller": 1})


def test_deadlines_must_be_positive() -> None:
    assert Deadlines(first_s=600, running_s=60).running_s == 60
    with pytest.raises(ValueError, match="positive"):
        Deadlines(first_s=0, running_s=1)


def test_join_writes_private_json_atomically(odd_dir: Path) -> None:
    rdzv = Rendezvous(odd_dir, EXPECTED)
    me = member("generator", 1, gpu=3)
    rdzv.join(me)
    path = rdzv.path_of("generator", 1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Member.from_json(path.read_text()) == me
    assert json.loads(path.read_text())["ports"] == {"obs": 5001}
    assert sorted(p.name for p in odd_dir.iterdir()) == ["generator-1.json"]  # no temporary left behind
    with pytest.raises(ValueError, match="not an expected rank"):
        rdzv.join(member("generator", 5))


def test_timeout_names_missing_ranks_and_present_hosts(odd_dir: Path) -> None:
    rdzv = Rendezvous(odd_dir, {"simulator": 1, "generator": 2, "trainer": 1})
    rdzv.join(member("simulator", 0, host="node1"))
    rdzv.join(member("trainer", 0, host="node2"))
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout) as err:
        rdzv.wait(0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert str(err.value) == (
        f"rendezvous timed out after 0.3 s in {odd_dir}: missing generator[0], generator[1]; "
        "present: trainer[0]@node2, simulator[0]@node1"
    )
    with pytest.raises(RendezvousTimeout, match=re.escape("missing generator[1]; present: trainer[0]@node2")):
        rdzv.wait_for("generator", 1, 0.05)


def _join_later(directory: str, role: str, rank: int, delay_s: float) -> None:
    time.sleep(delay_s)
    Rendezvous(directory, EXPECTED).join(member(role, rank, host=f"host-{role}-{rank}"))


def test_wait_collects_members_from_other_processes(odd_dir: Path) -> None:
    ctx = mp.get_context("spawn")
    late = [("generator", 1), ("simulator", 1)]
    procs = [ctx.Process(target=_join_later, args=(str(odd_dir), role, rank, 0.2)) for role, rank in late]
    for p in procs:
        p.start()
    try:
        for role, rank in expected_keys(EXPECTED):
            if (role, rank) not in late:
                _join_later(str(odd_dir), role, rank, 0.0)
        members = Rendezvous(odd_dir, EXPECTED).wait(15)
    finally:
        for p in procs:
            p.join(10)
    assert list(members) == expected_keys(EXPECTED)
    assert members[("generator", 1)].host == "host-generator-1"
    assert members[("simulator", 1)].pid == procs[1].pid
    assert members[("trainer", 0)].endpoint("obs") == "tcp://127.0.0.1:5000"
    assert Rendezvous(odd_dir, EXPECTED).wait_for("simulator", 1, 1).host == "host-simulator-1"


def _rewrite_many(directory: str, count: int) -> None:
    rdzv = Rendezvous(directory, {"trainer": 1})
    for i in range(count):
        rdzv.join(member("trainer", 0, blob="x" * 200_000, i=i))


def test_reader_never_sees_a_partial_member_file(tmp_path: Path) -> None:
    rdzv = Rendezvous(tmp_path, {"trainer": 1})
    rdzv.join(member("trainer", 0, blob="x" * 200_000, i=-1))
    writer = mp.get_context("spawn").Process(target=_rewrite_many, args=(str(tmp_path), 80))
    writer.start()
    seen = set()
    try:
        while writer.is_alive() or not seen:
            got = rdzv.read("trainer", 0)  # would raise JSONDecodeError on a torn file
            assert got is not None and len(got.extra["blob"]) == 200_000
            seen.add(got.extra["i"])
    finally:
        writer.join(10)
    assert writer.exitcode == 0
    assert rdzv.read("trainer", 0).extra["i"] == 79
