"""Validate the placement model against real local runs (not a test: it measures).

For each synthetic cost mix (simulator-bound, generator-bound, trainer-bound, all
with long tails): profile the spec with the real profiling job (submitit's local
executor), score every placement the model allows on `--units` units, run the top
candidates (and the best of each other mode) for real with `run_local`, each `--repeats`
times round robin (one run's throughput varies by several percent here), and compare
predicted with measured throughput (steady state: env steps per second between the
trainer's progress reports, the first quarter left out, as the model measures).
Then the same for the quickstart (toy env + openvla-oft + PPO), its own placement only.

    python benchmarks/placement_validation.py                 # all mixes + quickstart (~25 min on 2 cores)
    python benchmarks/placement_validation.py --mixes sim --no-quickstart
    python benchmarks/placement_validation.py --quick         # smoke: the choice only, short runs (~5 min)

Results: benchmarks/results/placement_validation.{json,md} (`--out` elsewhere; `--quick`
writes under its runs root unless `--out` is given, so a smoke run never replaces them).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import yaml

from vlaslurm.placement.choose import costs_for
from vlaslurm.placement.search import Scored, apply, choose, predict, score_candidates
from vlaslurm.placement.simulate import Candidate, Workload
from vlaslurm.runtime.local import run_local
from vlaslurm.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

BASE = {
    "env": {"type": "synthetic", "num_envs": 16, "episode_steps": 20},
    "model": {"type": "synthetic", "action_chunk": 1},
    "algo": {"type": "synthetic", "steps_per_update": 256},
    "rollout": {
        "mode": "sync",
        "max_staleness": 1,
        "stale_policy": "drop",
        "weight_sync": "nccl",
        "batching": {"max_batch": 16, "max_wait_ms": 5},
    },
    "resources": {"layout": "disaggregated", "auto": {"modes": ["sync", "pipelined", "async"]}},
    "slurm": {"partition": "cpu"},
}
MIXES: Dict[str, Dict] = {
    "sim": {
        "env": {"step_ms": {"dist": "lognormal", "mean": 10, "sigma": 1.0}, "slow_fraction": 0.25, "slow_factor": 3},
        "model": {"forward_ms": {"base": 2, "per_item": 0.2}},
        "algo": {"update_ms": 20},
    },
    "gen": {
        "env": {"step_ms": {"dist": "lognormal", "mean": 2, "sigma": 1.0}},
        "model": {"forward_ms": {"base": 8, "per_item": 0.6}},
        "algo": {"update_ms": 20},
    },
    "train": {
        "env": {"step_ms": {"dist": "pareto", "mean": 4, "alpha": 2.0}},
        "model": {"forward_ms": {"base": 2, "per_item": 0.2}},
        "algo": {"update_ms": 400},
    },
}


def merge(base: Dict, extra: Dict) -> Dict:
    out = json.loads(json.dumps(base))
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def steady_sps(run_dir: Path) -> Dict[str, float]:
    """Measured throughput the way the model predicts it, and the used share from the ledger: of the
    segments consumed by the updates between the same two reports (the warm-up drops nothing yet)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[max(0, len(rows) // 4)] if len(rows) > 2 else rows[0], rows[-1]
    span = last["wall_s"] - first["wall_s"]
    sps = (last["env_steps"] - first["env_steps"]) / span if span > 0 else float("nan")
    used = 1.0
    ledger = run_dir / "ledger.parquet"
    if ledger.exists():
        import pandas as pd

        df = pd.read_parquet(ledger)
        # A report's `version` counts the updates done: the updates after `first` consumed versions >= its.
        df = df[(df["consumed_version"] >= first["version"]) & (df["consumed_version"] < last["version"])]
        if len(df):
            used = float(df.loc[df["used"], "steps"].sum() / max(1, df["steps"].sum()))
    return {"sps": sps, "used_sps": sps * used, "reports": len(rows), "lag_p99": float(last["staleness/p99"])}


def measure(loaded_path: Path, overrides: List[str], runs_root: Path, steps: int, timeout_s: float) -> Dict:
    loaded = load_spec(loaded_path, overrides + [f"rollout.total_env_steps={steps}"])
    start = time.time()
    code = run_local(loaded, runs_root, echo=False, timeout_s=timeout_s)
    run_dir = sorted((runs_root / loaded.spec.name).iterdir(), key=lambda p: p.stat().st_mtime)[-1]
    out = {"exit": code, "wall_s": time.time() - start, "run_dir": str(run_dir), "load_average": os.getloadavg()[0]}
    if (run_dir / "metrics.jsonl").exists():
        out.update(steady_sps(run_dir))
    return out


def pick(scored: List[Scored], top: int) -> List[Scored]:
    """The top `top` candidates, plus the best of every mode not among them."""
    fitting = [r for r in scored if r.pred]
    chosen = fitting[:top]
    for mode in ("sync", "pipelined", "async"):
        if not any(r.cand.mode == mode for r in chosen):
            chosen += [r for r in fitting if r.cand.mode == mode][:1]
    return chosen


def median_run(runs: List[Dict]) -> Dict:
    """The run with the median throughput (the lower middle one of an even count), with every run's SPS."""
    ok = sorted((r for r in runs if "sps" in r), key=lambda r: r["sps"])
    middle = dict(ok[(len(ok) - 1) // 2]) if ok else dict(runs[0])
    middle["runs_sps"] = [r.get("sps", float("nan")) for r in runs]
    middle["runs_used_sps"] = [r.get("used_sps", float("nan")) for r in runs]
    return middle


def validate_mix(
    name: str,
    units: int,
    top: int,
    runs_root: Path,
    workdir: Path,
    max_steps: int = 20000,
    every_mode: bool = True,
    repeats: int = 1,
) -> Dict:
    path = workdir / f"pv-{name}.yaml"
    path.write_text(yaml.safe_dump(merge(merge(BASE, MIXES[name]), {"name": f"pv-{name}"})))
    loaded = load_spec(path)
    costs, source = costs_for(loaded, runs_root, local=True)
    scored = score_candidates(loaded.spec, costs, units)
    best = choose(scored)
    picked = pick(scored, top) if every_mode else scored[:top]
    runs: List[List[Dict]] = [[] for _ in picked]
    for _ in range(repeats):  # round robin: a change in the machine's load falls on every candidate alike
        for r, done in zip(picked, runs):
            steps = int(min(max_steps, max(min(2500, max_steps), r.pred.sps * 18)))
            done.append(measure(path, apply(loaded, r), runs_root, steps, timeout_s=240))
    rows = []
    for r, done in zip(picked, runs):
        got = median_run(done)
        rows.append(
            {
                "candidate": r.cand.label(),
                "chosen": r is best,
                "predicted_sps": r.pred.sps,
                "predicted_used_sps": r.pred.used_sps,
                "predicted_util": r.pred.util,
                "predicted_cpu_cores": r.pred.cpu,
                "predicted_cpu_bound": r.pred.cpu_bound,
                "predicted_spread": r.pred.spread,
                "predicted_lag_p99": r.pred.lag["p99"],
                "measured": got,
            }
        )
        err = got.get("sps", float("nan")) / r.pred.sps - 1
        print(
            f"[{name}] {r.cand.label():<42} predicted {r.pred.sps:7.1f}  measured {got.get('sps', float('nan')):7.1f}"
            f"  ({err:+.1%}; runs {runs_cell(got)})",
            flush=True,
        )
    measured_best = max(x["measured"].get("used_sps", 0.0) for x in rows)
    chosen = next(x for x in rows if x["chosen"])
    return {
        "mix": name,
        "config": MIXES[name],
        "units": units,
        "source": source,
        "rows": rows,
        "chosen": chosen["candidate"],
        "chosen_over_best_measured": (chosen["measured"].get("used_sps", 0.0) / measured_best if measured_best else 0),
        "max_abs_error": max(abs(x["measured"].get("sps", 0) / x["predicted_sps"] - 1) for x in rows),
        "max_abs_used_error": max(abs(used_error(x)) for x in rows),
    }


def used_error(row: Dict) -> float:
    """Relative error of the predicted used SPS (what the search maximises: steps not dropped as stale)."""
    return row["measured"].get("used_sps", 0.0) / row["predicted_used_sps"] - 1 if row["predicted_used_sps"] else 0.0


def validate_quickstart(runs_root: Path, steps: int) -> Dict:
    path = ROOT / "experiments" / "quickstart.yaml"
    loaded = load_spec(path)
    costs, source = costs_for(loaded, runs_root, local=True)
    spec = loaded.spec
    b = spec.rollout.batching
    cand = Candidate(
        spec.rollout.mode, spec.resources.layout, 1, 1, 1, spec.rollout.pipeline_depth, b.max_batch, b.max_wait_ms
    )
    pred = predict(cand, Workload.from_spec(spec), costs, updates=10)
    got = measure(path, [], runs_root, steps, timeout_s=600)
    print(
        f"[quickstart] {cand.label()} predicted {pred.sps:.1f} measured {got.get('sps', float('nan')):.1f}", flush=True
    )
    return {
        "candidate": cand.label(),
        "source": source,
        "predicted_sps": pred.sps,
        "predicted_util": pred.util,
        "predicted_cpu_cores": pred.cpu,
        "predicted_cpu_bound": pred.cpu_bound,
        "predicted_lag_p99": pred.lag["p99"],
        "measured": got,
    }


def runs_cell(measured: Dict) -> str:
    """Every run's SPS, lowest to highest."""
    return ", ".join(f"{v:.0f}" for v in sorted(measured.get("runs_sps", [measured.get("sps", float("nan"))])))


def cpu_cell(row: Dict) -> str:
    cores = row.get("predicted_cpu_cores") or {}
    if not cores:
        return "-"
    return f"{sum(cores.values()):.2f} ({row['predicted_cpu_bound']:.0f})"


def write_markdown(result: Dict) -> str:
    lines = [
        "# Placement model: predicted vs measured",
        "",
        f"Machine: {result['machine']}; {result['date']}. Each synthetic mix is profiled by the real "
        "profiling job (submitit local executor), scored on "
        f"{result['units']} units (ranks), and its top candidates run for real with `run_local`, "
        f"{result.get('repeats', 1)} times each, round robin. Throughput is steady-state env steps/s (the "
        "trainer's reports, first quarter left out); measured values are the run with the median SPS.",
        "",
    ]
    for mix in result["mixes"]:
        lines += [
            f"## {mix['mix']}-bound: {json.dumps(mix['config'])}",
            "",
            "| candidate | chosen | predicted SPS | measured SPS | error | predicted used SPS "
            "| measured used SPS | error | predicted CPU cores (bound SPS) | every run's SPS |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in mix["rows"]:
            m = row["measured"]
            err = m.get("sps", float("nan")) / row["predicted_sps"] - 1
            lines.append(
                f"| {row['candidate']} | {'**yes**' if row['chosen'] else ''} | {row['predicted_sps']:.0f} | "
                f"{m.get('sps', float('nan')):.0f} | {err:+.1%} | {row['predicted_used_sps']:.0f} | "
                f"{m.get('used_sps', float('nan')):.0f} | {used_error(row):+.1%} | "
                f"{cpu_cell(row)} | {runs_cell(m)} |"
            )
        lines += [
            "",
            f"Chosen `{mix['chosen']}`: measured {mix['chosen_over_best_measured']:.2f} of the best measured "
            f"used SPS (target >= 0.95); largest prediction error {mix['max_abs_error']:.1%} on SPS, "
            f"{mix['max_abs_used_error']:.1%} on used SPS (target <= 10%).",
            "",
        ]
    q = result.get("quickstart")
    if q:
        m = q["measured"]
        err = m.get("sps", float("nan")) / q["predicted_sps"] - 1
        lines += [
            "## quickstart (toy env + openvla-oft + PPO), no target",
            "",
            f"`{q['candidate']}`: predicted {q['predicted_sps']:.0f} env steps/s, measured "
            f"{m.get('sps', float('nan')):.0f} ({err:+.0%}), load average {m['load_average']:.1f}; predicted CPU "
            f"cores (bound SPS): {cpu_cell(q)}.",
            "",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="*", default=list(MIXES))
    parser.add_argument("--units", type=int, default=3)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--no-quickstart", action="store_true")
    parser.add_argument("--quickstart-steps", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each candidate (the median counts)")
    parser.add_argument("--runs-root", default=None)
    parser.add_argument(
        "--out",
        default=None,
        help="folder for placement_validation.{md,json} (default benchmarks/results; with --quick the runs root)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: the chosen candidate of each mix only, 1500 env steps, no quickstart",
    )
    args = parser.parse_args()
    runs_root = Path(args.runs_root or tempfile.mkdtemp(prefix="placement-validation-"))
    workdir = runs_root / "specs"
    workdir.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": f"{os.cpu_count()} CPUs, load average at start {os.getloadavg()[0]:.1f}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "units": args.units,
        "quick": args.quick,
        "repeats": 1 if args.quick else args.repeats,
        "mixes": [],
    }
    for name in args.mixes:
        if args.quick:
            result["mixes"].append(validate_mix(name, args.units, 1, runs_root, workdir, 1500, every_mode=False))
        else:
            result["mixes"].append(validate_mix(name, args.units, args.top, runs_root, workdir, repeats=args.repeats))
    if not args.no_quickstart and not args.quick:
        result["quickstart"] = validate_quickstart(runs_root, args.quickstart_steps)
    out = Path(args.out) if args.out else (runs_root if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / "placement_validation.json").write_text(json.dumps(result, indent=1, default=float))
    (out / "placement_validation.md").write_text(write_markdown(result))
    print(write_markdown(result))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
