"""A run's curves and ledger, from its run directory or from MLflow.

`load_run` accepts what users type: a run directory, a run name or job id
(through the runs index), or an MLflow run id. A run directory is read directly
(metrics and ledger, `rundir.RunDir`); an MLflow run without a reachable run
directory is read through MLflow (metric history, the ledger artifact).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pandas as pd

from vlaslurm.rundir import RunDir, RunNotFound, layout, read_ledger, read_metrics, read_resolved_spec, resolve_run
from vlaslurm.tracking.tracker import default_uri, read_run_id, tracking_uri

CURVE_KEYS = (
    "env_steps",
    "wall_s",
    "version",
    "charts/SPS",
    "rollout/success_rate",
    "rollout/episodes",
    "staleness/mean",
    "staleness/dropped_segments",
)


@dataclass
class RunData:
    """What `compare` and the notebooks need of one run."""

    label: str  # <name>/<stamp>
    mode: str  # rollout.mode
    metrics: pd.DataFrame  # one row per update, sorted by env_steps
    ledger: Optional[pd.DataFrame]
    run_dir: Optional[Path] = None
    run_id: Optional[str] = None  # MLflow
    experiment: Optional[str] = None  # the spec's tracking.experiment
    spec_uri: Optional[str] = None  # the spec's tracking.uri


def metrics_from_dir(run_dir: Path) -> pd.DataFrame:
    """The trainer's metric lines as a table (torn lines skipped)."""
    rows = read_metrics(run_dir)
    return _sorted(_with_curve_keys(pd.DataFrame(rows)))


def metrics_from_mlflow(client, run_id: str, keys=CURVE_KEYS) -> pd.DataFrame:
    """MLflow's metric histories of a run as one table, one row per update.

    The step (env steps) can repeat: an async trainer may update twice without receiving
    anything between. The values of one update share their timestamp, which tells them apart.
    """
    frames = []
    for key in keys:
        history = client.get_metric_history(run_id, key)
        if history:
            frames.append(
                pd.DataFrame(
                    {
                        "step": [m.step for m in history],
                        "timestamp": [m.timestamp for m in history],
                        key: [m.value for m in history],
                    }
                )
                .drop_duplicates(["step", "timestamp"], keep="last")
                .set_index(["step", "timestamp"])
            )
    if not frames:
        return _with_curve_keys(pd.DataFrame())
    table = pd.concat(frames, axis=1).reset_index().sort_values(["step", "timestamp"])
    table["env_steps"] = table["step"]
    return _with_curve_keys(table.drop(columns=["step", "timestamp"]).reset_index(drop=True))


def _with_curve_keys(frame: pd.DataFrame) -> pd.DataFrame:
    """Every curve column present: NaN where a run never had a value (MLflow keeps no NaN, so a run
    whose updates all saw no finished episode has no `rollout/success_rate` there at all)."""
    for key in CURVE_KEYS:
        if key not in frame:
            frame[key] = float("nan")
    return frame


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("env_steps", kind="stable").reset_index(drop=True)


def load_run(ref: str, runs_root: Path, client=None) -> RunData:
    """One run named by directory, name, job id or MLflow run id; RunNotFound if nothing matches."""
    try:
        info = resolve_run(Path(runs_root), ref)
    except RunNotFound as exc:
        if client is None:
            raise
        return _from_mlflow(ref, client, exc)
    return from_run_dir(Path(info.run_dir))


def from_run_dir(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    spec = read_resolved_spec(run_dir)
    tracking = spec.get("tracking") or {}
    return RunData(
        label=f"{run_dir.parent.name}/{run_dir.name}",
        mode=str((spec.get("rollout") or {}).get("mode")),
        metrics=metrics_from_dir(run_dir),
        ledger=read_ledger(run_dir) if RunDir(run_dir).ledger.exists() else None,
        run_dir=run_dir,
        run_id=read_run_id(run_dir),
        experiment=tracking.get("experiment"),
        spec_uri=tracking.get("uri"),
    )


def _from_mlflow(ref: str, client, not_found: RunNotFound) -> RunData:
    run = _find_mlflow_run(ref, client)
    if run is None:
        raise RunNotFound(f"{not_found} (and no MLflow run with id or name {ref!r} at {client.tracking_uri})")
    tags = run.data.tags
    run_dir = Path(tags.get("vlaslurm.run_dir", "/nonexistent"))
    if RunDir(run_dir).metrics.exists():
        data = from_run_dir(run_dir)
        data.run_id = run.info.run_id
        return data
    experiment = client.get_experiment(run.info.experiment_id).name
    return RunData(
        label=tags.get("mlflow.runName", run.info.run_id),
        mode=tags.get("vlaslurm.mode", "?"),
        metrics=metrics_from_mlflow(client, run.info.run_id),
        ledger=ledger_from_mlflow(client, run.info.run_id),
        run_id=run.info.run_id,
        experiment=experiment,
    )


def _find_mlflow_run(ref: str, client):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    experiments = [e.experiment_id for e in client.search_experiments()]
    quoted = ref.replace("'", "\\'")
    found = (
        client.search_runs(
            experiments, f"attributes.run_name = '{quoted}'", max_results=1, order_by=["attributes.start_time DESC"]
        )
        if experiments
        else []
    )
    return found[0] if found else None


def ledger_from_mlflow(client, run_id: str) -> Optional[pd.DataFrame]:
    """The ledger artifact of an MLflow run (None if it has none)."""
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, layout.LEDGER, tmp)
        except (MlflowException, OSError):
            return None
        return pd.read_parquet(path)


def client_for(runs: List[str], runs_root: Path, uri: Optional[str] = None):
    """An MLflow client: `uri`, else the first run's `tracking.uri`, else the SQLite database of the runs root."""
    from mlflow.tracking import MlflowClient

    for ref in runs if uri is None else ():
        try:
            run_dir = Path(resolve_run(Path(runs_root), ref).run_dir)
        except (RunNotFound, OSError):
            continue
        uri = tracking_uri(from_run_dir(run_dir).spec_uri, run_dir)
        break
    return MlflowClient(tracking_uri=uri or default_uri(runs_root))
