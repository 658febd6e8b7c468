"""Run a function in several real processes (one per rank) and collect what each returned."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Callable, Sequence

import pytest


def run_ranks(
    target: Callable[..., Any],
    args: list[tuple],
    preload: Sequence[str] = ("torch", "torch.distributed"),
    timeout_s: float = 60,
) -> list[Any]:
    """Run target(*args[i]) in one process per entry; return their results or fail naming who did not finish.

    `preload`: modules the forkserver imports once, so each rank does not pay for torch again.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    out = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(target, i, a, out)) for i, a in enumerate(args)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                i, ok, value = out.get(timeout=0.2)
            except Exception:
                continue
            if not ok:
                pytest.fail(f"process {i} {args[i]} failed:\n{value}")
            results[i] = value
        missing = [args[i] for i in range(len(procs)) if i not in results]
        assert not missing, f"processes {missing} did not finish within {timeout_s} s"
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [results[i] for i in range(len(procs))]


def _report(target: Callable[..., Any], i: int, args: tuple, out: mp.Queue) -> None:
    try:
        out.put((i, True, target(*args)))
    except BaseException:
        out.put((i, False, traceback.format_exc()))
