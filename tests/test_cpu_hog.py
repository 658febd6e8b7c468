"""The CI load self-check's hog really loads the CPU when asked, and does nothing otherwise (about 1 s)."""

from __future__ import annotations

import os
import time

from cpu_hog import ENV, cpu_hog


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_the_hog_spins_only_when_asked(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with cpu_hog() as count:
        assert count == 0
    monkeypatch.setenv(ENV, "1")
    import multiprocessing

    before = set(p.pid for p in multiprocessing.active_children())
    with cpu_hog() as count:
        assert count >= 1
        spinners = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert len(spinners) == count
        deadline = time.monotonic() + 20  # a loaded machine gives each spinner only a share of a core
        while not all(cpu_seconds(p.pid) > 0.2 for p in spinners) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(cpu_seconds(p.pid) > 0.2 for p in spinners)
    assert not any(p.is_alive() for p in spinners)
