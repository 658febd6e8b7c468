"""Housekeeping: free disk space from finished runs (`vlaslurm clean`).

What goes, per run: `weights/` (filesystem weight sync), `events/` (timing records),
`rendezvous/` (addresses of a finished meeting), unfinished checkpoint folders
(`checkpoints/.tmp-*`), and with `--keep-checkpoints N` every checkpoint but the newest
N; with `--logs` also `logs/`. What stays: the run info, the resolved spec, the script, the ledger,
metrics, exit record and (unless told) logs, so `status`, `compare` and the notebooks
still work. A run is touched only when it has finished (COMPLETED, FAILED, CANCELLED,
or UNKNOWN with nothing written for an hour): never a running, pending or requeued one.

Where: only the directory named on the command line, or run directories the index names that lie under the
runs root; never a directory a file inside a run names, and never through a symbolic link inside a run.
A run directory that cannot be read is named and, with `--older-than`, skipped.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from vlaslurm.cli.common import UserError, add_command, console, resolve_all, runs_root
from vlaslurm.rundir import RunDir, RunInfo, exit_records, layout, scan_runs
from vlaslurm.slurm.state import run_state

FREED_DIRS = layout.FREED_BY_CLEAN
_CHECKPOINT = layout.CHECKPOINT_NAME
FINISHED = ("COMPLETED", "FAILED", "CANCELLED")
QUIET_S = 3600.0  # an UNKNOWN run counts as finished after this long without a write


@dataclass(frozen=True)
class Item:
    """One folder `clean` would delete."""

    path: Path
    size: int
    why: str


def parse_age(text: str) -> float:
    """`30m`, `12h`, `7d`, `2w` (or plain seconds) -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise ValueError(f"--older-than {text!r} must look like 30m, 12h, 7d or 2w")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]


def finished(info: RunInfo, state: str, now: Optional[float] = None) -> bool:
    """Whether `clean` may touch the run: a final state, or UNKNOWN and quiet for an hour."""
    if state.startswith(FINISHED):
        return True
    if state != "UNKNOWN":
        return False
    now = time.time() if now is None else now
    return now - last_write(Path(info.run_dir)) > QUIET_S


def last_write(run_dir: Path) -> float:
    """Newest modification time of anything in the run directory (at most two levels down)."""
    newest = run_dir.stat().st_mtime if run_dir.exists() else 0.0
    for pattern in ("*", "*/*"):
        for path in run_dir.glob(pattern):
            try:
                newest = max(newest, path.stat().st_mtime)
            except OSError:
                continue
    return newest


def ended_at(info: RunInfo) -> float:
    """When the run ended (its exit record's job line), else when anything was last written."""
    ends = [float(r["end"]) for r in exit_records(Path(info.run_dir)) if r.get("step") == "job"]
    return ends[-1] if ends else last_write(Path(info.run_dir))


def items(info: RunInfo, keep_checkpoints: Optional[int] = None, logs: bool = False) -> List[Item]:
    """What `clean` would delete in one run directory."""
    run_dir = Path(info.run_dir)
    found = [Item(run_dir / name, du(run_dir / name), name + "/") for name in FREED_DIRS if _real_dir(run_dir / name)]
    checkpoints = RunDir(run_dir).checkpoints
    if _real_dir(checkpoints):
        found += [Item(p, du(p), "unfinished checkpoint") for p in sorted(checkpoints.glob(".tmp-*")) if _real_dir(p)]
        if keep_checkpoints is not None:
            numbered = [
                (int(m.group(1)), p)
                for p in checkpoints.iterdir()
                if (m := _CHECKPOINT.fullmatch(p.name)) and _real_dir(p)
            ]
            complete = [p for _, p in sorted(numbered, key=lambda item: item[0])]
            old = complete[: max(0, len(complete) - keep_checkpoints)]
            found += [Item(p, du(p), f"checkpoint beyond the newest {keep_checkpoints}") for p in old]
    logs_dir = RunDir(run_dir).logs
    if logs and _real_dir(logs_dir):
        found.append(Item(logs_dir, du(logs_dir), "logs/ (--logs)"))
    return found


def _real_dir(path: Path) -> bool:
    """A directory that is not a symbolic link (a link inside a run is never followed by `clean`)."""
    return path.is_dir() and not path.is_symlink()


def cleanable_runs(args: argparse.Namespace) -> List[RunInfo]:
    """The runs `clean` may look at: the one(s) named, or every run of the index (`--older-than`), each
    verified to be the directory named or to lie under the runs root."""
    root = runs_root(args)
    if args.run is not None:
        runs = resolve_all(args)
        for info in runs:
            if not _where_allowed(Path(info.run_dir), root, args.run):
                raise UserError(
                    f"not cleaning {info.run_dir}: the runs index names it but it is not under the runs root "
                    f"{root}; name the directory itself to clean it"
                )
        return runs
    listing = scan_runs(root)
    for damage in listing.damaged:
        console.print(f"skip     {damage.relative(root)} (unreadable)", markup=False)
    allowed = [info for info in listing.runs if _where_allowed(Path(info.run_dir), root, None)]
    for info in listing.runs:
        if info not in allowed:
            console.print(f"skip     {info.run_dir}: not under the runs root {root}", markup=False)
    return allowed


def _where_allowed(run_dir: Path, root: Path, named: Optional[str]) -> bool:
    """`run_dir` is the directory the user named, or lies under the runs root."""
    path, top = run_dir.resolve(), root.resolve()
    if named is not None and RunDir(named).holds_run() and path == Path(named).resolve():
        return True
    return path != top and path.is_relative_to(top)


def delete(found: Iterable[Item]) -> int:
    """Delete the items; returns the bytes freed."""
    freed = 0
    for item in found:
        shutil.rmtree(item.path, ignore_errors=True)
        freed += item.size
    return freed


def du(path: Path) -> int:
    """Bytes under `path` (files only; links are not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for child in path.rglob("*"):
        try:
            if child.is_file() and not child.is_symlink():
                total += child.stat().st_size
        except OSError:
            continue
    return total


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def register(sub) -> None:
    """Add `clean` to the `vlaslurm` command line."""
    text = "free disk space from finished runs (weights/, events/, rendezvous/, old checkpoints)"
    p = add_command(sub, "clean", cmd_clean, text, text + "; never touches a running run")
    p.add_argument("run", nargs="?", help="run directory, run name, job id or sweep name (all its runs)")
    p.add_argument("--older-than", metavar="AGE", help="every finished run that ended more than AGE ago (30m, 12h, 7d)")
    p.add_argument("--keep-checkpoints", type=int, metavar="N", help="also delete all checkpoints but the newest N")
    p.add_argument("--logs", action="store_true", help="also delete logs/")
    p.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    p.add_argument("--yes", "-y", action="store_true", help="delete without asking")


def cmd_clean(args: argparse.Namespace) -> int:
    """List what a clean would free in finished runs, confirm, delete."""
    if (args.run is None) == (args.older_than is None):
        raise UserError("name one RUN or give --older-than AGE (not both)")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 0:
        raise UserError(f"--keep-checkpoints must be at least 0, got {args.keep_checkpoints}")
    age = 0.0
    if args.older_than is not None:
        try:
            age = parse_age(args.older_than)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    runs = cleanable_runs(args)
    now = time.time()
    plan: List[tuple] = []
    for info in runs:
        state = run_state(info)
        if not finished(info, state, now):
            console.print(f"skip     {info.run_dir}: {state} (only finished runs are cleaned)", markup=False)
            continue
        if args.run is None and now - ended_at(info) < age:
            continue
        found = items(info, args.keep_checkpoints, args.logs)
        if found:
            plan.append((info, state, found))
    total = sum(i.size for _, _, found in plan for i in found)
    for info, state, found in plan:
        console.print(f"{info.run_dir}  ({state})", markup=False)
        for item in found:
            console.print(
                f"  {human(item.size):>10}  {item.path.relative_to(info.run_dir)}  [{item.why}]", markup=False
            )
    if not plan:
        console.print("nothing to clean")
        return 0
    console.print(f"{'would free' if args.dry_run else 'frees'} {human(total)} in {len(plan)} run(s)")
    if args.dry_run:
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError("not deleting without confirmation: run it in a terminal or pass --yes")
        if input("delete these? [y/N] ").strip().lower() not in ("y", "yes"):
            console.print("nothing deleted")
            return 1
    freed = sum(delete(found) for _, _, found in plan)
    console.print(f"freed {human(freed)}")
    return 0
