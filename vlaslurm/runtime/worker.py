"""Entry point of every rank: `python -m vlaslurm.runtime.worker --role R --run-dir D`.

Slurm starts it as one srun step per role (rank = SLURM_PROCID); `vlaslurm run`
starts it as local processes (rank = VLASLURM_RANK).

With `resources.<role>.max_restarts` > 0 (by default for simulators, and for generators with filesystem
weight sync: `spec.schema.default_max_restarts`) the process is a small supervisor (no torch; in a local run
it was forked with torch imported, and forks its worker likewise: `runtime.zygote`) that runs the real worker
as its child, forwards USR2 and TERM to it, and starts it again when it dies, up to max_restarts
times, after a back-off of 1 s, 2 s, 4 s, ... (doubling, at most 30 s: `backoff_s`); each restart is a line
in the run's restart record (`RunDir.restarts`, shown by `vlaslurm status`) and a header in the rank's log.
The child learns which incarnation it is from VLASLURM_WORKER_RESTART (see `signals.incarnation`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

from vlaslurm.log import get_logger
from vlaslurm.rundir import RunDir, append_restart
from vlaslurm.runtime import zygote

# Each role: its module (entry point `run(ctx, cfg)`) and its config class, built here `from_spec`.
ROLE_MODULES = {
    "simulator": ("vlaslurm.runtime.roles.simulator", "SimulatorConfig"),
    "generator": ("vlaslurm.runtime.roles.generator", "GeneratorConfig"),
    "trainer": ("vlaslurm.runtime.roles.trainer", "TrainerConfig"),
}
log = get_logger("vlaslurm.worker")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=sorted(ROLE_MODULES))
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--probe", action="store_true", help="run the connectivity probe instead of the role")
    parser.add_argument("--absent", default="", help="(tests) roles that exit before meeting, comma-separated")
    parser.add_argument(
        "--rank-log",
        action="store_true",
        help="append this rank's output to <run-dir>/logs/<role>/<rank>.log (srun's %%t is not the "
        "rank in a step over several components)",
    )
    args = parser.parse_args(argv)
    from vlaslurm.runtime import signals
    from vlaslurm.runtime.signals import RESTART_ENV

    # At once, before the slow imports: USR2 (Slurm's warning before the time limit) must never kill a
    # rank; the trainer also takes TERM as "checkpoint and stop" (see signals.py).
    signals.install(drain_on_term=args.role == "trainer")
    rank = _rank_from_env()
    if args.rank_log:
        append_output_to(RunDir(args.run_dir).log(args.role, rank))
    log_start_line(args.role, rank)
    if not args.probe and RESTART_ENV not in os.environ:
        restarts = _max_restarts(args.run_dir, args.role)
        if restarts > 0:  # the supervisor never imports torch (runtime.context does): it stays small
            return supervise(list(sys.argv[1:] if argv is None else argv), args.role, rank, restarts, args.run_dir)
    from vlaslurm.runtime.context import make_context, run_spec

    if args.role in args.absent.split(","):
        log.warning("%s told to stay absent (test hook); exiting without joining", args.role)
        return 0
    try:
        spec = run_spec(args.run_dir)
        ctx = make_context(args.role, args.run_dir, spec.runtime)
        if args.probe:
            from vlaslurm.runtime import probe

            return probe.run(ctx)
        module, config = ROLE_MODULES[args.role]
        role = importlib.import_module(module)
        return profiled(args.role, rank, lambda: role.run(ctx, getattr(role, config).from_spec(spec)))
    except Exception as exc:  # noqa: BLE001 - the last word of a rank must reach its log
        log.error("%s failed: %s\n%s", args.role, exc, traceback.format_exc())
        return 1


def profiled(role: str, rank: int, run: Callable[[], int]) -> int:
    """`run()`, under cProfile when `VLASLURM_CPROFILE` names a folder: the stats of the rank's main thread go to
    `<folder>/<role>-<rank>.prof` (read them with `python -m pstats`), also when the role fails."""
    folder = os.environ.get("VLASLURM_CPROFILE")
    if not folder:
        return run()
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(run)
    finally:
        Path(folder).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(str(Path(folder) / f"{role}-{rank}.prof"))


def log_start_line(role: str, rank: int) -> None:
    """One line per process start, so an appended log shows where each attempt and restart begins."""
    sys.stderr.write(
        f"==== {role}[{rank}] pid {os.getpid()} on {socket.gethostname()} at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: job key {os.environ.get('VLASLURM_JOB_KEY', '-')}, "
        f"SLURM_RESTART_COUNT {os.environ.get('SLURM_RESTART_COUNT', '0')}, "
        f"worker restart {os.environ.get('VLASLURM_WORKER_RESTART', '0')} ====\n"
    )
    sys.stderr.flush()


def _rank_from_env() -> int:
    """`runtime.context.rank_from_env`, without importing that module (and torch) into a supervisor."""
    if "VLASLURM_RANK" in os.environ or "SLURM_PROCID" in os.environ:
        return int(os.environ.get("VLASLURM_RANK", os.environ.get("SLURM_PROCID", "0")))
    from vlaslurm.runtime.context import rank_from_env

    return rank_from_env()  # raises, naming the variables


def _max_restarts(run_dir: Path, role: str) -> int:
    from vlaslurm.spec import load_spec

    return load_spec(RunDir(run_dir).spec).spec.max_restarts(role)


BACKOFF_FIRST_S = 1.0  # the wait before the first restart; each further one doubles it
BACKOFF_MAX_S = 30.0


def backoff_s(restart: int) -> float:
    """Seconds the supervisor waits before restart number `restart` (1, 2, ...): 1, 2, 4, ... at most 30.
    A worker that dies at once (a bad node, a missing file) does not spin, and the others' deadlines
    (runtime.timeout_s) still cover the first few restarts."""
    return min(BACKOFF_FIRST_S * 2 ** (restart - 1), BACKOFF_MAX_S)


def supervise(argv: List[str], role: str, rank: int, max_restarts: int, run_dir: Path) -> int:
    """Run the worker as a child; start it again when it dies, up to `max_restarts` times."""
    from vlaslurm.runtime.signals import REQUEUE_EXIT, RESTART_ENV

    child: Optional[Union[subprocess.Popen, zygote.ChildProcess]] = None
    stopping: List[int] = []

    def forward(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
        if signum == signal.SIGTERM:
            stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGUSR2, forward)
    restarts = 0
    while True:
        started = time.time()
        child = _start_worker(argv, {**os.environ, RESTART_ENV: str(restarts)})
        code = child.wait()
        if code in (0, REQUEUE_EXIT) or stopping:
            return code if code >= 0 else 128 - code
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if restarts >= max_restarts:
            log.error(
                "%s[%d] died (%s) and has no restarts left (resources.%s.max_restarts=%d)",
                role,
                rank,
                how,
                role,
                max_restarts,
            )
            return code if code >= 0 else 128 - code
        died = time.time()
        restarts += 1
        wait = backoff_s(restarts)
        log.warning(
            "%s[%d] died (%s) after %.1f s; restart %d of %d in %.0f s",
            role,
            rank,
            how,
            died - started,
            restarts,
            max_restarts,
            wait,
        )
        end = time.monotonic() + wait
        while time.monotonic() < end and not stopping:  # TERM during the back-off: no restart
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        if stopping:
            return code if code >= 0 else 128 - code
        append_restart(
            run_dir,
            {
                "role": role,
                "rank": rank,
                "restart": restarts,
                "max_restarts": max_restarts,
                "exit_code": code,
                "how": how,
                "died": died,
                "backoff_s": wait,
                "time": time.time(),  # the restart: the new process starts now
                "job_key": os.environ.get("VLASLURM_JOB_KEY", ""),
            },
        )


def _start_worker(argv: List[str], env: Dict[str, str]) -> Union[subprocess.Popen, zygote.ChildProcess]:
    """The supervised worker: forked where this supervisor was itself forked by a local run's zygote (torch is
    imported already), else a fresh interpreter."""
    if zygote.forked():
        return zygote.ChildProcess(zygote.fork_worker(argv, env))
    return subprocess.Popen([sys.executable, "-m", "vlaslurm.runtime.worker", *argv], env=env)


def append_output_to(path: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at `path`, appending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
