"""What a run logs as MLflow params and tags: the flattened resolved spec and the placement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from vlaslurm.rundir import RunDir, read_info, read_resolved_spec

MAX_VALUE = 500  # MLflow accepts longer values; long lists are unreadable in its UI anyway


def flatten(data: Any, prefix: str = "") -> Dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`; lists stay one value (JSON)."""
    if isinstance(data, dict):
        out: Dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    text = json.dumps(data) if isinstance(data, (list, tuple)) else "None" if data is None else str(data)
    return {prefix.rstrip("."): text[:MAX_VALUE]}


def spec_params(run_dir: Path) -> Dict[str, str]:
    """The resolved spec the run used (`RunDir.spec`), flattened."""
    return flatten(read_resolved_spec(run_dir))


def placement_params(run_dir: Path) -> Dict[str, str]:
    """Where the ranks ran: kind, job id, ranks per role and the nodes each role met on."""
    run_dir = Path(run_dir)
    out: Dict[str, str] = {}
    if RunDir(run_dir).holds_run():
        info = read_info(run_dir)
        out["placement.kind"] = str(info.kind)
        out["placement.job_id"] = str(info.job_id)
        for role, count in info.ranks.items():
            out[f"placement.ranks.{role}"] = str(count)
    nodes: Dict[str, set] = {}
    for path in RunDir(run_dir).rendezvous_root.glob("*/*.json"):
        try:
            member = json.loads(path.read_text())
            nodes.setdefault(member["role"], set()).add(member.get("node") or member.get("host"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for role, names in nodes.items():
        out[f"placement.nodes.{role}"] = ",".join(sorted(map(str, names)))[:MAX_VALUE]
    return out


def run_tags(run_dir: Path) -> Dict[str, str]:
    """Tags that let `compare` and the notebooks find the run directory of an MLflow run."""
    run_dir = Path(run_dir).resolve()
    info = read_info(run_dir) if RunDir(run_dir).holds_run() else None
    spec = spec_params(run_dir)
    tags = {
        "vlaslurm.run_dir": str(run_dir),
        "vlaslurm.name": info.name if info else run_dir.parent.name,
        "vlaslurm.kind": str(info.kind if info else None),
        "vlaslurm.mode": spec.get("rollout.mode", "?"),
        "mlflow.source.name": "vlaslurm",
    }
    if info is not None and info.job_id:
        tags["vlaslurm.job_id"] = str(info.job_id)
    if info is not None and info.sweep:  # runs submitted together by --seeds/--sweep (vlaslurm.slurm.sweep)
        tags["vlaslurm.sweep"] = str(info.sweep)
    return tags
