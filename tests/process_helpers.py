"""Run a function in several real processes (one per rank), forked from one preloaded forkserver per test process.

A fresh interpreter per rank (start_method="spawn") paid ~5 s of CPU each for torch, transformers and peft; the
forkserver imports them once per pytest worker and forks every rank from it. It is started once, with the first
preload asked, so every caller asks for the same one.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any, Callable, Sequence

import pytest

# What the ranks of the distributed tests import in any case.
PRELOAD = ("torch", "torch.distributed", "transformers", "peft", "vlaslurm.runtime.dist", "vlaslurm.runtime.weights")


def forkserver() -> Any:
    """The forkserver context, its preload set (a no-op once the server runs)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_ranks(target: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(target, args, nprocs, join=True)`, each rank forked from the
    forkserver: target(rank, *args); a rank that fails raises here with its traceback."""
    import torch.multiprocessing as torch_mp

    forkserver()
    torch_mp.start_processes(target, args=args, nprocs=nprocs, start_method="forkserver", join=True)


def run_ranks(target: Callable[..., Any], args: Sequence[tuple], timeout_s: float = 60) -> list[Any]:
    """Run target(*args[i]) in one process per entry; return their results or fail naming who did not finish."""
    ctx = forkserver()
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
