"""The command-line side of auto placement: `vlaslurm profile`, `plan --placement auto`, and submit's hook."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from vlaslurm.placement.costs import Costs, from_profile, from_synthetic
from vlaslurm.placement.model import ROBUSTNESS, TOLERANCE, Ranked, apply, choose, default_units, rank, scaled_workload
from vlaslurm.placement.profile import cached_profile, profile


def is_synthetic(spec) -> bool:
    return spec.env.type == spec.model.type == spec.algo.type == "synthetic"


def costs_for(loaded, runs_root: Path, local: bool, measure: bool = True) -> Tuple[Costs, str]:
    """Costs from the cached profile; else profile now (`measure`), or derive a synthetic spec's from its config."""
    prof = cached_profile(loaded, runs_root, local)
    if prof is None and (measure or not is_synthetic(loaded.spec)):
        prof = profile(loaded, runs_root, local=local)
    if prof is None:
        return from_synthetic(loaded.spec), "synthetic config (not measured)"
    return from_profile(prof, loaded.spec), f"profile {prof['key']} ({prof['gpu']}, {', '.join(prof['hosts'])})"


def gpus_per_node(loaded) -> int:
    spec = loaded.spec
    return max([spec.role_resources(r).gpus_per_node for r in ("simulator", "generator", "trainer")] + [8]) \
        if any(spec.role_resources(r).gpus_per_node for r in ("simulator", "generator", "trainer")) else 8


def auto_overrides(loaded, runs_root: Path, local: bool = False) -> List[str]:
    """What `submit` applies for `resources.placement: auto`: profile (unless cached), choose, apply."""
    costs, _ = costs_for(loaded, runs_root, local)
    try:
        best = choose(rank(loaded.spec, costs))
    except ValueError as exc:
        raise loaded.error("resources.placement", str(exc)) from None
    return apply(loaded, best, gpus_per_node(loaded))


def ranking(loaded, runs_root: Path, local: bool, units: Optional[int], measure: bool = True):
    costs, source = costs_for(loaded, runs_root, local, measure)
    units = units or default_units(loaded.spec)
    work, note = scaled_workload(loaded.spec, units)
    if note and costs.host_cores:  # another scale runs on a cluster: each rank has its cpus_per_task, not this host
        costs.host_cores = None
        note += "; CPU bound per role from cpus_per_task"
    return rank(loaded.spec, costs, units, work), source, note, units


def print_ranking(console, ranked: Sequence[Ranked], source: str, note: str, units: int, loaded, top: int = 15) -> Ranked:
    from rich import box
    from rich.table import Table

    table = Table("#", "candidate", "SPS", "used SPS", "util sim", "util gen", "util train", "CPU cores",
                  "Δv p50", "Δv p99", "dropped", box=box.SIMPLE_HEAD,
                  title=f"placements for {units} units, from {source}", title_justify="left")
    fitting = [r for r in ranked if r.pred]
    for i, r in enumerate(fitting[:top]):
        p = r.pred
        table.add_row(str(i + 1), r.cand.label(), f"{p.sps:.0f}", f"{p.used_sps:.0f}", f"{p.util['simulator']:.2f}",
                      f"{p.util['generator']:.2f}", f"{p.util['trainer']:.2f}", cpu_cell(p), f"{p.lag['p50']:g}",
                      f"{p.lag['p99']:g}", f"{p.dropped:.1%}")
    console.print(table)
    console.print(f"Within {TOLERANCE:.0%} of the best (or twice the simulation's standard error), candidates are "
                  f"ordered by {', then '.join(name for name, _ in ROBUSTNESS)}, then the prediction. "
                  "CPU cores: what the roles keep busy; * where the shared cores bound the throughput.")
    if note:
        console.print(note)
    rejected = [r for r in ranked if r.rejected]
    if rejected:
        console.print(f"{len(rejected)} candidates rejected, e.g.:")
        for r in rejected[:5]:
            console.print(f"  {r.cand.label()}: {r.rejected}", markup=False)
    best = choose(ranked)
    console.print(f"[bold]choice:[/bold] {best.cand.label()}")
    console.print("overrides: " + " ".join(apply(loaded, best, gpus_per_node(loaded))), markup=False)
    return best


def cpu_cell(pred) -> str:
    """Cores the roles keep busy, and '*' when the shared cores are what bounds the throughput."""
    if not pred.cpu:
        return "-"
    return f"{sum(pred.cpu.values()):.2f}" + ("*" if pred.sps >= pred.cpu_bound * (1 - 1e-9) else "")


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """Options `vlaslurm plan` gets for auto placement."""
    p.add_argument("--placement", choices=["manual", "auto"], help="auto: rank placements from the profile")
    p.add_argument("--gpus", type=int, help="predict for this many GPUs (8..256) from the same profile")
    p.add_argument("--local", action="store_true", help="use (or make) the profile of this machine")


def plan_auto(args: argparse.Namespace, loaded, runs_root: Path, console) -> int:
    """`vlaslurm plan SPEC --placement auto [--gpus N]`: the ranking table and the choice."""
    if args.gpus is not None and not 1 <= args.gpus <= 4096:
        raise loaded.error("resources", f"--gpus must be between 1 and 4096, got {args.gpus}")
    ranked, source, note, units = ranking(loaded, runs_root, args.local, args.gpus)
    try:
        print_ranking(console, ranked, source, note, units, loaded)
    except ValueError as exc:
        raise loaded.error("resources.placement", str(exc)) from None
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Submit the profiling job (or read the cached profile) and print its summary."""
    from vlaslurm.cli import _load, _runs_root, console

    loaded = _load(args)
    prof = profile(loaded, _runs_root(args), local=args.local, force=args.force, budget_s=args.budget_s)
    console.print(summary(prof), markup=False)
    return 0


def summary(prof: Dict) -> str:
    sim, gen, tr = prof["simulator"], prof["generator"], prof["trainer"]
    lines = [f"profile {prof['key']} on {', '.join(prof['hosts'])} ({prof['gpu']})"]
    for n, b in sim["batch"].items():
        lines.append(f"  simulator: {n:>4} instances stepped together: mean {b['mean'] * 1e3:.2f} ms, "
                     f"p99 {b['p99'] * 1e3:.2f} ms")
    per = sim["per_instance"]["summary"]
    lines.append(f"  simulator: one instance alone: mean {sum(s['mean'] for s in per) / len(per) * 1e3:.2f} ms, "
                 f"slowest instance p99 {max(s['p99'] for s in per) * 1e3:.2f} ms")
    lines.append("  generator forward: " + ", ".join(f"b={b}: {s * 1e3:.2f} ms" for b, s in
                                                     zip(gen["forward"]["sizes"], gen["forward"]["seconds"])))
    lines.append("  trainer update: " + ", ".join(f"{n} steps: {s * 1e3:.1f} ms" for n, s in
                                                  zip(tr["update"]["sizes"], tr["update"]["seconds"])))
    w = prof["weights"]
    lines.append(f"  weights: {w['bytes'] / 2 ** 20:.2f} MiB, copy {w['copy_bytes_per_s'] / 1e9:.2f} GB/s; "
                 f"hop {prof['transport']['hop_s'] * 1e3:.2f} ms")
    return "\n".join(lines)


def register(subparsers) -> None:
    """Add `vlaslurm profile` to the CLI's subparsers (its SpecErrors are handled by the CLI's main)."""
    p = subparsers.add_parser("profile", help="measure the spec's roles in a short job (cached)",
                              description="measure the spec's simulator, policy and learner in a short job; "
                                          "the result is cached under the runs root")
    p.set_defaults(func=cmd_profile)
    p.add_argument("spec", help="experiment spec (YAML)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--site", help="site profile (default: $VLASLURM_SITE; 'none' for no site)")
    p.add_argument("--local", action="store_true", help="run the job on this machine (submitit's local executor)")
    p.add_argument("--force", action="store_true", help="measure again even if a profile is cached")
    p.add_argument("--budget-s", type=float, default=60.0, help="rough time the measurements may take")
