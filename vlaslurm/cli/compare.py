"""`vlaslurm compare` (runs at equal samples) and `vlaslurm track` (send a run's records to MLflow afterwards)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlaslurm.cli.common import UserError, add_command, console, resolve, runs_root
from vlaslurm.rundir import RunNotFound
from vlaslurm.tracking.compare import compare, render


def cmd_compare(args: argparse.Namespace) -> int:
    if len(args.runs) < 2:
        raise UserError("compare needs at least two runs (run directories, run names or MLflow run ids)")
    try:
        result = compare(
            args.runs,
            runs_root(args),
            Path(args.out) if args.out else None,
            args.tracking_uri,
            args.samples,
            log_to_mlflow=not args.no_mlflow,
        )
    except (RunNotFound, ValueError) as exc:
        raise UserError(str(exc)) from None
    console.print(render(result["table"], result["samples"]))
    console.print(f"plots: {result['out_dir']} ({', '.join(p.name for p in result['plots'])}, comparison.csv)")
    if result["mlflow_run_id"]:
        console.print(f"logged to MLflow as run {result['mlflow_run_id']}")
    elif result["mlflow_error"]:
        console.print(f"[yellow]not logged to MLflow:[/yellow] {result['mlflow_error']}")
    return 0


def cmd_track(args: argparse.Namespace) -> int:
    from vlaslurm.tracking.tracker import sync_run

    info = resolve(args)
    summary = sync_run(Path(info.run_dir), args.tracking_uri, args.timeout)
    console.print(
        f"MLflow run {summary['run_id']} at {summary['uri']}: {summary['sent_rows']} rows sent, "
        f"{summary['pending_rows']} rows and {summary['pending_tasks']} uploads not sent"
        + (f" ({summary['last_error']})" if summary["pending_rows"] or summary["pending_tasks"] else "")
    )
    return 0 if summary["run_id"] and not summary["pending_rows"] else 1


def register(sub) -> None:
    """Add `compare` (and `track`, which sends a run's records afterwards) to the `vlaslurm` command line."""
    text = "compare runs at equal samples: throughput, success, Δv; PNG plots logged to MLflow"
    p = add_command(sub, "compare", cmd_compare, text)
    p.add_argument("runs", nargs="+", help="run directories, run names, job ids or MLflow run ids (first = baseline)")
    p.add_argument(
        "--samples",
        type=float,
        help="env-step count N of the equal-sample columns (default: the fewest env steps any run reached)",
    )
    p.add_argument("--out", help="folder of the PNGs and comparison.csv (default: <runs-root>/comparisons/<stamp>)")
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: the first run's tracking.uri, else "
        "the SQLite database under the runs root)",
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log the comparison to MLflow")
    text = "send a run's metrics and artifacts to MLflow after the fact (tracking was off or the server away)"
    p = add_command(sub, "track", cmd_track, text)
    p.add_argument("run", help="run directory, run name or job id")
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: the run's tracking.uri, else the SQLite database under the runs root)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
