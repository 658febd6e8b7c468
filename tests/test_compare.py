"""`vlaslurm compare` on two real short runs (sync, async) that logged to the embedded SQLite
database of their runs root: the table, the PNGs, the comparison run in MLflow; and the
equal-sample arithmetic on hand-made curves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import pandas as pd
import pytest
import yaml

from vlaslurm.cli import main
from vlaslurm.rundir import list_runs
from vlaslurm.runtime.local import run_local
from vlaslurm.spec import load_spec
from vlaslurm.tracking import read_run_id
from vlaslurm.tracking.compare import PLOTS, summarize
from vlaslurm.tracking.data import RunData

SPEC = {
    "name": "cmp",
    "env": {"type": "synthetic", "num_envs": 8, "step_ms": {"dist": "constant", "mean": 5}, "episode_steps": 10},
    "model": {"type": "synthetic", "action_chunk": 2},
    "algo": {"type": "synthetic", "steps_per_update": 64, "update_ms": 10},
    "rollout": {"mode": "sync", "total_env_steps": 600, "max_staleness": 1},
    "runtime": {"first_meeting_timeout_s": 60, "timeout_s": 30},
}


def sync_async_runs(base: Path) -> Dict[str, Path]:
    """A sync and an async run (`cmp-sync`, `cmp-async`) under `base/runs`, tracked to `base/runs/mlflow.db`;
    made once per session."""
    done = {info.name: Path(info.run_dir) for info in list_runs(base / "runs")}
    if len(done) == 2 and all(read_run_id(d) and (d / "ledger.parquet").exists() for d in done.values()):
        return {"sync": done["cmp-sync"], "async": done["cmp-async"]}
    base.mkdir(parents=True, exist_ok=True)
    spec = base / "cmp.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    env = {"VLASLURM_TRACKING": "on"}  # the suite turns it off (conftest)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for mode in ("sync", "async"):
            loaded = load_spec(spec, [f"rollout.mode={mode}", f"name=cmp-{mode}"])
            rc = run_local(loaded, base / "runs", echo=False, timeout_s=180)  # <root>/cmp-<mode>/<stamp>
            run_dir = Path(list_runs(base / "runs")[-1].run_dir)
            assert rc == 0, (run_dir / "logs" / "trainer" / "0.log").read_text()[-3000:]
            assert read_run_id(run_dir), (run_dir / "logs" / "trainer" / "0.log").read_text()[-3000:]
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return sync_async_runs(base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Path]:
    return sync_async_runs(tmp_path_factory.getbasetemp() / "sync_async")


@pytest.mark.slow
def test_compare_prints_the_table_writes_pngs_and_logs_a_comparison_run(runs, tmp_path, capsys):
    root = runs["sync"].parent.parent
    out = tmp_path / "cmp out"
    assert (
        main(["--runs-root", str(root), "compare", str(runs["sync"]), read_run_id(runs["async"]), "--out", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "equal samples: N = " in text and "speed-up" in text and "success" in text, text
    assert "sync" in text and "async" in text and "1.00x" in text, text
    assert "logged to MLflow as run" in text, text
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    table = pd.read_csv(out / "comparison.csv")
    assert list(table["mode"]) == ["sync", "async"]
    assert table["speedup"].iloc[0] == 1.0 and (table["throughput"] > 0).all()
    assert (table["lag_max"] <= 1).all() and table.loc[0, "lag_max"] == 0  # sync is on-policy

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = text.split("logged to MLflow as run ")[1].split()[0]
    logged = client.get_run(run_id)
    assert logged.data.tags["vlaslurm.compared_runs"] == f"{read_run_id(runs['sync'])},{read_run_id(runs['async'])}"
    assert {a.path for a in client.list_artifacts(run_id)} >= set(PLOTS) | {"comparison.csv"}


@pytest.mark.slow
def test_compare_by_run_name_and_unknown_run(runs, tmp_path, capsys):
    root = runs["sync"].parent.parent
    assert (
        main(
            [
                "--runs-root",
                str(root),
                "compare",
                str(runs["sync"]),
                "cmp-async",
                "--no-mlflow",
                "--samples",
                "300",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "N = 300 env steps" in capsys.readouterr().out
    assert main(["--runs-root", str(root), "compare", str(runs["sync"]), "nosuchrun", "--no-mlflow"]) == 2
    assert "no run 'nosuchrun'" in capsys.readouterr().err


def curve(steps, wall, success, mode):
    metrics = pd.DataFrame(
        {
            "env_steps": steps,
            "wall_s": wall,
            "rollout/success_rate": success,
            "rollout/episodes": [4] * len(steps),
            "charts/SPS": [1.0] * len(steps),
        }
    )
    return RunData(label=mode, mode=mode, metrics=metrics, ledger=None)


def test_equal_samples_reads_every_run_at_the_same_env_steps():
    slow = curve([100, 200, 300, 400], [10, 20, 30, 40], [0.0, 0.0, 1.0, 1.0], "sync")
    fast = curve([100, 200, 300], [5, 10, 15], [0.0, 0.0, 0.0], "async")  # twice the throughput, learns nothing
    table, samples = summarize([slow, fast])
    assert samples == 300  # the fewest env steps any run reached
    assert table["time_at_samples"].tolist() == [30.0, 15.0]
    assert table["speedup"].tolist() == [1.0, 2.0]
    assert table["success_at_samples"].iloc[1] == 0.0 and table["success_at_samples"].iloc[0] > 0
    table, _ = summarize([slow, fast], samples=250)
    assert table["time_at_samples"].tolist() == [25.0, 12.5]


def test_per_task_success_counts_only_scored_episodes_and_reads_older_ledgers():
    from vlaslurm.tracking.stats import task_success_by_step

    ledger = pd.DataFrame(
        {
            "task": ["a", "a", "a", "a"],
            "steps": [10, 10, 10, 10],
            "t_end": [1.0, 2.0, 3.0, 4.0],
            "terminated": [True, True, True, False],
            "truncated": [False, False, False, True],
            "success": [False, True, True, False],
            "scored": [True, False, True, True],  # the second: a quick success begun inside a sync phase
        }
    )
    table = task_success_by_step(ledger, [40])
    assert table[["success_rate", "episodes"]].values.tolist() == [[1 / 3, 3]]
    older = task_success_by_step(ledger.drop(columns="scored"), [40])  # written before the column existed
    assert older[["success_rate", "episodes"]].values.tolist() == [[0.5, 4]]
