"""Do the quickstarts learn? One local run per check, every role a local process (2 CPU cores), judged on the
ledger: of the rows that end an episode (terminated or truncated), in the order the trainer consumed them, the
success rate over the last fifth.

- `fsdp`: `experiments/quickstart.yaml` with 2 fsdp trainer ranks (`resources.trainer.tasks_per_node=2
  trainer.strategy=fsdp`); issue 16's bar: >= 0.8. About 2.5 minutes.
- `pi0`: `experiments/quickstart_pi0.yaml`, a tiny π0 from scratch; issue 18's bar: > 0.5 within 12 minutes.

A benchmark rather than tests for their minutes (the suite's learning tests run the toy task with one replicated
trainer rank; tests/test_fsdp_learner.py shows a sharded update equals it, tests/test_pi0_runtime.py that π0 runs).

    python benchmarks/quickstart_runs.py [--checks fsdp pi0] [--seed 0] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
NAME = "quickstart_runs"


@dataclass(frozen=True)
class Check:
    spec: str
    overrides: List[str]
    bar: float  # success over the last fifth at least this (fsdp) or above it (pi0)
    minutes: float  # wall limit of the run

    def met(self, rc: int, success: float, wall_s: float) -> bool:
        return rc == 0 and success >= self.bar and wall_s <= 60 * self.minutes


CHECKS = {
    "fsdp": Check("quickstart.yaml", ["resources.trainer.tasks_per_node=2", "trainer.strategy=fsdp"], 0.8, 30),
    "pi0": Check("quickstart_pi0.yaml", [], 0.5, 12),
}


def last_fifth_success(ledger: pd.DataFrame) -> tuple:
    """(episodes, success rate of the last fifth of them) from the ledger rows that end an episode."""
    ends = ledger[ledger["terminated"] | ledger["truncated"]].sort_values("t_consumed", kind="stable")
    last = ends.iloc[int(len(ends) * 0.8) :]
    return len(ends), float(last["success"].mean())


def run(name: str, check: Check, seed: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"quickstart-{name}-")) / "run"
    command = [sys.executable, "-m", "vlaslurm.cli", "run", str(REPO / "experiments" / check.spec)]
    command += [*check.overrides, f"rollout.seed={seed}", "--run-dir", str(run_dir)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    rc = subprocess.run(command, cwd=REPO, env={**os.environ, "VLASLURM_TRACKING": "off"}).returncode
    wall = time.monotonic() - t0
    from vlaslurm.rundir import RunDir

    layout = RunDir(run_dir)  # the run directory's own names, not spelled here
    episodes, success = last_fifth_success(pd.read_parquet(layout.ledger))
    final = json.loads(layout.final.read_text()) if layout.final.exists() else {}
    metrics = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.strip()]
    return {
        "check": name,
        "spec": check.spec,
        "overrides": check.overrides,
        "seed": seed,
        "commit": commit.stdout.strip() or None,
        "rc": rc,
        "wall_s": round(wall, 1),
        "load_start": round(load, 1),
        "episodes": episodes,
        "last_fifth_success": round(success, 3),
        "env_steps": final.get("env_steps"),
        "met": check.met(rc, success, wall),
        "curve": [  # the learning curve: each update's rollout success rate at its env steps and wall time
            {"env_steps": m["env_steps"], "wall_s": round(m["wall_s"], 1), "success": m["rollout/success_rate"]}
            for m in metrics
            if math.isfinite(m.get("rollout/success_rate", math.nan))  # nan: no episode ended yet
        ],
    }


def curve_at(curve: List[dict], fractions=(0.2, 0.4, 0.6, 0.8, 1.0)) -> str:
    """Success (mean over the updates of each fifth of the env steps) at the end of each fifth: the curve's shape
    in one table cell."""
    if not curve:
        return "-"
    total = curve[-1]["env_steps"]
    parts, lo = [], 0.0
    for f in fractions:
        window = [c["success"] for c in curve if lo < c["env_steps"] <= f * total]
        parts.append(f"{sum(window) / len(window):.2f}" if window else "-")
        lo = f * total
    return " / ".join(parts)


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r.get("curve"):
            xs, ys = [c["env_steps"] for c in r["curve"]], [c["success"] for c in r["curve"]]
            ax.plot(xs, ys, label=f"{r['check']} (seed {r['seed']}, {r['wall_s']:.0f} s)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("rollout success rate per update")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: List[dict]) -> str:
    lines = [
        "# Do the quickstarts learn?",
        "",
        "Generated by `benchmarks/quickstart_runs.py`: each check one local run (every role a local process, 2 CPU "
        "cores); success = episode success over the last fifth of the episodes (ledger rows that end one).",
        "",
        "Curve: the rollout success rate averaged over the updates of each fifth of the run's env steps; every "
        f"update's point is in `{NAME}.json` and `{NAME}.png`.",
        "",
        "| check | spec and overrides | seed | commit | exit | wall | load at start | episodes | curve by fifths "
        "| success, last fifth | bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        check = CHECKS[r["check"]]
        bar = f">= {check.bar} within {check.minutes:g} min: {'met' if r['met'] else 'NOT met'}"
        spec = " ".join([r["spec"], *r["overrides"]])
        lines.append(
            f"| {r['check']} | `{spec}` | {r['seed']} | {r.get('commit') or '-'} | {r['rc']} | {r['wall_s']:.0f} s | "
            f"{r['load_start']} | {r['episodes']} | {curve_at(r.get('curve', []))} | {r['last_fifth_success']:.3f} "
            f"| {bar} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    path = args.out / f"{NAME}.json"
    saved = json.loads(path.read_text()) if path.exists() else []
    for name in args.checks:
        row = run(name, CHECKS[name], args.seed)
        saved = [r for r in saved if (r["check"], r["seed"]) != (name, args.seed)] + [row]
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=1) + "\n")
        (args.out / f"{NAME}.md").write_text(report(saved))
        plot(saved, args.out / f"{NAME}.png")
    print((args.out / f"{NAME}.md").read_text())
    return 0 if all(r["met"] for r in saved) else 1


if __name__ == "__main__":
    raise SystemExit(main())
