"""Seeds and sweeps: one hetjob per combination, grouped under one sweep name.

A heterogeneous job cannot be a job array, so `vlaslurm submit SPEC --seeds 0,1,2
--sweep algo.lr=1e-4,3e-4` submits one job per element of the cartesian product
(here 6), each with its combination as `key=value` overrides. Every combination is
loaded and validated before the first job is submitted, so a bad value submits
nothing. The runs share `RunInfo.sweep` (the run index, `vlaslurm runs --sweep`,
`vlaslurm status/cancel SWEEP`) and the MLflow tag `vlaslurm.sweep`.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from vlaslurm.rundir import RunDir, RunInfo, RunNotFound, list_runs, resolve_run
from vlaslurm.spec import LoadedSpec, SpecError
from vlaslurm.spec.errors import COMMAND_LINE, Location

SEED_KEY = "rollout.seed"


def parse_seeds(text: str) -> List[int]:
    """`0,1,2` or `0-4` (inclusive) or a mix: `0-2,10`."""
    seeds: List[int] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise _error(f"--seeds {text!r}: {item!r} is not a seed or an increasing range like 0-4")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        seeds += range(low, high + 1)
    if not seeds or len(set(seeds)) != len(seeds):
        raise _error(f"--seeds {text!r} must name at least one seed, each once")
    return seeds


def parse_sweep(item: str) -> Tuple[str, List[str]]:
    """`key=v1,v2,...` -> (key, ['v1', 'v2']); commas inside [...] or {...} belong to the value."""
    key, sep, values = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise _error(f"--sweep {item!r} must look like dotted.key=value1,value2")
    parts, depth, current = [], 0, ""
    for char in values:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    parts = [p.strip() for p in parts]
    if not all(parts) or len(set(parts)) != len(parts):
        raise _error(f"--sweep {item!r}: every value must be non-empty and named once")
    return key, parts


def combinations(seeds: Optional[Sequence[int]], sweeps: Sequence[Tuple[str, List[str]]]) -> List[List[str]]:
    """The override lists of every combination (cartesian product, seeds last so they vary fastest)."""
    axes = [[f"{key}={value}" for value in values] for key, values in sweeps]
    if seeds:
        if any(key == SEED_KEY for key, _ in sweeps):
            raise _error(f"--seeds and --sweep {SEED_KEY}=... name the same key; use one of them")
        axes.append([f"{SEED_KEY}={seed}" for seed in seeds])
    keys = [key for key, _ in sweeps]
    if len(set(keys)) != len(keys):
        raise _error(f"--sweep names a key twice: {', '.join(sorted({k for k in keys if keys.count(k) > 1}))}")
    return [list(combo) for combo in itertools.product(*axes)]


def default_sweep_name(spec_name: str) -> str:
    return f"{spec_name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"


def load_all(
    load: Callable[[Sequence[str]], LoadedSpec], overrides: Sequence[str], combos: List[List[str]]
) -> List[LoadedSpec]:
    """Every combination loaded and validated (the user's overrides first, the combination on top)."""
    return [load([*overrides, *combo]) for combo in combos]


def submit_sweep(
    specs: List[LoadedSpec],
    runs_root: Path,
    name: str,
    entry_args: Sequence[str] = (),
    on_submit: Callable[[int, object], None] = lambda i, sub: None,
) -> list:
    """Submit one job per loaded spec under sweep `name`; returns the Submissions. If Slurm refuses one,
    the error says which jobs were already submitted (cancel them with `vlaslurm cancel NAME`)."""
    from vlaslurm.slurm.cluster import SlurmUnavailable
    from vlaslurm.slurm.submit import Submission, submit

    if any(r.sweep == name for r in list_runs(runs_root)):
        raise _error(f"sweep {name!r} already exists under {runs_root}; choose another --sweep-name")
    done: List[Submission] = []
    for index, loaded in enumerate(specs):
        try:
            sub = submit(loaded, runs_root, entry_args=entry_args, sweep=name)
        except (SlurmUnavailable, SpecError) as exc:
            if not done:
                raise
            ids = ", ".join(s.job_id for s in done)
            raise SlurmUnavailable(
                f"{exc} (after {len(done)} of {len(specs)} jobs of sweep {name!r} were "
                f"submitted: {ids}; `vlaslurm cancel {name}` stops them)"
            ) from None
        done.append(sub)
        on_submit(index, sub)
    return done


def sweep_runs(runs_root: Path, name: str) -> List[RunInfo]:
    """Every run of sweep `name`, oldest first."""
    return [r for r in list_runs(runs_root) if r.sweep == name]


def resolve_runs(runs_root: Path, ref: str) -> List[RunInfo]:
    """RUN as the commands take it, where a sweep name means all of its runs."""
    if not RunDir(ref).holds_run():
        runs = list_runs(runs_root)
        if not any(r.job_id == ref for r in runs):
            members = [r for r in runs if r.sweep == ref]
            if members:
                return members
    return [resolve_run(runs_root, ref)]


def _error(message: str) -> SpecError:
    return SpecError(message, location=Location(COMMAND_LINE))


__all__ = [
    "RunNotFound",
    "combinations",
    "default_sweep_name",
    "load_all",
    "parse_seeds",
    "parse_sweep",
    "resolve_runs",
    "submit_sweep",
    "sweep_runs",
]
