"""A stress-like CPU load beside the timing-sensitive tests, so CI shows they hold on a loaded machine.

`.ci/test` sets VLASLURM_TEST_CPU_HOG=1 (issue: the suite must hold while other work shares the cores): the
`cpu_hog` fixtures then run busy-looping processes for as long as the test (or the module's shared runs) last.
Unset, they do nothing, so a developer's targeted run is not slowed down.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Iterator, List

ENV = "VLASLURM_TEST_CPU_HOG"


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def hog_processes() -> int:
    """How many busy processes: half the cores (at least one), beside the suite's own workers."""
    return max(1, (os.cpu_count() or 2) // 2) if os.environ.get(ENV) == "1" else 0


@contextlib.contextmanager
def cpu_hog() -> Iterator[int]:
    """Busy processes for the body's duration; yields how many (0 when the hog is off)."""
    procs: List[multiprocessing.process.BaseProcess] = []
    context = multiprocessing.get_context("spawn")  # no copy of pytest's state; starts in ~50 ms
    try:
        for _ in range(hog_processes()):
            proc = context.Process(target=_spin, daemon=True)
            proc.start()
            procs.append(proc)
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)
