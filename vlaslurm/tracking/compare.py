"""`vlaslurm compare RUN RUN [...]`: throughput beside equal sample efficiency.

Throughput alone says nothing: an asynchronous run that is faster per env step
but learns less per env step has not won. The table therefore reads every run
at the same sample count N (by default the fewest env steps any run reached):
success at N and the wall time to reach N, whose ratio to the first run's is
the speed-up. Plots (PNG, also logged to MLflow as a "comparison" run):
success vs env steps, success vs wall time, throughput over time, Δv histogram.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple

from vlaslurm.rundir import comparisons_dir, layout

if TYPE_CHECKING:  # pandas and MLflow load when the command runs, not when the CLI starts
    import pandas as pd

    from vlaslurm.tracking.data import RunData

PLOTS = ("success_vs_env_steps.png", "success_vs_wall.png", "throughput.png", "lag_hist.png")


def summarize(runs: List[RunData], samples: Optional[float] = None) -> Tuple[pd.DataFrame, float]:
    """One row per run; `samples` defaults to the fewest env steps any run reached."""
    import pandas as pd

    from vlaslurm.tracking.stats import at_samples, lag_stats, success_curve

    missing = [r.label for r in runs if not len(r.metrics)]
    if missing:
        raise ValueError(
            f"no metrics yet for {', '.join(missing)} ({layout.METRICS} is empty or MLflow has no history)"
        )
    samples = float(samples or min(r.metrics["env_steps"].iloc[-1] for r in runs))
    rows = []
    for run in runs:
        m = run.metrics
        curve = success_curve(m)
        env_steps, wall = float(m["env_steps"].iloc[-1]), float(m["wall_s"].iloc[-1])
        rows.append(
            {
                "run": run.label,
                "mode": run.mode,
                "env_steps": env_steps,
                "wall_s": wall,
                "throughput": env_steps / wall if wall > 0 else float("nan"),
                "time_at_samples": at_samples(m["env_steps"], m["wall_s"], samples),
                "success_at_samples": at_samples(curve.index, curve.to_numpy(), samples),
                "final_success": float(curve.iloc[-1]),
                **(lag_stats(run.ledger) if run.ledger is not None else {}),
                "mlflow_run_id": run.run_id,
            }
        )
    table = pd.DataFrame(rows)
    table["speedup"] = table["time_at_samples"].iloc[0] / table["time_at_samples"]
    table["throughput_ratio"] = table["throughput"] / table["throughput"].iloc[0]
    return table, samples


def render(table: pd.DataFrame, samples: float):
    """The rich table `compare` prints."""
    import math

    from rich import box
    from rich.table import Table

    n = f"{samples:,.0f}"
    out = Table(
        "run",
        "mode",
        "env\nsteps",
        "wall\ns",
        "steps\n/s",
        "s to\nN",
        "speed\n-up",
        "success\n@N",
        "final\nsuccess",
        "Δv mean\np50/p99/max",
        "dropped",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        title=f"equal samples: N = {n} env steps",
        caption_justify="left",
        caption="success@N and s to N read each run at N env steps; speed-up = first run's s to N / this run's",
    )
    out.columns[0].no_wrap = True

    def fmt(value, spec: str) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    for row in table.to_dict(orient="records"):
        lag = (
            f"{fmt(row.get('lag_mean'), '.2f')} {fmt(row.get('lag_p50'), '.0f')}/"
            f"{fmt(row.get('lag_p99'), '.1f')}/{fmt(row.get('lag_max'), '.0f')}"
        )
        out.add_row(
            row["run"],
            row["mode"],
            fmt(row["env_steps"], ",.0f"),
            fmt(row["wall_s"], ".1f"),
            fmt(row["throughput"], ",.0f"),
            fmt(row["time_at_samples"], ".1f"),
            fmt(row["speedup"], ".2f") + "x",
            fmt(row["success_at_samples"], ".2f"),
            fmt(row["final_success"], ".2f"),
            lag,
            fmt(row.get("dropped_frac", float("nan")) * 100, ".1f") + "%",
        )
    return out


def plot(runs: List[RunData], samples: float, out_dir: Path) -> List[Path]:
    """The four comparison plots as PNG files in `out_dir`."""
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        fig = Figure(figsize=(6.4, 4.0), tight_layout=True)
        ax = fig.subplots()
        for run in runs:
            _draw(name, ax, run)
        if name == "success_vs_env_steps.png":
            ax.axvline(samples, color="grey", linestyle=":", label=f"N = {samples:,.0f}")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.savefig(out_dir / name, dpi=100)
        paths.append(out_dir / name)
    return paths


def _draw(name: str, ax, run: RunData) -> None:
    import numpy as np

    from vlaslurm.tracking.stats import success_curve

    m, label = run.metrics, f"{run.label} ({run.mode})"
    curve = success_curve(m)
    if name == "success_vs_env_steps.png":
        ax.plot(curve.index, curve.to_numpy(), label=label)
        ax.set(xlabel="env steps", ylabel="success rate", title="success vs env steps (equal samples)")
    elif name == "success_vs_wall.png":
        ax.plot(m["wall_s"], curve.to_numpy(), label=label)
        ax.set(xlabel="wall time (s)", ylabel="success rate", title="success vs wall time")
    elif name == "throughput.png":
        ax.plot(m["wall_s"], m["charts/SPS"], label=label)
        ax.set(xlabel="wall time (s)", ylabel="env steps / s", title="throughput over time")
    elif run.ledger is not None:
        lags = run.ledger.loc[run.ledger["consumed_version"] >= 0, "lag"]
        bins = np.arange(-0.5, max(int(lags.max()) if len(lags) else 0, 1) + 1.5)
        ax.hist(lags, bins=bins, alpha=0.5, label=f"{label}: {int(run.ledger['dropped'].sum())} dropped")
        ax.set(
            xlabel="Δv = consumed version - behaviour version",
            ylabel="segments",
            title="version lag of consumed segments (used and dropped)",
        )
        ax.xaxis.get_major_locator().set_params(integer=True)


def log_comparison(client, runs: List[RunData], table: pd.DataFrame, samples: float, out_dir: Path) -> str:
    """A new MLflow run holding the plots and the table; returns its id."""
    from mlflow.entities import Param

    name = next((r.experiment for r in runs if r.experiment), None) or "vlaslurm"
    found = client.get_experiment_by_name(name)
    experiment = found.experiment_id if found else client.create_experiment(name)
    tags = {
        "vlaslurm.comparison": "true",
        "vlaslurm.compared_runs": ",".join(str(r.run_id) for r in runs),
        "vlaslurm.compared_labels": ",".join(r.label for r in runs),
    }
    run = client.create_run(experiment, tags=tags, run_name="compare: " + " vs ".join(r.mode for r in runs))
    client.log_batch(run.info.run_id, params=[Param("samples", str(int(samples)))])
    client.log_artifacts(run.info.run_id, str(out_dir))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def compare(
    refs: List[str],
    runs_root: Path,
    out_dir: Optional[Path] = None,
    uri: Optional[str] = None,
    samples: Optional[float] = None,
    log_to_mlflow: bool = True,
) -> dict:
    """Load, summarize, plot and (best effort) log; returns the table, N, the PNG paths and the MLflow run id."""
    from vlaslurm.tracking.data import client_for, load_run
    from vlaslurm.tracking.tracker import quiet_mlflow_client

    quiet_mlflow_client(10)
    client = client_for(refs, runs_root, uri) if log_to_mlflow or uri else None
    runs = [load_run(ref, runs_root, client) for ref in refs]
    table, samples = summarize(runs, samples)
    out_dir = out_dir or comparisons_dir(runs_root) / time.strftime("%Y%m%d-%H%M%S")
    paths = plot(runs, samples, out_dir)
    table.to_csv(out_dir / "comparison.csv", index=False)
    result = {
        "table": table,
        "samples": samples,
        "plots": paths,
        "out_dir": out_dir,
        "mlflow_run_id": None,
        "mlflow_error": None,
    }
    if client is not None and log_to_mlflow:
        try:
            result["mlflow_run_id"] = log_comparison(client, runs, table, samples, out_dir)
        except Exception as exc:  # the table and the PNGs stand on their own
            result["mlflow_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return result
