"""Seeds and sweeps: one hetjob per combination under one sweep name (parsing here; real jobs on the
local Slurm cluster, with the local site profile supplying partition, time and the h100 constraint)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import List, Tuple

import pytest
import yaml
from conftest import vlaslurm
from slurm_helpers import Job, wait_done

from vlaslurm.rundir import list_runs
from vlaslurm.slurm.submit import job_states
from vlaslurm.slurm.sweep import combinations, parse_seeds, parse_sweep
from vlaslurm.spec import SpecError

# Portable: no partition, time or constraint; --site local adds them. One node: the roles share it.
SPEC = """\
name: sweep-probe
env: {type: synthetic, num_envs: 4}
model: {type: synthetic}
algo: {type: synthetic}
rollout: {mode: async, total_env_steps: 100}
resources:
  simulator: {gpus_per_node: 1, group: one, gpu_type: h100}
  generator: {gpus_per_node: 1, group: one, gpu_type: h100}
  trainer:   {gpus_per_node: 1, group: one, gpu_type: h100}
"""
DEADLINE_S = 120.0


def test_parse_seeds_and_sweeps() -> None:
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("0-2,10") == [0, 1, 2, 10]
    for bad in ("", "a", "3-1", "1,1"):
        with pytest.raises(SpecError, match="--seeds"):
            parse_seeds(bad)
    assert parse_sweep("algo.lr=1e-4,3e-4") == ("algo.lr", ["1e-4", "3e-4"])
    assert parse_sweep("env.tasks=[a,b],[c]") == ("env.tasks", ["[a,b]", "[c]"])
    for bad in ("algo.lr", "=1,2", "algo.lr=1,,2", "algo.lr=1,1"):
        with pytest.raises(SpecError, match="--sweep"):
            parse_sweep(bad)


def test_combinations_are_the_cartesian_product() -> None:
    combos = combinations([0, 1], [("algo.lr", ["1", "2"]), ("rollout.mode", ["sync", "async"])])
    assert len(combos) == 8 and len({tuple(c) for c in combos}) == 8
    assert combos[0] == ["algo.lr=1", "rollout.mode=sync", "rollout.seed=0"]
    with pytest.raises(SpecError, match="same key"):
        combinations([0], [("rollout.seed", ["1"])])
    with pytest.raises(SpecError, match="twice"):
        combinations(None, [("algo.lr", ["1"]), ("algo.lr", ["2"])])


def test_a_bad_value_submits_nothing(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    proc = vlaslurm(
        "submit",
        str(spec),
        "--site",
        "local",
        "--seeds",
        "0,1",
        "--sweep",
        "rollout.mode=async,fast",
        runs_root=tmp_path / "runs",
    )
    assert proc.returncode == 2 and "rollout.mode: must be one of" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def _wait(predicate, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.5)


def submit_sweep(tmp_path: Path, *args: str) -> Tuple[Path, List[str], str]:
    """`vlaslurm submit` of SPEC with `args` on the local site; (runs root, job ids, stdout)."""
    spec = tmp_path / "sweep-probe.yaml"
    spec.write_text(SPEC)
    root = tmp_path / "runs"
    proc = vlaslurm("submit", str(spec), *args, "--site", "local", "--probe", runs_root=root)
    assert proc.returncode == 0, proc.stderr
    return root, re.findall(r"submitted job (\d+)", proc.stdout), proc.stdout


@pytest.mark.slurm
@pytest.mark.slow
def test_three_seed_sweep_runs_on_the_local_cluster(local_slurm, tmp_path: Path) -> None:
    root, job_ids, out = submit_sweep(tmp_path, "--seeds", "0,1,2", "--sweep-name", "probe-seeds")
    assert len(job_ids) == 3 and "sweep probe-seeds: 3 jobs" in out
    entries = [r for r in list_runs(root) if r.sweep == "probe-seeds"]
    assert sorted(r.job_id for r in entries) == sorted(job_ids)
    run_dirs = [Path(r.run_dir) for r in entries]
    seeds = sorted(yaml.safe_load((d / "spec.yaml").read_text())["rollout"]["seed"] for d in run_dirs)
    assert seeds == [0, 1, 2]
    for d in run_dirs:  # the site's values reached the job
        script = (d / "job.sbatch").read_text()
        assert "#SBATCH --partition=gpu" in script and "#SBATCH --constraint=h100" in script
        assert "#SBATCH --time=00:10:00" in script and (d / "site.yaml").exists()
        assert json.loads((d / "run.json").read_text())["sweep"] == "probe-seeds"

    end = time.monotonic() + DEADLINE_S  # one deadline for the three jobs together
    outcomes = [wait_done(Job(r.job_id, Path(r.run_dir)), max(0.0, end - time.monotonic())) for r in entries]
    assert outcomes == [0, 0, 0], [sorted((d / "logs").rglob("*.log")) for d in run_dirs]
    status = vlaslurm("status", "probe-seeds", runs_root=root)
    assert status.returncode == 0 and status.stdout.count("state    COMPLETED") == 3
    runs = vlaslurm("runs", "--sweep", "probe-seeds", "--state", "completed", runs_root=root)
    assert runs.returncode == 0 and all(j in runs.stdout for j in job_ids)


@pytest.mark.slurm
@pytest.mark.slow
def test_cancel_takes_a_sweep_name(local_slurm, tmp_path: Path) -> None:
    # long jobs: the generator never comes and the others would wait 300 s
    root, job_ids, _ = submit_sweep(
        tmp_path,
        "runtime.first_meeting_timeout_s=300",
        "--seeds",
        "0-1",
        "--sweep-name",
        "to-cancel",
        "--absent",
        "generator",
    )
    _wait(lambda: all("RUNNING" in set(job_states(j).values()) for j in job_ids), "both jobs to start")
    cancel = vlaslurm("cancel", "to-cancel", runs_root=root)
    assert cancel.returncode == 0 and all(f"cancelled job {j}" in cancel.stdout for j in job_ids)
    _wait(
        lambda: not any(set(job_states(j).values()) & {"RUNNING", "PENDING", "COMPLETING"} for j in job_ids),
        "the cancelled jobs to end",
        60,
    )
    status = vlaslurm("status", "to-cancel", runs_root=root)
    assert status.stdout.count("CANCELLED") == 2
