"""`vlaslurm run`: every role as local processes on this machine, no Slurm.

The same worker entry point as under Slurm; only the launcher differs. The
launcher supervises the ranks: the first failure stops the rest, and each
rank's exit is written to the exit record as the batch script does. Ranks are
forked from a zygote that has imported torch and the run's policy module once
(`runtime.zygote`), or started as fresh interpreters where it cannot start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from vlaslurm import rundir
from vlaslurm.rundir import RunDir
from vlaslurm.runtime import zygote as zygotes
from vlaslurm.runtime.signals import DRAIN_SIGNAL, REQUEUE_EXIT
from vlaslurm.runtime.zygote import ForkedRank, Zygote, ZygoteError
from vlaslurm.spec import ExperimentSpec, LoadedSpec, load_spec
from vlaslurm.spec.plan import build_plan
from vlaslurm.spec.validate import check_model_path

ROLES = ("trainer", "generator", "simulator")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
DRAIN_GRACE_S = 60.0  # a stopped run's trainer writes its checkpoint before it exits
Tick = Callable[[Path], None]  # called with the run directory while the ranks run


@dataclass
class LocalProc:
    role: str
    rank: int
    proc: Union[subprocess.Popen, ForkedRank]
    started: float


# What a zygote imports before it forks the ranks: torch and the role modules (the trainer's pulls in pyarrow,
# which starts a thread, so the trainer imports it after the fork), then the module of the spec's policy.
ZYGOTE_MODULES = (
    "torch",
    "vlaslurm.runtime.context",
    "vlaslurm.runtime.roles.simulator",
    "vlaslurm.runtime.roles.generator",
)


def local_ranks(loaded: LoadedSpec) -> Dict[str, int]:
    """Ranks per role for a local run: runtime.local_ranks, else what Slurm would start."""
    ranks = build_plan(loaded).ranks()
    ranks.update(loaded.spec.runtime.local_ranks)
    return ranks


def prepare_local_run(loaded: LoadedSpec, runs_root: Path, run_dir: Optional[Path]) -> rundir.RunInfo:
    """Create and fill the run directory of a local run."""
    check_model_path(loaded)
    directory = rundir.claim_run_dir(run_dir) if run_dir else rundir.new_run_dir(runs_root, loaded.spec.name)
    rundir.create_run(directory, loaded.to_yaml())
    info = rundir.RunInfo(
        name=loaded.spec.name,
        run_dir=str(directory.resolve()),
        kind="local",
        spec_path=str(loaded.path),
        overrides=list(loaded.overrides),
        ranks=local_ranks(loaded),
    )
    rundir.write_info(info)
    rundir.append_index(runs_root, info)
    return info


def run_local(
    loaded: LoadedSpec,
    runs_root: Path,
    run_dir: Optional[Path] = None,
    probe: bool = False,
    extra_args: Tuple[str, ...] = (),
    echo: bool = True,
    timeout_s: Optional[float] = None,
    on_tick: Optional[Tick] = None,
) -> int:
    """Run all ranks locally until they finish; return the first failure's exit code (0 if none).

    `echo`: print the run directory and trainer rank 0's progress and error lines; `on_tick(run_dir)` is
    called a few times a second while the ranks run, and once after they ended (a progress display)."""
    info = prepare_local_run(loaded, runs_root, run_dir)
    directory = Path(info.run_dir)
    if echo:
        print(f"run dir: {directory}", flush=True)
    args = (["--probe"] if probe else []) + list(extra_args)
    return _launch(directory, info, loaded.spec, args, echo, timeout_s, 0, on_tick)


def resume_local(info: rundir.RunInfo, echo: bool = True, timeout_s: Optional[float] = None) -> int:
    """Start every rank again in an existing run directory (attempt N meets in a fresh rendezvous
    `local-<dir>-rN`); the trainer continues from the newest checkpoint."""
    directory = Path(info.run_dir)
    attempts = RunDir(directory).rendezvous_root
    attempt = len(list(attempts.glob("*"))) if attempts.is_dir() else 0
    if echo:
        print(f"run dir: {directory} (attempt {attempt})", flush=True)
    spec = load_spec(RunDir(directory).spec).spec
    return _launch(directory, info, spec, [], echo, timeout_s, attempt)


def _launch(
    directory: Path,
    info: rundir.RunInfo,
    spec: ExperimentSpec,
    args: List[str],
    echo: bool,
    timeout_s: Optional[float],
    attempt: int,
    on_tick: Optional[Tick] = None,
) -> int:
    """Start every rank of `info` and supervise them to the end."""
    zygote = _start_zygote(spec)
    try:
        procs = [
            _spawn(directory, role, rank, args, info, attempt, zygote)
            for role in ROLES
            for rank in range(info.ranks.get(role, 0))
        ]
        return _supervise(directory, procs, echo, timeout_s, attempt, on_tick)
    finally:
        if zygote is not None:  # kept for this launcher's next run where all its ranks ended
            zygotes.release(zygote)


def _start_zygote(spec: ExperimentSpec) -> Optional[Zygote]:
    try:
        return zygotes.acquire(ZYGOTE_MODULES, _base_env(), policy=spec.model.type)
    except (ZygoteError, OSError) as err:
        print(f"vlaslurm: {err}; starting every rank as a fresh process", file=sys.stderr, flush=True)
        return None


def _base_env() -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # many ranks share few cores; one BLAS thread each
    return env


def _spawn(
    directory: Path,
    role: str,
    rank: int,
    args: List[str],
    info: rundir.RunInfo,
    attempt: int = 0,
    zygote: Optional[Zygote] = None,
) -> LocalProc:
    log_path = RunDir(directory).log(role, rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(_base_env(), VLASLURM_RANK=str(rank), VLASLURM_JOB_KEY=f"local-{Path(info.run_dir).name}-r{attempt}")
    argv = ["--role", role, "--run-dir", str(directory), *args]
    if zygote is not None:
        return LocalProc(role, rank, zygote.spawn(argv, env, log_path), time.time())
    with open(log_path, "ab") as log:
        cmd = [sys.executable, "-m", "vlaslurm.runtime.worker", *argv]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return LocalProc(role, rank, proc, time.time())


def _supervise(
    directory: Path,
    procs: List[LocalProc],
    echo: bool,
    timeout_s: Optional[float],
    attempt: int = 0,
    on_tick: Optional[Tick] = None,
) -> int:
    status = 0
    running = list(procs)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    tail = _LogTail(RunDir(directory).log("trainer", 0)) if echo else None
    previous = _stop_on_signals()
    try:
        while running:
            time.sleep(0.2)
            if _stop_requests:
                raise _Stopped(_stop_requests[0])
            if tail:
                tail.pump()
            if on_tick:
                on_tick(directory)
            for p in [p for p in running if p.proc.poll() is not None]:
                running.remove(p)
                code = p.proc.wait()  # it has ended: its code, at once
                _record(directory, f"{p.role}[{p.rank}]", code, p.started, attempt)
                if code != 0 and status == 0:
                    status = code if code > 0 else 128 - code
                    print(_failure(directory, p), file=sys.stderr, flush=True)
                    _terminate(running)
            if deadline and time.monotonic() > deadline and running:
                print(f"vlaslurm: local run exceeded {timeout_s:.0f} s; stopping it", file=sys.stderr)
                status = status or 124
                _terminate(running)
    except KeyboardInterrupt:
        _terminate(running)
        status = 130
    except _Stopped as stop:
        print(f"vlaslurm: {stop.name}; stopping every rank (the trainer saves a checkpoint first)", file=sys.stderr)
        _drain(running, DRAIN_GRACE_S)
        status = 128 + stop.signum
        for p in procs:
            if p.role == "trainer" and p.rank == 0 and p.proc.returncode == REQUEUE_EXIT:
                print(_failure(directory, p), file=sys.stderr, flush=True)  # where to resume from
    finally:
        for p in running:
            p.proc.wait()
        _restore_signals(previous)
        if tail:
            tail.pump()
    _record(directory, "job", status, 0.0, attempt)
    if on_tick:
        on_tick(directory)
    return status


class _Stopped(Exception):
    """The launcher itself got SIGTERM or SIGHUP (a `kill`, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


_stop_requests: List[int] = []  # signals received by the launcher, acted on by the supervising loop


def _note_stop(signum: int, _frame: object) -> None:
    _stop_requests.append(signum)  # not raised here: it could tear an exit record being written


def _stop_on_signals() -> Dict[int, object]:
    """Without this a TERM ends the launcher alone and its ranks, each in its own session, run on unsupervised."""
    _stop_requests.clear()
    previous: Dict[int, object] = {}
    for signum in STOP_SIGNALS:
        try:
            previous[signum] = signal.signal(signum, _note_stop)
        except ValueError:  # not the main thread: whoever runs us there handles signals
            break
    return previous


def _restore_signals(previous: Dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]


def _failure(directory: Path, p: LocalProc) -> str:
    """What the launcher says when a rank ends with a non-zero code."""
    code = p.proc.wait()
    resume = f"continue with: vlaslurm resume {directory} --local"
    if code == REQUEUE_EXIT:
        return f"vlaslurm: {p.role}[{p.rank}] saved a checkpoint and stopped on a signal; {resume}"
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"failed with exit code {code}"
    after = f"; the last checkpoint is kept ({resume})" if p.role == "trainer" else ""
    return (
        f"vlaslurm: {p.role}[{p.rank}] {how}; stopping the others (log: {RunDir(directory).log(p.role, p.rank)}){after}"
    )


def _drain(procs: List[LocalProc], grace_s: float) -> None:
    """Ask the trainers to drain as a preemption does (a checkpoint at the next boundary, then every rank stops,
    `signals.DRAIN_SIGNAL`); what is left after `grace_s` is terminated. A TERM to every rank at once would end
    the generators first and leave the trainer's last publication, and with it the checkpoint, failing."""
    for p in procs:
        if p.role == "trainer" and p.proc.poll() is None:
            os.kill(p.proc.pid, DRAIN_SIGNAL)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(p.proc.poll() is None for p in procs):
        time.sleep(0.2)
    _terminate(procs)


def _terminate(procs: List[LocalProc], grace_s: float = 10.0) -> None:
    """TERM every rank, then KILL what is left after `grace_s`; a trainer, which drains on TERM (a checkpoint
    first, that may wait out a dead generator's deadline), gets `DRAIN_GRACE_S`."""
    for p in procs:
        if p.proc.poll() is None:
            os.killpg(p.proc.pid, signal.SIGTERM)
    start = time.monotonic()
    for p in procs:
        end = start + (max(grace_s, DRAIN_GRACE_S) if p.role == "trainer" else grace_s)
        try:
            p.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.proc.pid, signal.SIGKILL)


def _record(directory: Path, step: str, code: int, started: float, attempt: int = 0) -> None:
    rundir.append_exit_record(
        directory, {"step": step, "exit_code": code, "start": started, "end": time.time(), "restart": attempt}
    )


class _LogTail:
    """Echo the progress lines of trainer rank 0 to the console as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def pump(self) -> None:
        if not self.path.exists():
            return
        with self.path.open(errors="replace") as handle:
            handle.seek(self.offset)
            text = handle.read()
            self.offset = handle.tell()
        for line in text.splitlines():
            if "progress" in line or "ERROR" in line or "finished" in line:
                print(line, flush=True)
