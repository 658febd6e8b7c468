"""What a local run's process handling costs, in one run: a forked child's exit with and without `gc.freeze`, and
three short local runs of a synthetic spec from one launcher (the first starts the zygote, the next two reuse it).

    python benchmarks/local_run_startup.py [--forks 5]

The fork measurement imports what a zygote imports for an openvla-oft run (torch, transformers, the runtime's role
modules, the policy module), then forks children that exit at once (`sys.exit`, the interpreter's normal exit) and
times fork to reaped exit. Writes benchmarks/results/local_run_startup.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import yaml

RESULTS = Path(__file__).resolve().parent / "results" / "local_run_startup.md"
REPO = Path(__file__).resolve().parent.parent


def fork_exit_s(freeze: bool, forks: int) -> float:
    """Mean seconds from fork to the reaped exit of a child that exits at once."""
    times = []
    for _ in range(forks):
        start = time.perf_counter()
        if freeze:
            gc.freeze()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        times.append(time.perf_counter() - start)
        gc.unfreeze()
    return sum(times) / len(times)


def run_seconds(runs: int) -> List[float]:
    """Wall seconds of `runs` consecutive local runs of a small synthetic spec, from this one launcher."""
    sys.path.insert(0, str(REPO / "tests"))
    from runtime_helpers import synthetic_spec

    from vlaslurm.runtime.local import run_local
    from vlaslurm.spec import load_spec

    root = Path(tempfile.mkdtemp(prefix="local-run-startup-"))
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(synthetic_spec("sync", total_env_steps=400)))
    seconds = []
    for i in range(runs):
        start = time.perf_counter()
        code = run_local(load_spec(path), root / "runs", root / f"run{i}", echo=False, timeout_s=300)
        seconds.append(time.perf_counter() - start)
        if code != 0:
            raise SystemExit(f"local run {i} failed with exit code {code}; see {root / f'run{i}'}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--forks", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("VLASLURM_PREFLIGHT", "off")
    runs = run_seconds(3)  # before the heavy imports below: the launcher stays as `vlaslurm run`'s is
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import vlaslurm.runtime.context  # noqa: F401
    import vlaslurm.runtime.roles.generator  # noqa: F401
    import vlaslurm.runtime.roles.simulator  # noqa: F401
    from vlaslurm.models import POLICIES

    POLICIES.find("openvla-oft")
    plain, frozen = fork_exit_s(False, args.forks), fork_exit_s(True, args.forks)
    lines = [
        "# Local run start-up: forked exits and a kept zygote",
        "",
        f"Written by `benchmarks/local_run_startup.py` ({time.strftime('%Y-%m-%d %H:%M:%S')}, one run, "
        f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs).",
        "",
        "| measurement | seconds |",
        "|---|---:|",
        f"| forked child's exit, torch + transformers + roles imported, plain (mean of {args.forks}) | {plain:.3f} |",
        f"| the same, `gc.freeze()` before the fork | {frozen:.3f} |",
        f"| synthetic local run 1 (starts the zygote) | {runs[0]:.2f} |",
        f"| synthetic local run 2 (reuses it) | {runs[1]:.2f} |",
        f"| synthetic local run 3 (reuses it) | {runs[2]:.2f} |",
        "",
        f"Exit frozen / plain: {frozen / plain:.2f}; run 2 / run 1: {runs[1] / runs[0]:.2f}.",
    ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
