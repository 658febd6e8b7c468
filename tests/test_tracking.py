"""MLflow tracking against a real `mlflow server` on loopback: what a run logs, and that a slow,
absent or restarted server never stops or slows the run, and the buffer catches up.

The server runs with job execution off (its huey workers would cost two cores more) and
one worker; it is started once per module (~20 s here) and restarted by the outage test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest
import yaml
from PIL import Image

from vlaslurm.cli import main
from vlaslurm.rundir import RunDir, read_ledger
from vlaslurm.rundir.layout import TRACKER_STATE
from vlaslurm.runtime.failures import FRAME_MS
from vlaslurm.runtime.local import run_local
from vlaslurm.spec import load_spec
from vlaslurm.tracking import Tracker, read_run_id
from vlaslurm.tracking.buffer import Row, RowBuffer
from vlaslurm.tracking.follow import RunFollower
from vlaslurm.tracking.params import flatten

SPEC = {
    "name": "trk",
    "env": {"type": "synthetic", "num_envs": 8, "step_ms": {"dist": "constant", "mean": 5}, "episode_steps": 10},
    "model": {"type": "synthetic", "action_chunk": 2},
    "algo": {"type": "synthetic", "steps_per_update": 64, "update_ms": 10},
    "rollout": {"mode": "async", "total_env_steps": 600},
    "runtime": {"first_meeting_timeout_s": 60, "timeout_s": 30},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store and proxied artifacts; stop() and start() again keep both."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 150) -> None:
        cmd = [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'db.sqlite'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        pytest.fail(f"mlflow server did not answer in {timeout_s} s: {(self.root / 'server.log').read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def run(
    tmp: Path, name: str, *overrides: str, env: Optional[dict] = None, total: int = 600, base: dict = SPEC
) -> tuple:
    """A real local run (every role a process) of `base`; returns (run dir, wall seconds)."""
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({**base, "rollout": {**base["rollout"], "total_env_steps": total}}))
    env = {"VLASLURM_TRACKING": "on", **(env or {})}  # the ranks inherit it (the suite turns it off: conftest.py)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.monotonic()
        rc = run_local(load_spec(spec, list(overrides)), tmp / "runs", tmp / name, echo=False, timeout_s=150)
        wall = time.monotonic() - t0
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    assert rc == 0, (tmp / name / "logs" / "trainer" / "0.log").read_text()[-3000:]
    return tmp / name, wall


def metrics_lines(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ pieces, no server


def test_buffer_is_bounded_and_counts_what_it_drops():
    buf = RowBuffer(3)
    rows = [Row({"a": i, "b": i}, i, i) for i in range(5)]
    for row in rows:
        buf.put(row)
    assert len(buf) == 3 and buf.dropped_rows == 2 and buf.dropped_values == 4
    head = buf.head(max_values=4)
    assert [r.step for r in head] == [2, 3]
    buf.put(Row({"a": 9}, 9, 9))  # drops row 2 while 2 and 3 are "being sent"
    buf.pop(head)
    assert [r.step for r in buf.head(100)] == [4, 9]


def test_follower_reads_complete_lines_and_changed_counters(tmp_path):
    (tmp_path / "counters").mkdir()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"env_steps": 64, "wall_s": 1.0, "rollout/success_rate": float("nan")})
        + "\n"
        + '{"env_steps": 128, "wall'
    )  # a line still being written
    (tmp_path / "counters" / "generator-0.json").write_text(json.dumps({"utilisation": 0.5, "note": "x"}))
    follower = RunFollower(tmp_path)
    rows = follower.poll()
    assert [r.step for r in rows] == [64, 64]
    assert rows[0].metrics == {"env_steps": 64.0, "wall_s": 1.0}  # NaN is not sent
    assert rows[1].metrics == {"system/generator-0/utilisation": 0.5}
    with metrics.open("a") as handle:
        handle.write('_s": 2.0}\n')
    rows = follower.poll()  # the counters did not change: only the completed line
    assert [(r.step, r.line) for r in rows] == [(128, 2)]


def test_follower_resumes_after_what_was_sent_even_when_a_resume_cut_the_file(tmp_path):
    rows = [json.dumps({"version": v, "env_steps": 64 * v, "wall_s": v}) + "\n" for v in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(rows[:3]))  # cut back to version 3 of the 5 sent
    follower = RunFollower(tmp_path, start_line=5)
    assert follower.poll() == []
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write(rows[3])  # version 4, redone after the resume
    assert [r.step for r in follower.poll()] == [256]


def test_a_restarted_tracker_does_not_send_an_evaluation_twice(tmp_path):
    """The tracker's state keeps the last evals-log line it sent, as for metrics lines: a restarted follower (a
    resumed trainer) sends only evaluations after it."""
    from vlaslurm.rundir import RunDir

    layout = RunDir(tmp_path)
    lines = [json.dumps({"version": v, "env_steps": 64 * v, "success_rate": 0.5}) + "\n" for v in (3, 6, 9)]
    layout.evals_log.write_text("".join(lines[:2]))
    first = RunFollower(tmp_path).eval_rows()
    assert [(r.step, r.eval_line) for r in first] == [(192, 1), (384, 2)]
    layout.tracking.mkdir(parents=True, exist_ok=True)  # what the first tracker saved after sending them
    (layout.tracking / TRACKER_STATE).write_text(json.dumps({"sent_line": 0, "sent_eval_line": 2}))
    layout.evals_log.write_text("".join(lines))
    again = Tracker(tmp_path, "sqlite:///unused.db", "x")
    assert again.follower is not None and [r.step for r in again.follower.eval_rows()] == [576]


def test_follower_sends_evaluations_while_training_and_their_gifs(tmp_path):
    """Each evaluation line becomes eval/... metrics at the env steps its version was trained on; its failed
    episodes' GIFs are named for upload beside the training ones."""
    from vlaslurm.rundir import RunDir

    layout = RunDir(tmp_path)
    gif = layout.periodic_eval(3) / layout.failures.name / "a" / "0.gif"
    gif.parent.mkdir(parents=True)
    gif.write_bytes(b"GIF89a")
    train_gif = layout.failures / "b" / "1.gif"
    train_gif.parent.mkdir(parents=True)
    train_gif.write_bytes(b"GIF89a")
    line = {"version": 3, "env_steps": 192, "success_rate": 0.5, "episodes": 4, "success/a": 0.0, "success/b": 1.0}
    layout.evals_log.write_text(json.dumps(line) + "\n" + '{"version": 6, "env')  # the second still being written
    follower = RunFollower(tmp_path)
    rows = follower.eval_rows()
    assert [r.step for r in rows] == [192]
    assert rows[0].metrics == {
        "eval/version": 3.0,
        "eval/env_steps": 192.0,
        "eval/success_rate": 0.5,
        "eval/episodes": 4.0,
        "eval/success/a": 0.0,
        "eval/success/b": 1.0,
    }
    assert follower.eval_rows() == []
    found = follower.new_failures()
    assert found == sorted([gif, train_gif]) and follower.new_failures() == []
    assert {p.parent.relative_to(tmp_path).as_posix() for p in found} == {"evals/v00000003/failures/a", "failures/b"}


def test_flatten():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "None"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["refused", "black hole"])
def test_log_never_blocks_and_close_keeps_its_deadline(tmp_path, kind):
    """A server that refuses connections, or accepts and never answers: log() returns at once, the
    buffer stays bounded (drops counted), close() returns by its deadline."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    if kind == "black hole":
        hole.listen(64)  # the kernel completes handshakes; nobody ever reads
    port = hole.getsockname()[1]
    if kind == "refused":
        hole.close()
    (tmp_path / "run.json").write_text(json.dumps({"name": "x", "created": time.time()}))
    tracker = Tracker(tmp_path, f"http://127.0.0.1:{port}", "x", capacity=1000, request_timeout_s=1, poll_s=0.1).start()
    # No call waits for the server: a blocked one would take at least the request timeout (1 s). The whole loop's
    # time is no measure of that (it took 2.6 s beside the writer's MLflow import in a loaded suite).
    slowest = 0.0
    for i in range(20_000):
        t0 = time.perf_counter()
        tracker.log({"loss": float(i)}, i)
        slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 0.5, f"one log() call took {slowest:.2f} s"
    deadline = time.monotonic() + 60  # the writer imports MLflow first (seconds), then tries and fails
    while tracker.failures < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    t0 = time.monotonic()
    summary = tracker.close(timeout_s=2.0)
    assert time.monotonic() - t0 < 4.0
    assert summary["run_id"] is None and summary["failures"] >= 2
    assert summary["pending_rows"] <= 1000 and summary["dropped_rows"] >= 19_000
    hole.close()


def test_a_run_that_ends_before_the_writer_has_started_is_still_tracked(tmp_path):
    """A fresh SQLite store takes its schema (MLflow's migrations: ~1.5 s here, tens of seconds on a busy node, as
    a Slurm job of the suite once showed) before the writer can make its run: a run that ends sooner still gets its
    MLflow run and its rows, because close's short deadline counts from the writer's start."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "x" / "20261207-000000"
    run_dir.mkdir(parents=True)
    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    tracker = Tracker(run_dir, uri, "x", poll_s=0.1).start()
    tracker.log({"loss": 1.5}, 7)
    # Far shorter than the migrations. Once the writer has started it applies: on a busy machine it can cut the final
    # rows and the run's status (a real run's 10 s do not), so only what the writer sent as it started is checked.
    summary = tracker.close(timeout_s=0.1)
    assert summary["run_id"] and summary["sent_rows"] >= 1, summary
    run = MlflowClient(tracking_uri=uri).get_run(str(summary["run_id"]))
    assert run.data.metrics["loss"] == 1.5


def test_a_draining_run_does_not_wait_for_the_writers_start(tmp_path, monkeypatch):
    """A drain before a requeue (`wait_for_start=False`) keeps close's short deadline: Slurm's kill is near. The
    writer's start is held open here (a stand-in for a slow MLflow import, which cannot be made slow on demand)."""
    from vlaslurm.tracking import tracker as tracker_module

    release = threading.Event()
    monkeypatch.setattr(tracker_module, "prepare_sqlite", lambda uri: release.wait(30))
    run_dir = tmp_path / "runs" / "x" / "20261207-000000"
    run_dir.mkdir(parents=True)
    tracker = Tracker(run_dir, f"sqlite:///{tmp_path / 'mlflow.db'}", "x", poll_s=0.1).start()
    tracker.log({"loss": 1.5}, 7)
    try:
        summary = tracker.close(timeout_s=0.1, wait_for_start=False)
        assert summary["run_id"] is None and summary["pending_rows"] == 1, summary  # it did not wait
    finally:
        release.set()


# ------------------------------------------------------------------ real runs, real server


@pytest.mark.slow
def test_run_logs_params_metrics_system_metrics_and_artifacts(server, tmp_path):
    run_dir, _ = run(tmp_path, "logged", f"tracking.uri={server.uri}", "tracking.experiment=trk")
    run_id = read_run_id(run_dir)
    assert run_id, (run_dir / "logs" / "trainer" / "0.log").read_text()[-3000:]
    c = client(server.uri)
    got = c.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.data.tags["vlaslurm.run_dir"] == str(run_dir.resolve()) and got.data.tags["vlaslurm.mode"] == "async"
    params = got.data.params
    assert params["rollout.mode"] == "async" and params["rollout.total_env_steps"] == "600"
    assert params["env.num_envs"] == "8" and params["placement.ranks.trainer"] == "1"
    assert params["placement.kind"] == "local" and params["placement.nodes.simulator"]

    lines = metrics_lines(run_dir)
    history = c.get_metric_history(run_id, "env_steps")
    assert sorted(m.step for m in history) == [row["env_steps"] for row in lines]  # step = env steps
    assert all(m.timestamp > 0 for m in history)
    for key in (
        "charts/SPS",
        "wall_s",
        "staleness/mean",
        "staleness/p99",
        "staleness/dropped_segments",
        "trainer/update_s",
    ):
        assert len(c.get_metric_history(run_id, key)) == len(lines), key
    keys = set(got.data.metrics)
    for key in (
        "system/generator-0/utilisation",
        "system/generator-0/queue_len_p50",
        "system/generator-0/batch_size_mean",
        "system/generator-0/request_latency_s_p99",
        "system/simulator-0/utilisation",
        "system/trainer-0/utilisation",
        "ledger/lag_mean",
        "ledger/lag_p99",
        "ledger/lag_max",
        "ledger/dropped_segments",
        "rollout/success_rate/synthetic",
        "tracking/dropped_rows",
    ):
        assert key in keys, (key, sorted(keys))
    assert got.data.metrics["tracking/dropped_rows"] == 0

    artifacts = {a.path for a in c.list_artifacts(run_id)}
    assert {"spec.yaml", "run.json", "ledger.parquet", "metrics.jsonl", "counters"} <= artifacts, artifacts
    if "tracking" in artifacts:
        assert [a.path for a in c.list_artifacts(run_id, "tracking")] == ["tracking/failed_trajectories.json"]


@pytest.mark.slow
def test_server_stopped_mid_run_run_finishes_on_time_and_metrics_arrive(server, tmp_path):
    """Stop the server once the tracker made its MLflow run, restart it (same port, same database) while
    the run goes on and ends: training is not slowed, and every metrics row arrives afterwards.
    Then `vlaslurm track` sends the records of the baseline, which ran without tracking."""
    total = 2000
    base_dir, _ = run(tmp_path, "baseline", env={"VLASLURM_TRACKING": "off"}, total=total)
    assert not (base_dir / "mlflow_run_id").exists()

    done = {}
    run_dir = tmp_path / "outage"

    def go():
        done["result"] = run(
            tmp_path,
            "outage",
            f"tracking.uri={server.uri}",
            "tracking.experiment=trk",
            env={"VLASLURM_TRACKING_CLOSE_S": "90"},
            total=total,
        )
        done["end"] = time.monotonic()

    thread = threading.Thread(target=go)
    thread.start()
    c = client(server.uri)
    deadline = time.monotonic() + 90
    # Stop once the tracker made its run, or at 25% of the run on a node so busy that MLflow's import is slower.
    while time.monotonic() < deadline and not (run_dir.exists() and read_run_id(run_dir)):
        progress = metrics_lines(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if progress and progress[-1]["env_steps"] > 0.25 * total:
            break
        time.sleep(0.1)
    connected = run_dir.exists() and read_run_id(run_dir) is not None
    server.stop(signal.SIGKILL)  # gone at once, as a crashed server
    stopped_at = len(metrics_lines(run_dir))
    server.start()  # ~20 s here: the run ends meanwhile and its tracker retries from close()
    back = time.monotonic()
    thread.join(120)
    assert not thread.is_alive()

    lines = metrics_lines(run_dir)
    assert stopped_at < len(lines), "the server was stopped only after the run had ended"
    assert lines[-1]["wall_s"] < 3 * metrics_lines(base_dir)[-1]["wall_s"] + 10  # training not slowed (generous:
    # the restarting server competes for the same two cores)
    assert done["end"] - back < 45  # caught up soon after the server came back, long before the 90 s close deadline
    log = (run_dir / "logs" / "trainer" / "0.log").read_text()
    if connected:  # else MLflow's import outlasted the outage and the tracker never saw it
        assert "unavailable" in log and "reachable again" in log, log[-3000:]
    run_id = read_run_id(run_dir)
    assert run_id, log[-3000:]
    history = c.get_metric_history(run_id, "env_steps")
    assert sorted(m.step for m in history) == [row["env_steps"] for row in lines]
    got = c.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.metrics["tracking/dropped_rows"] == 0
    assert "ledger.parquet" in {a.path for a in c.list_artifacts(run_id)}

    # The baseline ran without tracking: `vlaslurm track` sends its records afterwards.
    assert main(["track", str(base_dir), "--tracking-uri", server.uri, "--timeout", "60"]) == 0
    late = read_run_id(base_dir)
    assert late and c.get_run(late).info.status == "FINISHED"
    assert len(c.get_metric_history(late, "env_steps")) == len(metrics_lines(base_dir))


@pytest.mark.slow
def test_failed_episodes_frames_are_logged_as_artifacts(server, tmp_path):
    """The toy env renders images; a synthetic (random) policy fails most episodes. Each task's first
    `tracking.failures_per_task` failed episodes reach MLflow as GIFs under failures/<task>/, once each."""
    toy = {**SPEC, "name": "trkfail", "env": {"type": "toy", "num_envs": 8, "max_episode_steps": 12}}
    run_dir, _ = run(
        tmp_path,
        "failures",
        f"tracking.uri={server.uri}",
        "tracking.experiment=trk",
        "tracking.failures_per_task=2",
        base=toy,
        total=400,
    )
    run_id = read_run_id(run_dir)
    assert run_id, (run_dir / "logs" / "trainer" / "0.log").read_text()[-3000:]
    local = sorted(p.name for p in (run_dir / "failures" / "reach").glob("*.gif"))
    assert len(local) == 2, local  # the limit, though far more episodes failed
    c = client(server.uri)
    assert [a.path for a in c.list_artifacts(run_id, "failures")] == ["failures/reach"]
    logged = c.list_artifacts(run_id, "failures/reach")
    assert sorted(a.path for a in logged) == [f"failures/reach/{name}" for name in local]
    assert all(a.file_size == (run_dir / "failures" / "reach" / Path(a.path).name).stat().st_size for a in logged)
    got = Path(c.download_artifacts(run_id, logged[0].path, str(tmp_path / "down")))
    with Image.open(got) as im:
        assert im.format == "GIF" and im.n_frames >= 2 and im.info["duration"] >= FRAME_MS
    ledger = read_ledger(run_dir).set_index("traj_id")
    for name in local:  # each GIF is the end of an episode the ledger records as failed
        row = ledger.loc[name[: -len(".gif")]]
        assert (row.terminated or row.truncated) and not row.success, row


@pytest.mark.slow
def test_a_run_that_reaches_stop_at_success_ends_early_and_finished(server, tmp_path):
    """`rollout.stop_at_success`: the synthetic env succeeds half of its episodes, so a target of 0.2 over 3 reports
    is reached within a few updates of a run whose total would take far longer: it ends there, saves its final
    summary with why, and its MLflow run is FINISHED, not KILLED as a run drained short of its total is."""
    total = 20_000
    run_dir, _ = run(
        tmp_path,
        "target",
        f"tracking.uri={server.uri}",
        "tracking.experiment=trk",
        "rollout.stop_at_success=0.2",
        "rollout.stop_window=3",
        total=total,
    )
    final = json.loads((run_dir / "final.json").read_text())
    assert final["ended_by"] == "rollout.stop_at_success" and final["env_steps"] <= total // 10, final
    rows = [row for row in metrics_lines(run_dir) if row["rollout/episodes"] > 0]
    last = rows[-3:]
    wins = sum(r["rollout/success_rate"] * r["rollout/episodes"] for r in last)
    rate = wins / sum(r["rollout/episodes"] for r in last)
    assert len(rows) >= 3 and rate >= 0.2 and metrics_lines(run_dir)[-1]["env_steps"] <= final["env_steps"]
    assert "reached rollout.stop_at_success 0.2" in (run_dir / "logs" / "trainer" / "0.log").read_text()
    assert client(server.uri).get_run(read_run_id(run_dir)).info.status == "FINISHED"

    # `vlaslurm track` afterwards, into new MLflow runs: FINISHED as it ended; KILLED for a run that went on past its
    # final summary (resumed to train longer) and drained short of its total.
    for name, further, status in (("again", 0, "FINISHED"), ("resumed", 64, "KILLED")):
        copy = tmp_path / name
        shutil.copytree(run_dir, copy)
        (copy / "mlflow_run_id").unlink()
        shutil.rmtree(RunDir(copy).tracking)
        if further:
            with (copy / "metrics.jsonl").open("a") as out:
                out.write(json.dumps({**metrics_lines(run_dir)[-1], "env_steps": final["env_steps"] + further}) + "\n")
        assert main(["track", str(copy), "--tracking-uri", server.uri, "--timeout", "60"]) == 0
        assert client(server.uri).get_run(read_run_id(copy)).info.status == status, name
