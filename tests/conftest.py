"""Shared fixtures: the private local Slurm cluster, and the command line run as a user runs it.

Tests marked `slurm` submit real jobs to `vlaslurm.slurm.local_cluster` (4 nodes x 8 fake
GPUs x 32 CPUs on this host). Without Slurm's binaries they are skipped, unless
VLASLURM_REQUIRE_SLURM=1 (set by .ci/test) makes that a failure. Run only the fast tests
with `pytest -m "not slurm"`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from vlaslurm.slurm import local_cluster as lc

REPO = Path(__file__).resolve().parent.parent

# No MLflow in the suite's runs, local or on the cluster (every process a test starts inherits this), except where
# a test turns it on against real MLflow (tests/test_tracking.py, tests/test_compare.py, the RoboTwin experiment's
# Slurm job in tests/test_experiments_slurm.py): tracking's import and its SQLite store cost a run ~3 s of CPU, and
# jobs used to track or not by which tests their worker had run before.
os.environ.setdefault("VLASLURM_TRACKING", "off")
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol")


def missing_slurm_binaries() -> list:
    return [b for b in SLURM_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Under pytest-xdist (`.ci/test` runs four workers, `--dist loadgroup`): every file's tests stay on one
    worker, so a module's shared runs are made once, and every Slurm test goes to one worker, so that jobs
    queue against each other's deadlines only as they do in a serial run."""
    for item in items:
        group = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, called on the controller with each worker's test ids
def pytest_xdist_node_collection_finished(node, ids: List[str]) -> None:
    """Refuse to run tests that lost their groups: xdist then spreads a file's tests over the workers,
    each making the module's shared runs (4 experiment jobs on Slurm twice at once). It happened silently
    twice: the hook above ran after xdist's, and pytest 9 keeps a test's id where xdist 3.8 cannot append
    the group (hence `pytest<9` in pyproject.toml)."""
    lost = [nodeid for nodeid in ids if "@" not in nodeid]
    if lost and node.config.getoption("dist") == "loadgroup":
        raise pytest.UsageError(
            f"pytest-xdist ignored the test groups of {len(lost)} tests (e.g. {lost[0]}): check the pytest and "
            "pytest-xdist versions against pyproject.toml"
        )


@pytest.fixture(autouse=True)
def _one_torch_thread_per_worker() -> None:
    """Under pytest-xdist (`.ci/test`: four workers on two cores) a test computes on one torch thread: two threads
    per worker oversubscribe the cores, and OpenMP's barriers then wait for descheduled threads (a micro-batch test
    took 25 s instead of 3 beside busy processes). Reset before every test: a library call may change it (the
    placement profiler takes a rank's CPUs)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@pytest.fixture
def package_warnings() -> Iterator[List[str]]:
    """Warnings (and worse) of vlaslurm's loggers during the test. The package logger does not propagate to the
    root logger once configured, so pytest's caplog sees its records only in a process where nothing has
    configured it yet: that depends on which tests ran before in the same worker."""
    seen: List[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vlaslurm")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


@pytest.fixture(name="cpu_hog")
def _cpu_hog() -> Iterator[int]:
    """A CPU load beside the test when VLASLURM_TEST_CPU_HOG=1 (`.ci/test`); see tests/cpu_hog.py (whose context
    manager a module's shared runs use directly, so that the load ends with them)."""
    from cpu_hog import cpu_hog as hog

    with hog() as count:
        yield count


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[lc.ClusterInfo]:
    """The local cluster, started if needed (and then stopped at the end), with SLURM_CONF set for
    this process and its children; inherited SLURM_* variables (e.g. from an enclosing job) are dropped."""
    missing = missing_slurm_binaries()
    if missing:
        message = f"Slurm binaries {missing} are missing (bash .ci/setup --slurm installs slurm-wlm and munge)"
        if os.environ.get("VLASLURM_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    was_running = lc.status().running
    info = lc.start()
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            patch.delenv(key)
        for key, value in info.env.items():
            patch.setenv(key, value)
        yield info
    if not was_running:
        lc.stop()


def vlaslurm(
    *args: str, runs_root: Optional[Path] = None, timeout: float = 120, env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """Run the `vlaslurm` command line in a subprocess, as a user would (from the repository root)."""
    cmd = [sys.executable, "-m", "vlaslurm.cli"]
    if runs_root is not None:
        cmd += ["--runs-root", str(runs_root)]
    return subprocess.run(
        cmd + list(args), cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


class LogRecords(logging.Handler):
    """The WARNING-and-above messages a logger emitted during a test."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transport_log() -> Iterator[LogRecords]:
    """What the transport logged (its rejections) while the test ran."""
    handler = LogRecords()
    logger = logging.getLogger("vlaslurm.transport")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
