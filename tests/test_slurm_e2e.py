"""Real hetjobs on the local Slurm cluster, submitted with the `vlaslurm` command line.

The jobs are submitted once per module and run side by side (the cluster has 4 nodes); every
wait has a deadline. The runs root has spaces, `$(...)`, backticks, `;`, a quote and `%` in it,
so these jobs also prove the script's quoting on real sbatch/srun. Every job and `plan --test-only`
goes through the local cluster's site profile (vlaslurm/sites/local.yaml), as a user's would.
"""

from __future__ import annotations

import json
import re
import time
from itertools import combinations
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import REPO, vlaslurm
from slurm_helpers import DEADLINE_S, Job, submit, wait_done

from vlaslurm.rundir import exit_records as exit_record
from vlaslurm.rundir import read_info
from vlaslurm.slurm.submit import job_states
from vlaslurm.spec import load_spec
from vlaslurm.spec.plan import build_plan

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SPECS = REPO / "tests" / "specs"
EXPERIMENTS = sorted((REPO / "experiments").glob("*.yaml"))


@pytest.fixture(scope="module")
def runs_root(local_slurm, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("e2e")
    return base / f"runs $(touch {base}/PWNED1) `touch {base}/PWNED2`; 'q' 50%j"


@pytest.fixture(scope="module")
def jobs(runs_root: Path) -> Dict[str, Job]:
    """Submitted together: probe-3c (3 nodes) and probe-hybrid (2 nodes) start as nodes free up."""
    return {
        "3c": submit(runs_root, str(SPECS / "probe-3c.yaml"), "--probe"),
        "hybrid": submit(runs_root, str(SPECS / "probe-hybrid.yaml"), "--probe"),
        "absent": submit(
            runs_root,
            str(SPECS / "probe-3c.yaml"),
            "runtime.first_meeting_timeout_s=15",
            "--probe",
            "--absent",
            "generator",
        ),
    }


def probe_records(job: Job) -> List[dict]:
    return [json.loads(p.read_text()) for p in sorted((job.run_dir / "probe").glob("*.json"))]


def check_probe_job(job: Job) -> List[dict]:
    """Exit record says success, every expected rank reported the right sum; returns the records."""
    assert wait_done(job) == 0, (job.run_dir / "logs").glob("*/*.log")
    records = exit_record(job.run_dir)
    steps = {r["step"]: r["exit_code"] for r in records}
    assert steps == {"simulator": 0, "generator": 0, "trainer": 0, "job": 0}
    ranks = read_info(job.run_dir).ranks
    probes = probe_records(job)
    assert sorted((p["role"], p["rank"]) for p in probes) == sorted(
        (role, rank) for role, n in ranks.items() for rank in range(n)
    )
    world = sum(ranks.values())
    assert all(p["sum"] == p["expected"] == world * (world + 1) / 2 for p in probes)
    for role, n in ranks.items():  # the worker wrote each rank's log under its real rank
        logs = sorted(p.name for p in (job.run_dir / "logs" / role).glob("[0-9]*.log"))
        assert logs == [f"{r}.log" for r in range(n)]
    return probes


def gpus_by_node(probes: List[dict], overlap: bool, plan) -> Dict[str, List[tuple]]:
    by_node: Dict[str, List[tuple]] = {}
    for p in probes:
        if plan.step(p["role"]).overlap == overlap:
            by_node.setdefault(p["node"], []).append((p["role"], set((p["cuda_visible_devices"] or "").split(","))))
    return by_node


def test_probe_meets_across_three_components_with_a_shared_node(jobs: Dict[str, Job], runs_root: Path) -> None:
    job = jobs["3c"]
    probes = check_probe_job(job)
    plan = build_plan(load_spec(SPECS / "probe-3c.yaml"))
    assert len(plan.components) >= 3 and any(len(c.roles) == 2 for c in plan.components)
    by_node = gpus_by_node(probes, overlap=False, plan=plan)
    shared = [node for node, held in by_node.items() if {r for r, _ in held} == {"simulator", "generator"}]
    assert shared, f"no node ran simulator and generator side by side: {by_node}"
    for node, held in by_node.items():  # steps that do not overlap on purpose never share a GPU
        for (role_a, gpus_a), (role_b, gpus_b) in combinations(held, 2):
            assert role_a == role_b or not gpus_a & gpus_b, f"{node}: {role_a} {gpus_a} and {role_b} {gpus_b}"
    assert {len(g) for r, g in by_node[shared[0]]} == {6, 2}
    assert not [p for p in Path(str(runs_root)).parent.rglob("PWNED*") if p.name in ("PWNED1", "PWNED2")]


def test_hybrid_trainer_overlaps_on_purpose(jobs: Dict[str, Job]) -> None:
    job = jobs["hybrid"]
    probes = check_probe_job(job)
    plan = build_plan(load_spec(SPECS / "probe-hybrid.yaml"))
    exclusive = gpus_by_node(probes, overlap=False, plan=plan)
    trainer = gpus_by_node(probes, overlap=True, plan=plan)
    for node, held in exclusive.items():
        used = set().union(*(g for _, g in held))
        seen = set().union(*(g for _, g in trainer[node]))
        assert used <= seen, f"the overlapping trainer on {node} sees {seen}, not all of {used}"
    assert sum(1 for p in probes if p["role"] == "trainer") == sum(c.gpus_per_node for c in plan.components)


def test_missing_role_fails_the_job_and_is_named(jobs: Dict[str, Job], runs_root: Path) -> None:
    job = jobs["absent"]
    code = wait_done(job)
    assert code != 0
    steps = {r["step"]: r for r in exit_record(job.run_dir)}
    assert steps["generator"]["exit_code"] == 0  # it left without meeting, as told
    assert steps["trainer"]["exit_code"] != 0 or steps["simulator"]["exit_code"] != 0
    failed_after = max(r["end"] - r["start"] for name, r in steps.items() if name != "job")
    assert failed_after < 60, "the others must give up at runtime.first_meeting_timeout_s (15 s), not hang"
    # whichever rank's deadline fires first names the missing role; the batch script then stops the rest
    logs = vlaslurm("logs", job.job_id, runs_root=runs_root)
    assert logs.returncode == 0 and "missing generator[0]" in logs.stdout
    status = vlaslurm("status", job.job_id, runs_root=runs_root)
    assert "FAILED" in status.stdout


@pytest.mark.parametrize("spec", EXPERIMENTS, ids=lambda p: p.stem)
def test_sbatch_test_only_accepts_every_experiment(local_slurm, spec: Path, tmp_path: Path) -> None:
    proc = vlaslurm("plan", str(spec), "--test-only", "--site", "local", runs_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"Job \d+ to start at", proc.stdout + proc.stderr)
    assert "site local" in proc.stdout and "fits    every component fits the site's node shapes" in proc.stdout
    assert not (tmp_path / "index.jsonl").exists()  # nothing submitted, nothing written


def test_fit_check_says_a_hetjob_needs_its_own_nodes(local_slurm, tmp_path: Path) -> None:
    proc = vlaslurm("submit", str(SPECS / "too-big.yaml"), "--probe", runs_root=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert re.search(r"too-big\.yaml:\d+: resources\.(simulator|generator|trainer):", message)
    assert "its own" in message and "5 nodes" in message
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), "a refused job must leave no run directory"


def test_cli_runs_status_logs_cancel(jobs: Dict[str, Job], runs_root: Path) -> None:
    # a long job: the generator never comes and the others would wait 300 s
    long = submit(
        runs_root,
        str(SPECS / "probe-hybrid.yaml"),
        "resources.simulator.group=node0",
        "resources.generator.group=node0",
        "runtime.first_meeting_timeout_s=300",
        "--probe",
        "--absent",
        "generator",
    )
    end = time.monotonic() + DEADLINE_S
    while "RUNNING" not in set(job_states(long.job_id).values()):
        assert time.monotonic() < end, f"job {long.job_id} never started"
        time.sleep(0.5)
    for ref in (long.job_id, str(long.run_dir), "probe-hybrid"):  # RUN by job id, directory or name (newest)
        status = vlaslurm("status", ref, runs_root=runs_root)
        assert status.returncode == 0 and str(long.run_dir) in status.stdout and "RUNNING" in status.stdout, ref
    runs = vlaslurm("runs", runs_root=runs_root)
    assert runs.returncode == 0 and all(j.job_id in runs.stdout for j in (*jobs.values(), long))
    end = time.monotonic() + 30
    while not (long.run_dir / "logs" / "trainer" / "0.log").exists():
        assert time.monotonic() < end, "trainer[0] wrote no log"
        time.sleep(0.5)
    logs = vlaslurm("logs", "probe-hybrid", "--role", "trainer", runs_root=runs_root)
    assert logs.returncode == 0 and "logs/trainer/0.log" in logs.stdout
    cancel = vlaslurm("cancel", str(long.run_dir), runs_root=runs_root)
    assert cancel.returncode == 0 and long.job_id in cancel.stdout
    end = time.monotonic() + 60
    while set(job_states(long.job_id).values()) & {"RUNNING", "PENDING", "COMPLETING"}:
        assert time.monotonic() < end, "cancelled job still running"
        time.sleep(0.5)
    assert "CANCELLED" in vlaslurm("status", long.job_id, runs_root=runs_root).stdout
    missing = vlaslurm("status", "no-such-run", runs_root=runs_root)
    assert missing.returncode == 2 and "no run 'no-such-run'" in missing.stderr


def test_a_job_slurm_has_forgotten_has_no_states(local_slurm) -> None:
    """Past MinJobAge slurmctld forgets a job and `squeue -j` fails ("Invalid job id specified"), as for an id it
    never knew: no states, not an error (an experiment test failed on it after waiting out another job)."""
    assert job_states("987654") == {}
