"""Run directories and the run index: creating a run directory, `run.json`, and finding runs again."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from vlaslurm.rundir.files import append_line, write_atomic
from vlaslurm.rundir.layout import RUN_INFO, RunDir, index_path
from vlaslurm.rundir.secret import create_secret


class RunNotFound(LookupError):
    """No run matches what the user named."""


@dataclass
class RunInfo:
    """What `run.json` records about one run."""

    name: str
    run_dir: str
    kind: str  # "local" or "slurm"
    created: float = field(default_factory=time.time)
    job_id: Optional[str] = None
    spec_path: str = ""
    overrides: List[str] = field(default_factory=list)
    ranks: Dict[str, int] = field(default_factory=dict)
    sweep: Optional[str] = None


def new_run_dir(runs_root: Path, name: str, stamp: Optional[str] = None) -> Path:
    """A fresh private run directory `<root>/<name>/<stamp>` (suffixed if the stamp is taken)."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    parent = Path(runs_root) / name
    parent.mkdir(parents=True, exist_ok=True)
    for suffix in [""] + [f".{i}" for i in range(1, 100)]:
        candidate = parent / f"{stamp}{suffix}"
        try:
            candidate.mkdir(mode=0o700)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory under {parent}")


def claim_run_dir(path: Path) -> Path:
    """Use an explicit `--run-dir`; refuse one that already holds a run (nothing is overwritten)."""
    path = Path(path)
    if (path / RUN_INFO).exists():
        raise FileExistsError(f"{path} already holds a run ({RUN_INFO}); choose another --run-dir")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def create_run(
    directory: Path, spec_yaml: str, job_script: Optional[str] = None, site_profile: Optional[bytes] = None
) -> None:
    """Fill a fresh run directory before any rank starts: logs/, the resolved spec, the per-run secret,
    and for Slurm the rendered script and the site profile it was submitted with."""
    paths = RunDir(directory)
    paths.logs.mkdir(exist_ok=True)
    write_atomic(paths.spec, spec_yaml.encode())
    if job_script is not None:
        write_atomic(paths.job_script, job_script.encode(), mode=0o700)
    if site_profile is not None:
        write_atomic(paths.site_copy, site_profile)
    create_secret(directory)


def write_info(info: RunInfo) -> None:
    """Write `run.json` atomically."""
    write_atomic(Path(info.run_dir) / RUN_INFO, json.dumps(asdict(info), indent=2).encode())


def read_info(run_dir: Path) -> RunInfo:
    """Read `run.json` of a run directory."""
    data = json.loads((Path(run_dir) / RUN_INFO).read_text())
    return RunInfo(**data)


def append_index(runs_root: Path, info: RunInfo) -> None:
    """Record a run in the index (one JSON line, appended with O_APPEND so writers never interleave)."""
    line = json.dumps(
        {
            "name": info.name,
            "run_dir": str(Path(info.run_dir).resolve()),
            "job_id": info.job_id,
            "kind": info.kind,
            "created": info.created,
            "sweep": info.sweep,
        }
    )
    Path(runs_root).mkdir(parents=True, exist_ok=True)
    append_line(index_path(runs_root), line, mode=0o600)


def list_runs(runs_root: Path) -> List[RunInfo]:
    """Runs of the index whose directory still exists, oldest first (the newest record of each wins)."""
    index = index_path(runs_root)
    if not index.exists():
        return []
    by_dir: Dict[str, dict] = {}
    for line in index.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a crash must not hide every other run
        by_dir[entry["run_dir"]] = entry
    runs = []
    for run_dir in by_dir:
        if (Path(run_dir) / RUN_INFO).exists():
            runs.append(read_info(Path(run_dir)))
    return sorted(runs, key=lambda r: r.created)


def resolve_run(runs_root: Path, ref: str) -> RunInfo:
    """A run named by its directory, its job id or its name (the newest run of that name)."""
    path = Path(ref)
    if (path / RUN_INFO).exists():
        return read_info(path)
    runs = list_runs(runs_root)
    matches = [r for r in runs if r.job_id == ref] or [r for r in runs if r.name == ref or r.sweep == ref]
    if not matches:
        known = ", ".join(sorted({r.name for r in runs})) or "none"
        raise RunNotFound(f"no run {ref!r} under {runs_root} (a run directory, job id or run name; runs: {known})")
    return matches[-1]
