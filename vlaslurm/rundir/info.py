"""Run directories and the run index: creating a run directory, `run.json`, and finding runs again."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

from vlaslurm.rundir.checked import DamagedRunDir, Shape, check_record, json_lines, read_json_object
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
    """Use an explicit `--run-dir`; refuse one that already holds a run (nothing is overwritten). Only a
    directory made here is made private (0700): an existing one keeps its mode."""
    path = Path(path)
    if (path / RUN_INFO).exists():
        raise FileExistsError(f"{path} already holds a run ({RUN_INFO}); choose another --run-dir")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not path.is_dir():
            raise FileExistsError(f"--run-dir {path} exists and is not a directory") from None
        return path
    os.chmod(path, 0o700)  # mkdir's mode passes through the umask
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


def replace_spec(directory: Path, spec_yaml: str) -> Path:
    """Write the spec a resumed attempt runs with (`vlaslurm resume RUN KEY=VALUE`); the one it replaces is kept as
    `spec-before-resume-<n>.yaml`, whose path this returns."""
    paths = RunDir(directory)
    kept = paths.spec_before_resume(len(paths.specs_before_resume()) + 1)
    write_atomic(kept, paths.spec.read_bytes())
    write_atomic(paths.spec, spec_yaml.encode())
    return kept


def write_info(info: RunInfo) -> None:
    """Write `run.json` atomically."""
    write_atomic(Path(info.run_dir) / RUN_INFO, json.dumps(asdict(info), indent=2).encode())


INFO_KEYS: Shape = {"name": str, "run_dir": str, "kind": str}
INFO_TYPES: Shape = {
    "created": (int, float),
    "job_id": (str, type(None)),
    "spec_path": str,
    "overrides": list,
    "ranks": dict,
    "sweep": (str, type(None)),
}
JOB_ID = re.compile(r"\d+")


def read_info(run_dir: Path) -> RunInfo:
    """Read `run.json` of a run directory; DamagedRunDir if it is missing, unreadable or of the wrong shape.

    `run_dir` of the result is the directory read, whatever the file says (a moved or edited `run.json`
    never points a command at another directory)."""
    path = Path(run_dir) / RUN_INFO
    data = read_json_object(path, INFO_KEYS)
    if data is None:
        raise DamagedRunDir(path, "missing")
    present = {key: kind for key, kind in INFO_TYPES.items() if key in data}
    check_record(path, data, present)
    job_id = data.get("job_id")
    if job_id is not None and not JOB_ID.fullmatch(job_id):
        raise DamagedRunDir(path, f"job_id {job_id!r} is not a Slurm job id (digits only)")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in data.get("ranks", {}).values()):
        raise DamagedRunDir(path, f"ranks {data['ranks']!r} are not role: count")
    known = {f.name for f in fields(RunInfo)}
    info = RunInfo(**{key: value for key, value in data.items() if key in known})
    if not _same_dir(Path(info.run_dir), Path(run_dir)):
        info.run_dir = str(Path(run_dir).absolute())
    return info


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


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


@dataclass
class RunListing:
    """The runs of the index that can be read, and what could not (a bad index line or `run.json`)."""

    runs: List[RunInfo] = field(default_factory=list)
    damaged: List[DamagedRunDir] = field(default_factory=list)


def scan_runs(runs_root: Path) -> RunListing:
    """Runs of the index whose directory still exists, oldest first (the newest record of each wins);
    damaged index lines and run directories are collected, not raised."""
    listing = RunListing()
    for run_dir in _indexed_dirs(index_path(runs_root), listing.damaged):
        if (Path(run_dir) / RUN_INFO).exists():
            try:
                listing.runs.append(read_info(Path(run_dir)))
            except DamagedRunDir as exc:
                listing.damaged.append(exc)
    listing.runs.sort(key=lambda r: r.created)
    return listing


def _indexed_dirs(index: Path, damaged: List[DamagedRunDir]) -> List[str]:
    """The run directories the index names, once each (a torn line is skipped, a bad one collected)."""
    dirs: Dict[str, None] = {}
    try:
        for number, entry in json_lines(index):
            try:
                dirs[check_record(index, entry, {"run_dir": str}, number)["run_dir"]] = None
            except DamagedRunDir as exc:
                damaged.append(exc)
    except DamagedRunDir as exc:
        damaged.append(exc)
    return list(dirs)


def list_runs(runs_root: Path) -> List[RunInfo]:
    """The readable runs of the index, oldest first (`scan_runs` also says which could not be read)."""
    return scan_runs(runs_root).runs


def resolve_run(runs_root: Path, ref: str) -> RunInfo:
    """A run named by its directory, its job id or its name (the newest run of that name)."""
    path = Path(ref)
    if (path / RUN_INFO).exists():
        return read_info(path)
    listing = scan_runs(runs_root)
    runs = listing.runs
    matches = [r for r in runs if r.job_id == ref] or [r for r in runs if r.name == ref or r.sweep == ref]
    if not matches:
        known = ", ".join(sorted({r.name for r in runs})) or "none"
        unreadable = "".join(f"; unreadable: {exc}" for exc in listing.damaged)
        raise RunNotFound(
            f"no run {ref!r} under {runs_root} (a run directory, job id or run name; runs: {known}){unreadable}"
        )
    return matches[-1]
