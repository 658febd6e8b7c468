"""Auto placement as the commands use it: costs from the cached profile (or a new one), the choice, its overrides."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from vlaslurm.placement.costs import Costs, from_profile, from_synthetic
from vlaslurm.placement.profile import cached_profile, profile
from vlaslurm.placement.search import apply, choose, default_units, scaled_workload, score_candidates
from vlaslurm.spec import LoadedSpec, load_spec


def is_synthetic(spec) -> bool:
    return spec.env.type == spec.model.type == spec.algo.type == "synthetic"


def costs_for(loaded, runs_root: Path, local: bool, measure: bool = True) -> Tuple[Costs, str]:
    """Costs from the cached profile; else profile now (`measure`), or derive a synthetic spec's from its config."""
    prof = cached_profile(loaded, runs_root, local)
    if prof is None and (measure or not is_synthetic(loaded.spec)):
        prof = profile(loaded, runs_root, local=local)
    if prof is None:
        return from_synthetic(loaded.spec), "synthetic config (not measured)"
    return from_profile(prof, loaded.spec), f"profile {prof.key} ({prof.gpu}, {', '.join(prof.hosts)})"


def gpus_per_node(loaded) -> int:
    spec = loaded.spec
    return (
        max([spec.role_resources(r).gpus_per_node for r in ("simulator", "generator", "trainer")] + [8])
        if any(spec.role_resources(r).gpus_per_node for r in ("simulator", "generator", "trainer"))
        else 8
    )


def auto_overrides(loaded, runs_root: Path, local: bool = False) -> List[str]:
    """What `submit` applies for `resources.placement: auto`: profile (unless cached), choose, apply."""
    costs, _ = costs_for(loaded, runs_root, local)
    try:
        best = choose(score_candidates(loaded.spec, costs))
    except ValueError as exc:
        raise loaded.error("resources.placement", str(exc)) from None
    return apply(loaded, best, gpus_per_node(loaded))


def scored_placements(loaded, runs_root: Path, local: bool, units: Optional[int], measure: bool = True):
    """Every candidate placement of the spec, scored on `units` (default: the spec's own), with where the costs
    came from and a note on the scale."""
    costs, source = costs_for(loaded, runs_root, local, measure)
    units = units or default_units(loaded.spec)
    work, note = scaled_workload(loaded.spec, units)
    if note and costs.host_cores:  # another scale runs on a cluster: each rank has its cpus_per_task, not this host
        costs.host_cores = None
        note += "; CPU bound per role from cpus_per_task"
    return score_candidates(loaded.spec, costs, units, work), source, note, units


def resolve_auto(loaded: LoadedSpec, runs_root: Path) -> LoadedSpec:
    """The spec itself, or for `resources.placement: auto` the spec reloaded with the chosen placement."""
    if loaded.spec.resources.placement != "auto":
        return loaded
    return load_spec(loaded.path, [*loaded.overrides, *auto_overrides(loaded, runs_root)], site=loaded.site)
