"""Local runs fork their ranks from one zygote that imported torch once (vlaslurm/runtime/zygote.py).

What a rank must still be: a process of its own session with its log as stdout and stderr, the environment it
was given, its exit code (or the signal that ended it) reported to the launcher; a supervised rank's worker is
forked by its supervisor. A zygote whose imports started a thread refuses to fork, and the launcher then starts
fresh interpreters.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Tuple

import psutil
import pytest
import yaml
from runtime_helpers import Run, member_pid, run_spec, synthetic_spec, wait_for

from vlaslurm.runtime import local
from vlaslurm.runtime import zygote as zygotes
from vlaslurm.runtime.zygote import Zygote, ZygoteError
from vlaslurm.spec import LoadedSpec, load_spec


def _zygote_of_run(tmp_path: Path, spec: dict, name: str) -> Tuple[psutil.Process, Run]:
    """Run `spec`, and return the zygote its ranks were forked from (checked: all of them), with the run."""
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(run=run_spec(tmp_path, spec, name=name, timeout_s=120)), daemon=True
    )
    runner.start()
    run_dir = tmp_path / name
    ranks = {role: wait_for(lambda r=role: member_pid(run_dir, r, 0), 60, f"{role}[0]") for role in local.ROLES}
    parents = {role: psutil.Process(pid).parent() for role, pid in ranks.items()}
    zygote = parents["trainer"]
    assert "vlaslurm.runtime.zygote" in " ".join(zygote.cmdline())
    assert parents["generator"].pid == zygote.pid
    # simulators restart by default: the rank is a supervisor, forked by the zygote, that forked the worker
    assert parents["simulator"].parent().pid == zygote.pid
    assert parents["simulator"].cmdline() == zygote.cmdline()  # forked, not a fresh interpreter
    assert all(os.getsid(pid) != os.getsid(0) for pid in ranks.values()), "a rank shares the launcher's session"
    runner.join(150)
    assert result["run"].rc == 0
    return zygote, result["run"]


def _ended(process: psutil.Process) -> bool:
    return not psutil.pid_exists(process.pid) or process.status() == psutil.STATUS_ZOMBIE


def test_a_local_runs_ranks_are_forked_from_a_zygote_the_launchers_next_run_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote outlives its run, idle, for the launcher's next run with the same settings; a run with another
    environment gets a zygote of its own and the idle one ends; `close_idle` (also at the launcher's exit) ends
    the last."""
    zygotes.close_idle()  # whatever an earlier test of this process left
    spec = synthetic_spec("sync", total_env_steps=1600)
    first, _ = _zygote_of_run(tmp_path, spec, "first")
    assert not _ended(first)
    again, _ = _zygote_of_run(tmp_path, spec, "again")
    assert again.pid == first.pid
    monkeypatch.setenv("VLASLURM_TEST_MARK", "another environment")  # what a zygote's imports may have read
    other, _ = _zygote_of_run(tmp_path, spec, "other")
    assert other.pid != first.pid
    wait_for(lambda: _ended(first), 30, "the idle zygote ending")
    assert "VLASLURM_TEST_MARK" in psutil.Process(other.pid).environ()
    zygotes.close_idle()
    assert _ended(other)


def test_a_forked_rank_gets_its_environment_and_log_and_its_exit_is_reported(tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    zygote = Zygote(["torch"], dict(os.environ))
    try:
        env = dict(os.environ, VLASLURM_RANK="3", VLASLURM_JOB_KEY="key-from-the-launcher")
        # no run directory there: the worker says so in its log and exits 1
        failed = zygote.spawn(["--role", "generator", "--run-dir", str(tmp_path / "absent")], env, log)
        assert failed.wait(60) == 1
        text = log.read_text()
        assert "==== generator[3] pid" in text and "job key key-from-the-launcher" in text
        assert str(tmp_path / "absent") in text
        assert failed.pid != os.getpid() and not psutil.pid_exists(failed.pid)

        # a rank that waits (for peers that never come) and is killed: the signal is its code, as Popen gives it
        run = local.prepare_local_run(_loaded(tmp_path), tmp_path / "runs", tmp_path / "run")
        env = dict(env, VLASLURM_RANK="0", VLASLURM_WORKER_RESTART="0")  # the worker itself, no supervisor
        waiting = zygote.spawn(["--role", "simulator", "--run-dir", run.run_dir], env, tmp_path / "sim.log")
        wait_for(lambda: member_pid(Path(run.run_dir), "simulator", 0), 60, "the simulator joining")
        assert waiting.poll() is None
        os.kill(waiting.pid, signal.SIGKILL)
        assert waiting.wait(30) == -signal.SIGKILL
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_a_zygote_whose_imports_start_a_thread_refuses_and_the_launcher_starts_fresh_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "threaded_import.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    with pytest.raises(ZygoteError, match="did not start"):
        Zygote(["threaded_import"], env)
    assert "started 1 thread(s); not forking" in capfd.readouterr().err

    monkeypatch.setattr(local, "ZYGOTE_MODULES", ("threaded_import",))
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    run = run_spec(tmp_path, synthetic_spec("sync", total_env_steps=160), timeout_s=90)
    assert run.rc == 0
    assert "starting every rank as a fresh process" in capfd.readouterr().err
    assert "worker restart 0" in (run.run_dir / "logs" / "trainer" / "0.log").read_text()


def test_what_an_import_prints_does_not_reach_the_launchers_channel(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "chatty_import.py").write_text("print('hello from an import')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    zygote = Zygote(["chatty_import"], env)
    try:
        rank = zygote.spawn(["--role", "nope"], env, tmp_path / "rank.log")  # argparse refuses the role: exit 2
        assert rank.wait(60) == 2
    finally:
        zygote.close()
    assert "hello from an import" in capfd.readouterr().err
    assert "invalid choice: 'nope'" in (tmp_path / "rank.log").read_text()


def _loaded(tmp_path: Path) -> LoadedSpec:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(synthetic_spec("sync")))
    return load_spec(path)


def test_a_fork_leaves_the_parents_objects_to_no_collection_of_the_child() -> None:
    """The zygote's forks freeze what it holds (`gc.freeze`): a child's collections and exit then leave the
    parent's heap alone (its pages stay shared; a forked rank's exit took ~1.3 s of CPU with torch and transformers
    imported, ~0.3 s frozen). Here the child reports the size of the permanent generation it started with."""
    import gc

    from vlaslurm.runtime import zygote

    held = [object() for _ in range(10_000)]  # objects the child inherits (gc tracks containers: a list each)
    holders = [[o] for o in held]
    read, write = os.pipe()
    pid = zygote._fork()
    if pid == 0:  # the child: report, then leave without running the test session's exit
        os.write(write, str(gc.get_freeze_count()).encode())
        os._exit(0)
    os.close(write)
    frozen = int(os.read(read, 64))
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    gc.unfreeze()  # this test process is no zygote: its objects go back to the collector
    assert frozen >= len(holders)
