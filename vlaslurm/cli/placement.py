"""`vlaslurm profile` and `vlaslurm plan --placement auto [--gpus N]`: the scored placements and the choice."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence, Tuple

from vlaslurm.cli.common import add_command, add_spec_args, console, load, runs_root
from vlaslurm.placement.choose import gpus_per_node, scored_placements
from vlaslurm.placement.profile import profile
from vlaslurm.placement.profile_types import Profile
from vlaslurm.placement.search import ROBUSTNESS, TOLERANCE, Scored, apply, choose
from vlaslurm.rundir import profiles_dir


def print_scores(
    console, scored: Sequence[Scored], source: str, note: str, units: int, loaded, top: int = 15
) -> Scored:
    from rich import box
    from rich.table import Table

    table = Table(
        "#",
        "candidate",
        "SPS",
        "used SPS",
        "util sim",
        "util gen",
        "util train",
        "CPU cores",
        "Δv p50",
        "Δv p99",
        "dropped",
        box=box.SIMPLE_HEAD,
        title=f"placements for {units} units, from {source}",
        title_justify="left",
    )
    fitting = [r for r in scored if r.pred]
    for i, r in enumerate(fitting[:top]):
        p = r.pred
        assert p is not None  # `fitting` keeps the candidates with a prediction
        table.add_row(
            str(i + 1),
            r.cand.label(),
            f"{p.sps:.0f}",
            f"{p.used_sps:.0f}",
            f"{p.util['simulator']:.2f}",
            f"{p.util['generator']:.2f}",
            f"{p.util['trainer']:.2f}",
            cpu_cell(p),
            f"{p.lag['p50']:g}",
            f"{p.lag['p99']:g}",
            f"{p.dropped:.1%}",
        )
    console.print(table)
    console.print(
        f"Within {TOLERANCE:.0%} of the best (or twice the simulation's standard error), candidates are "
        f"ordered by {', then '.join(name for name, _ in ROBUSTNESS)}, then the prediction. "
        "CPU cores: what the roles keep busy; * where the shared cores bound the throughput."
    )
    if note:
        console.print(note)
    rejected = [r for r in scored if r.rejected]
    if rejected:
        console.print(f"{len(rejected)} candidates rejected, e.g.:")
        for r in rejected[:5]:
            console.print(f"  {r.cand.label()}: {r.rejected}", markup=False)
    best = choose(scored)
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


def plan_auto(args: argparse.Namespace, loaded, root: Path) -> int:
    """`vlaslurm plan SPEC --placement auto [--gpus N]`: the scored placements and the choice."""
    if args.gpus is not None and not 1 <= args.gpus <= 4096:
        raise loaded.error("resources", f"--gpus must be between 1 and 4096, got {args.gpus}")
    local, measure = profile_source(args, loaded, root)
    scored, source, note, units = scored_placements(loaded, root, local, args.gpus, measure)
    try:
        print_scores(console, scored, source, note, units, loaded)
    except ValueError as exc:
        raise loaded.error("resources.placement", str(exc)) from None
    return 0


def profile_source(args: argparse.Namespace, loaded, root: Path) -> Tuple[bool, bool]:
    """Where plan's profile comes from, as (local, measure); says so before a profiling job runs.

    Without a reachable Slurm, `--gpus N` (a hypothetical cluster) plans from this machine: its cached or
    measured profile, or a synthetic spec's own config; without `--gpus` that is one line saying how to fix it."""
    from vlaslurm.placement.choose import is_synthetic
    from vlaslurm.placement.profile import cached_profile
    from vlaslurm.slurm.cluster import SlurmUnavailable, default_partition

    local, measure = bool(args.local), True
    try:
        cached = cached_profile(loaded, root, local) is not None  # a GPU spec's key asks sinfo for the model
        if not cached and not local:
            default_partition()  # is there a Slurm to run the profiling job?
    except SlurmUnavailable as exc:
        if args.gpus is None:
            raise SlurmUnavailable(f"{exc}; `--gpus N` plans without one, `--local` profiles this machine") from None
        console.print(f"{exc}. Planning for {args.gpus} GPUs without it, from this machine.", markup=False)
        local, measure = True, False
        cached = cached_profile(loaded, root, local) is not None
    if not cached and (measure or not is_synthetic(loaded.spec)):
        where = "on this machine (submitit's local executor)" if local else "through Slurm"
        console.print(
            f"No profile of {loaded.spec.name} is cached under {profiles_dir(root)}: running the profiling "
            f"job {where} first (about a minute of measurements; `vlaslurm profile` runs it alone), "
            "then ranking. Nothing else is submitted.",
            markup=False,
        )
    return local, measure


def cmd_profile(args: argparse.Namespace) -> int:
    """Submit the profiling job (or read the cached profile) and print its summary."""
    loaded = load(args)
    prof = profile(loaded, runs_root(args), local=args.local, force=args.force, budget_s=args.budget_s)
    console.print(summary(prof), markup=False)
    return 0


def summary(prof: Profile) -> str:
    sim, gen, tr = prof.simulator, prof.generator, prof.trainer
    lines = [f"profile {prof.key} on {', '.join(prof.hosts)} ({prof.gpu})"]
    for n, b in sim.batch.items():
        lines.append(
            f"  simulator: {n:>4} instances stepped together: mean {b.mean * 1e3:.2f} ms, p99 {b.p99 * 1e3:.2f} ms"
        )
    per = sim.per_instance.summary
    lines.append(
        f"  simulator: one instance alone: mean {sum(s.mean for s in per) / len(per) * 1e3:.2f} ms, "
        f"slowest instance p99 {max(s.p99 for s in per) * 1e3:.2f} ms"
    )
    lines.append(
        "  generator forward: "
        + ", ".join(f"b={b}: {s * 1e3:.2f} ms" for b, s in zip(gen.forward.sizes, gen.forward.seconds))
    )
    lines.append(
        "  trainer update: "
        + ", ".join(f"{n} steps: {s * 1e3:.1f} ms" for n, s in zip(tr.update.sizes, tr.update.seconds))
    )
    w = prof.weights
    lines.append(
        f"  weights: {w.bytes / 2**20:.2f} MiB, copy {w.copy_bytes_per_s / 1e9:.2f} GB/s; "
        f"hop {prof.transport.hop_s * 1e3:.2f} ms"
    )
    return "\n".join(lines)


def register(sub) -> None:
    """Add `vlaslurm profile`."""
    p = add_command(
        sub,
        "profile",
        cmd_profile,
        "measure the spec's roles in a short job (cached)",
        "measure the spec's simulator, policy and learner in a short job; the result is cached under the runs root",
    )
    add_spec_args(p)
    p.add_argument("--local", action="store_true", help="run the job on this machine (submitit's local executor)")
    p.add_argument("--force", action="store_true", help="measure again even if a profile is cached")
    p.add_argument("--budget-s", type=float, default=60.0, help="rough time the measurements may take")
