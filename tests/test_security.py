"""A locked-down job: private run directory and secret, and messages without the run secret refused.

The refusal is checked at the role level: while a real local run is going, a client with a wrong key
and one with no MAC at all talk to the running generator and trainer; both ranks drop the messages,
log them with the peer, count them, and the run finishes unharmed (no forged segment in the ledger).
Meanwhile every rank's listening sockets (ZeroMQ, the TCPStore, gloo), read from /proc, are bound to
its own address, none to every interface.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import msgpack
from listen_helpers import is_wildcard, listening
from runtime_helpers import RawStream, run_spec, synthetic_spec, wait_for

from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime.transport import WIRE_VERSION, Dealer, Message, Push


def member(run_dir: Path, role: str) -> dict:
    files = list((run_dir / "rendezvous").glob(f"*/{role}-0.json"))
    return json.loads(files[0].read_text()) if files else {}


def test_wrong_or_missing_secret_is_refused_and_logged(tmp_path: Path) -> None:
    spec = synthetic_spec("async", total_env_steps=2000, max_staleness=100)
    run_dir = tmp_path / "run"
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=run_spec(tmp_path, spec, timeout_s=90)))
    runner.start()
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 60, "first update")
        gen, trainer = member(run_dir, "generator"), member(run_dir, "trainer")
        sockets = {role: listening(member(run_dir, role)["pid"]) for role in ("simulator", "generator", "trainer")}
        wrong = os.urandom(32)
        request = Message(
            msgs.OBS,
            {
                "env_ids": [0],
                "episodes": [0],
                "steps": [0],
                "seeds": [0],
                "instructions": ["x"],
                "counts": [1],
                "sub_groups": [0],
                "min_versions": [0],
                "sent_at": 0.0,
                "sim_rank": 0,
            },
        )
        with Dealer(wrong, identity=b"intruder", name="intruder") as dealer:
            dealer.connect(f"tcp://{gen['address']}:{gen['ports']['obs']}")
            dealer.send(request, timeout_ms=5000)
            assert dealer.recv(1000) is None  # no answer to a forged request
        raw = RawStream(f"tcp://{gen['address']}:{gen['ports']['obs']}")  # no envelope, no MAC at all
        raw.send([msgpack.packb({"v": WIRE_VERSION, "h": b"kind", "mac": b""})])
        forged = Message(msgs.SEGMENT, {"traj_id": "forged"})
        with Push(wrong, name="forger") as push:
            push.connect(f"tcp://{trainer['address']}:{trainer['ports']['segments']}")
            push.send(forged, timeout_ms=5000)
            time.sleep(0.5)
        raw.close()
    finally:
        runner.join(120)
    run = result["run"]
    assert run.rc == 0, run.log("trainer", 0)[-2000:]
    assert (trainer["address"], trainer["ports"]["store"]) in sockets["trainer"]  # the TCPStore, on trainer[0]
    assert (trainer["address"], trainer["ports"]["segments"]) in sockets["trainer"]
    assert (gen["address"], gen["ports"]["obs"]) in sockets["generator"]
    wildcard = {role: [s for s in found if is_wildcard(s[0])] for role, found in sockets.items()}
    assert wildcard == {"simulator": [], "generator": [], "trainer": []}, sockets
    gen_log, trainer_log = run.log("generator", 0), run.log("trainer", 0)
    assert "dropped message from peer" in gen_log and "bad MAC" in gen_log
    assert "envelope lacks a signed header or a MAC" in gen_log
    assert "dropped message from peer" in trainer_log and "bad MAC" in trainer_log
    (generator,) = run.counters("generator")
    (trainer_counters,) = run.counters("trainer")
    assert generator["rejected_messages"] >= 2 and trainer_counters["rejected_messages"] >= 1
    assert "forged" not in set(run.ledger.traj_id)


def test_run_directory_and_secret_are_private(tmp_path: Path) -> None:
    run = run_spec(tmp_path, synthetic_spec("sync", total_env_steps=128))
    assert run.rc == 0
    assert stat.S_IMODE(run.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run.run_dir / "secret").stat().st_mode) == 0o600
    for path in (run.run_dir / "rendezvous").rglob("*.json"):  # addresses and ports: private too
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
