"""One simulator instance per worker process, for simulators that hold one scene per process.

`InstanceProcess(label, factory, *args)` starts a fresh interpreter connected by a socket pair;
the child builds its instance with `factory(*args)` and runs the methods it is sent until `close`.
Exceptions come back with their traceback; a dead or silent child raises an error naming it.
Sending and waiting are separate, so many instances step in parallel. Details: docs/simulators.md
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

TIMEOUT_ENV = "VLASLURM_INSTANCE_TIMEOUT_S"


def _timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "600"))  # the first reply also covers building the scene


class InstanceProcess:
    """The parent's handle on one instance living in its own process."""

    def __init__(self, label: str, factory: str, *args: Any, env: dict | None = None) -> None:
        self.label = label
        parent, child = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vlaslurm.envs._procs", str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send((factory, args))

    def send(self, name: str, *args: Any) -> None:
        self.conn.send((name, *args))

    def wait(self) -> Any:
        timeout = _timeout_s()
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.label} did not answer within {timeout:g} s (${TIMEOUT_ENV})")
        try:
            status, payload = self.conn.recv()
        except (EOFError, ConnectionResetError):
            code = self.process.wait(10)
            raise RuntimeError(
                f"{self.label} died (exit code {code}); run `vlaslurm doctor SPEC` to check "
                f"the simulator and its renderer"
            ) from None
        if status == "error":
            raise RuntimeError(f"{self.label} failed:\n{payload}")
        return payload

    def call(self, name: str, *args: Any) -> Any:
        self.send(name, *args)
        return self.wait()

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.conn.send(("close",))
                if self.conn.poll(10):
                    self.conn.recv()
        except (OSError, EOFError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


def start_all(label: str, count: int, factory: str, args_of) -> list:
    """Start `count` instances (`args_of(i)` gives instance i's factory arguments) and wait for all.

    Returns (handles, infos); on any failure every started process is closed before raising.
    """
    handles: list = []
    try:
        for i in range(count):
            handles.append(InstanceProcess(f"{label} instance {i}", factory, *args_of(i)))
        infos = [h.wait() for h in handles]
    except BaseException:
        for h in handles:
            h.close()
        raise
    return [handles, infos]


def serve(conn: Connection) -> None:
    """Child side: build the instance, then answer commands until `close` or the parent goes away."""
    try:
        factory, args = conn.recv()
        module, func = factory.split(":")
        instance = getattr(importlib.import_module(module), func)(*args)
        conn.send(("ok", instance.info()))
    except BaseException:  # noqa: BLE001 - the parent raises it with this traceback
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            name, *args = conn.recv()
        except (EOFError, ConnectionResetError):
            instance.close()
            return
        try:
            result = getattr(instance, name)(*args)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
        if name == "close":
            return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))


def check_ids(env_ids, num_envs: int):
    """`env_ids` as an int64 array, refusing ids out of range or repeated."""
    import numpy as np

    ids = np.asarray(env_ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_envs):
        raise IndexError(f"env_ids must lie in [0, {num_envs}), got {ids.tolist()}")
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"env_ids must not repeat, got {ids.tolist()}")
    return ids


def stack_rows(ids, rows: list, instructions: list):
    """One Observation from instance replies whose first two items are (image, state) batches of one."""
    import numpy as np

    from vlaslurm.envs.base import Observation

    if not rows:  # an empty subset
        return Observation(images=None, state=None, instructions=[])
    return Observation(
        images=None if rows[0][0] is None else np.concatenate([r[0] for r in rows]),
        state=None if rows[0][1] is None else np.concatenate([r[1] for r in rows]),
        instructions=[instructions[i] for i in ids],
    )


def step_result(ids, rows: list, elapsed, max_episode_steps: int, instructions: list):
    """The StepResult of instance replies `(images, state, reward, success, limit)`.

    Success ends an episode (terminated, and reported as success); it is truncated at
    `max_episode_steps` of its own steps (`elapsed`, this step counted) or at the simulator's own
    limit (`limit`), but never when it also terminated.
    """
    import numpy as np

    from vlaslurm.envs.base import StepResult

    terminated = np.array([r[3] for r in rows], bool)
    limit = np.array([r[4] for r in rows], bool)
    truncated = ((np.asarray(elapsed) >= max_episode_steps) | limit) & ~terminated
    reward = np.array([r[2] for r in rows], np.float32)
    return StepResult(stack_rows(ids, rows, instructions), reward, terminated, truncated, terminated.copy())


def close_all(handles: list) -> None:
    """Close every instance process."""
    for handle in handles:
        handle.close()


def call_each(handles: list, ids, command: str, args) -> list:
    """Send `command` with `args[k]` to instance `ids[k]`, then collect every reply: the instances run at once."""
    for k, i in enumerate(ids):
        handles[i].send(command, args[k])
    return [handles[i].wait() for i in ids]


def reset_seeds(ids, seeds) -> list:
    """Per-instance reset arguments: its seed, or None to let the simulator choose."""
    return [None] * len(ids) if seeds is None else [int(s) for s in seeds]
