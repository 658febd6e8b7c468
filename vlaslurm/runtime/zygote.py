"""Local runs: start ranks by forking one process that has already imported torch and the run's modules.

A fresh interpreter spends ~1.3 s of CPU importing torch, ~3.5 s with transformers, before a rank does
anything; a local run of a few ranks on a laptop pays it once per rank. `vlaslurm run` instead starts one
zygote per run (`python -m vlaslurm.runtime.zygote MODULE... policy:TYPE`), which imports the modules and
the policy module of `model.type`, then forks a rank per request; a rank's restart supervisor forks its
worker likewise (`fork_worker`). A launcher keeps its last zygote for its next local run (`acquire`).
Slurm steps start fresh interpreters as before.

A forked rank is what a fresh one would be: its own session, stdin from /dev/null, stdout and stderr
appended to its log, the environment it was given, and the normal interpreter exit (threads joined, atexit
handlers, ZeroMQ lingering) with its own exit code. Fork safety: the zygote imports only modules that start
no thread (checked at start: it refuses to run with more than one) and never initialises CUDA; it imports
torch with OMP_NUM_THREADS=1 (more starts OpenMP's threads at import), and a rank then sets torch's threads
to its own OMP_NUM_THREADS.
Protocol: JSON lines, requests on the zygote's stdin, `{"pid": N}` and `{"exit": N, "code": C}` on its stdout.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Set, TextIO, Tuple

POLL_S = 0.05  # how often the zygote reaps its ranks while no request comes
READY = "ready"
POLICY_ARG = "policy:"  # an argument `policy:<model.type>` imports that type's policy module (models.POLICIES)


class ZygoteError(RuntimeError):
    """The zygote could not start, or stopped while it had ranks."""


class Zygote:
    """The launcher's side: one zygote process; `spawn` a rank, read exits with `ForkedRank.poll`."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str], policy: str = "") -> None:
        self.key = _key(modules, env, policy)  # which later runs may reuse it (`acquire`)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlaslurm.runtime.zygote", *modules, *([f"{POLICY_ARG}{policy}"] if policy else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(env, OMP_NUM_THREADS="1"),  # more would start OpenMP's threads at `import torch`
            start_new_session=True,  # a Ctrl-C meant for the launcher must not end it before its ranks
        )
        self.codes: Dict[int, int] = {}
        self.live: Set[int] = set()  # ranks forked whose exit is not reported yet
        assert self.proc.stdout is not None
        self._replies = _Lines(self.proc.stdout.fileno())
        first = self._line(blocking=True)
        if first != {READY: True}:
            self.close()
            raise ZygoteError(f"the local launcher's zygote did not start ({first}); see the error above")

    def spawn(self, argv: List[str], env: Mapping[str, str], log: Path) -> ForkedRank:
        """Fork a rank running `python -m vlaslurm.runtime.worker *argv` with `env`, output appended to `log`."""
        request = {"argv": argv, "env": dict(env), "log": str(log)}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            reply = self._line(blocking=True)
            if reply is None:
                raise ZygoteError("the local launcher's zygote stopped before starting a rank")
            if "pid" in reply:
                self.live.add(int(reply["pid"]))
                return ForkedRank(self, int(reply["pid"]))
            self._exited(reply)

    def pump(self) -> None:
        """Read the exits reported so far."""
        while True:
            reply = self._line(blocking=False)
            if reply is None:
                return
            self._exited(reply)

    def _exited(self, reply: dict) -> None:
        pid = int(reply["exit"])
        self.codes[pid] = int(reply["code"])
        self.live.discard(pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the zygote (ranks still running go on; nobody reports their exits any more)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _line(self, blocking: bool) -> Optional[dict]:
        line = self._replies.next(None if blocking else 0.0)
        if line is None:
            return None
        try:
            return dict(json.loads(line))
        except ValueError:
            raise ZygoteError(f"the local launcher's zygote said {line[:200]!r}, not a JSON line") from None


class _Lines:
    """The lines read from a pipe: the zygote's requests on its stdin, its replies on the launcher's side."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer, self.ended = fd, b"", False

    def next(self, timeout_s: Optional[float]) -> Optional[bytes]:
        """The next whole line (no newline), or None when none came within `timeout_s` (None: wait for one) or
        the pipe ended (`ended`)."""
        while b"\n" not in self.buffer:
            if self.ended or (timeout_s is not None and not select.select([self.fd], [], [], timeout_s)[0]):
                return None
            chunk = os.read(self.fd, 65536)
            self.ended = not chunk
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line


# A launcher that starts several local runs (a benchmark, a sweep from a script, a test session) keeps the zygote
# of its last run while it waits, idle, for the next: a zygote's start is ~4 s of imports. Only a zygote whose
# ranks all ended is kept, for a run that asks for the same modules, environment and working directory (what
# its imports may have read); another request ends it. It ends with the launcher at the latest (its stdin closes).
ZygoteKey = Tuple[Tuple[str, ...], str, Tuple[Tuple[str, str], ...], str]
_kept: Optional[Zygote] = None

# Variables that describe the launcher's moment, not a setting an import could read: pytest names the running test.
MOMENTARY_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _key(modules: Sequence[str], env: Mapping[str, str], policy: str) -> ZygoteKey:
    settings = tuple(sorted((k, v) for k, v in env.items() if k not in MOMENTARY_ENV))
    return tuple(modules), policy, settings, os.getcwd()


def acquire(modules: Sequence[str], env: Mapping[str, str], policy: str = "") -> Zygote:
    """This launcher's kept zygote if it has these settings and is alive (any other is ended), else a new one
    (`ZygoteError`)."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None and kept.key == _key(modules, env, policy) and kept.alive():
        return kept
    if kept is not None:
        kept.close()
    return Zygote(modules, env, policy)


def release(zygote: Zygote) -> None:
    """A run is done with `zygote`: keep it for the next run if all its ranks have ended (their exits reported),
    else end it. One zygote is kept at most."""
    global _kept
    zygote.pump()
    if not zygote.alive() or zygote.live:
        zygote.close()
        return
    close_idle()
    _kept = zygote


def close_idle() -> None:
    """End the kept zygote, if any."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        kept.close()


atexit.register(close_idle)


class ForkedRank:
    """A rank forked by the zygote, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            zygote_alive = self.zygote.alive()  # before reading: a dead zygote's last reports are all in the pipe
            self.zygote.pump()
            if self.pid in self.zygote.codes:
                self.returncode = self.zygote.codes.pop(self.pid)
            elif not zygote_alive and not _exists(self.pid):
                self.returncode = 1  # it ended after its zygote died, so nobody reported its code: a failure
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- the zygote process ------------------------------------------------------------------------------------


_forked = False  # True in a process forked by a zygote (a rank, or a supervisor's worker)
_protocol: Optional[TextIO] = None  # the zygote's reply channel (its stdout when started)


def forked() -> bool:
    """Whether this process was forked from a zygote, so that its own forks start with the imports done."""
    return _forked


class _Become(BaseException):
    """Raised in a freshly forked child to unwind its parent's stack and run a worker from the top."""

    def __init__(self, argv: List[str]) -> None:
        super().__init__(argv)
        self.argv = argv


def fork_worker(argv: List[str], env: Mapping[str, str]) -> int:
    """In a forked process: fork a worker (`vlaslurm.runtime.worker` with `argv` and `env`) and return its pid.

    The child unwinds to `main`'s top (a BaseException no `except Exception` stops) and runs the worker there,
    so it ends with the interpreter's normal exit, as a fresh process would."""
    pid = _fork()
    if pid == 0:
        for signum in (signal.SIGTERM, signal.SIGUSR2):  # what a supervisor forwards; a fresh process has neither
            signal.signal(signum, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        raise _Become(argv)
    return pid


def _fork() -> int:
    """`os.fork`, with every object this process holds moved out of the collector's sight first (`gc.freeze`).

    A forked child's collections would otherwise walk the parent's whole heap (torch's and transformers' modules):
    each pass writes to objects' headers, so their pages are copied, and the child's exit alone took ~1.3 s of
    CPU against ~0.3 s frozen. The parent's objects live as long as the child; they are never garbage to it."""
    gc.freeze()
    return os.fork()


class ChildProcess:
    """A process this one forked, with the part of `subprocess.Popen` a supervisor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self._wait(os.WNOHANG)

    def wait(self) -> int:
        code = self._wait(0)
        assert code is not None
        return code

    def _wait(self, flags: int) -> Optional[int]:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped already, by a signal handler's poll during our wait
            return self.returncode
        if pid and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


def _child(request: dict) -> List[str]:
    """Make this freshly forked process the rank `request` asks for; returns the worker's argv."""
    global _forked, _protocol
    _forked = True
    if _protocol is not None:  # the zygote's reply channel is not the rank's (empty: flushed after each reply)
        _protocol.close()
        _protocol = None
    from vlaslurm.runtime.worker import append_output_to

    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    append_output_to(Path(request["log"]))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # what PYTHONUNBUFFERED gives
    os.environ.clear()
    os.environ.update(request["env"])
    _set_threads(os.environ.get("OMP_NUM_THREADS", ""))
    return list(request["argv"])


def _set_threads(value: str) -> None:
    """torch's intra-op threads as OMP_NUM_THREADS asks, which torch read at import, in the zygote (as 1)."""
    if value.isdigit() and int(value) > 1 and "torch" in sys.modules:
        import torch

        torch.set_num_threads(int(value))


def _run_worker(argv: List[str]) -> int:
    from vlaslurm.runtime import worker

    sys.argv = [worker.__file__, *argv]
    while True:
        try:
            return worker.main(argv)
        except _Become as become:  # a supervisor's forked worker: run it from here instead
            argv = become.argv
            sys.argv = [worker.__file__, *argv]


def serve(modules: Sequence[str]) -> int:
    """The zygote: import `modules`, then fork a rank per request until stdin closes."""
    global _protocol
    _protocol = os.fdopen(os.dup(1), "w")  # the replies; what anything else prints goes to stderr
    os.dup2(2, 1)
    for name in modules:
        if name.startswith(POLICY_ARG):
            from vlaslurm.models import POLICIES

            POLICIES.find(name[len(POLICY_ARG) :])
        else:
            importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:  # a fork would copy a process whose other threads may hold locks
        print(f"zygote: importing {list(modules)} started {threads - 1} thread(s); not forking", file=sys.stderr)
        return 1
    _reply({READY: True})
    requests = _Lines(0)
    while True:
        _reap()
        line = requests.next(POLL_S)
        if line is None:
            if requests.ended:
                return 0
            continue
        request = json.loads(line)
        pid = _fork()
        if pid == 0:
            return _run_worker(_child(request))
        _reply({"pid": pid})


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(message: dict) -> None:
    assert _protocol is not None
    _protocol.write(json.dumps(message) + "\n")
    _protocol.flush()


if __name__ == "__main__":
    from vlaslurm.runtime import zygote  # the module `forked()` reads, not this __main__ copy of it

    sys.exit(zygote.serve(sys.argv[1:]))
