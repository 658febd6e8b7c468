"""`vlaslurm eval`: the frozen policy's success per task, failed trajectories kept per task."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from vlaslurm.rundir.layout import EVAL as EVAL_FILE
from vlaslurm.runtime.evaluate import evaluate
from vlaslurm.spec import load_spec


def spec_file(tmp_path: Path, success_prob: float, **model) -> Path:
    spec = {
        "name": "ev",
        "env": {
            "type": "synthetic",
            "tasks": ["a", "b"],
            "num_envs": 4,
            "success_prob": success_prob,
            "episode_steps": 3,
            "step_ms": {"dist": "constant", "mean": 0.1},
        },
        "model": {"type": "synthetic", "action_chunk": 2, "forward_ms": {"base": 0.0, "per_item": 0.0}, **model},
        "algo": {"type": "synthetic"},
    }
    path = tmp_path / "ev.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("prob, expected", [(1.0, 1.0), (0.0, 0.0)])
def test_success_per_task_and_failed_trajectories(tmp_path: Path, prob: float, expected: float) -> None:
    directory = evaluate(load_spec(spec_file(tmp_path, prob)), tmp_path / "runs", episodes=10, keep_failed=2)
    summary = json.loads((directory / EVAL_FILE).read_text())
    assert summary["episodes"] == 10
    assert summary["episodes_per_task"] == {"a": 5, "b": 5}  # tasks are assigned round-robin over instances
    assert summary["success"] == {"a": expected, "b": expected}
    failed = sorted(p.name for p in (directory / "failed").glob("*.npz")) if expected == 0.0 else []
    assert failed == (["a-0.npz", "a-1.npz", "b-0.npz", "b-1.npz"] if expected == 0.0 else [])


def tiny_checkpoint(folder: Path) -> None:
    """A tiny random-init openvla-oft (chunks of 2, 2-dim actions, 16 px), saved as a run's final_model/ is."""
    from vlaslurm.models import build_policy
    from vlaslurm.spec.model_types import OpenVLAOFTConfig

    policy = build_policy(
        OpenVLAOFTConfig(type="openvla-oft", action_chunk=2, action_dim=2),
        action_dim=2,
        state_dim=2,
        image_size=16,
        num_cameras=1,
    )
    policy.save_pretrained(str(folder))


def test_eval_loads_the_checkpoint_in_model_path(tmp_path: Path) -> None:
    tiny_checkpoint(tmp_path / "ckpt")
    spec = {
        "name": "ev",
        "env": {"type": "toy", "num_envs": 2, "obs": {"image_size": 16, "cameras": ["top"]}},
        "model": {"type": "openvla-oft", "action_chunk": 2, "action_dim": 2, "path": str(tmp_path / "ckpt")},
        "algo": {"type": "ppo"},
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec))
    directory = evaluate(load_spec(path), tmp_path / "runs", episodes=4)
    assert json.loads((directory / EVAL_FILE).read_text())["episodes"] == 4


def test_eval_plays_a_saved_pi0_folder_with_its_deterministic_actions(tmp_path: Path) -> None:
    """π0 evaluates like the other model types: `model.path` at a saved tiny π0 (transformers' PI0 layout) plays
    the actions of the policy that was saved (its deterministic ODE sampling), not of a fresh random init."""
    import numpy as np

    from vlaslurm.models.pi0.build import tiny_pi0
    from vlaslurm.models.pi0.flow import FlowSettings
    from vlaslurm.rundir.layout import RunDir
    from vlaslurm.runtime.evaluate import EvalConfig, play

    settings = FlowSettings(denoise_steps=2, noise_method="flow_sde")
    saved = tiny_pi0(2, 2, 2, settings, seed=3)
    saved.save_pretrained(tmp_path / "pi0")
    spec = {
        "name": "ev",
        "env": {"type": "toy", "num_envs": 2, "max_episode_steps": 6, "obs": {"image_size": 56, "cameras": ["top"]}},
        "model": {"type": "pi0", "action_chunk": 2, "denoise_steps": 2, "path": str(tmp_path / "pi0")},
        "algo": {"type": "ppo"},
    }
    (tmp_path / "pi0.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_spec(tmp_path / "pi0.yaml")
    directory = evaluate(loaded, tmp_path / "runs", episodes=2, keep_failed=2)
    assert json.loads((directory / EVAL_FILE).read_text())["episodes"] == 2

    def actions(directory: Path) -> np.ndarray:
        failed = sorted(RunDir(directory).failed.glob("*.npz"))
        assert failed, "a random tiny policy fails the toy task within 6 steps; its trajectory is kept"
        return np.load(failed[0])["actions"]

    def played_by(policy, name: str) -> np.ndarray:
        (tmp_path / name).mkdir()
        play(loaded.spec, tmp_path / name, EvalConfig(2, 2), lambda env: policy, str(loaded.path))
        return actions(tmp_path / name)

    assert np.array_equal(actions(directory), played_by(saved, "in-memory"))
    assert not np.array_equal(actions(directory), played_by(tiny_pi0(2, 2, 2, settings, seed=4), "other"))


def test_episodes_do_not_depend_on_the_split_over_simulator_ranks(tmp_path: Path) -> None:
    """Episode e runs on environment e % n from seed (seed, e): four environments in one process give the same
    outcomes as two ranks of two (how an eval job splits them), which is what lets a job equal --local."""
    from vlaslurm.envs import make_env
    from vlaslurm.models import build_policy
    from vlaslurm.runtime.evaluate import EvalConfig, Outcomes, local_act, run_episodes
    from vlaslurm.runtime.roles.simulator import env_dims

    spec = load_spec(spec_file(tmp_path, 0.5)).spec
    cfg = EvalConfig(episodes=10)

    def outcomes(ranks: int) -> dict:
        merged: dict = {}
        for rank in range(ranks):
            env = make_env(spec.env, num_envs=4 // ranks, rank=rank, seed=spec.rollout.seed)
            act = local_act(build_policy(spec.model, **env_dims(env, spec.env)), cfg, spec.rollout.seed)
            out = Outcomes(tmp_path / f"{ranks}-{rank}", cfg.keep_failed)
            (tmp_path / f"{ranks}-{rank}").mkdir()
            run_episodes(env, rank * env.num_envs, 4, cfg, spec.rollout.seed, act, out)
            for task, eps in out.to_json().items():
                merged.setdefault(task, {}).update(eps)
        return merged

    one = outcomes(1)
    assert one == outcomes(2)
    assert sorted(int(e) for eps in one.values() for e in eps) == list(range(10))
    assert {s for eps in one.values() for s in eps.values()} == {True, False}  # both kinds, so equality means something


def _failed_by_episode(directory: Path) -> dict:
    import numpy as np

    files = [np.load(p) for p in (directory / "failed").glob("*.npz")]
    return {int(f["episode"]): f["actions"] for f in files}


def tiny_checkpoint_spec(tmp_path: Path) -> Path:
    """A toy-env spec whose model.path is a saved tiny openvla-oft; 2 simulator ranks (one
    environment each) share 1 generator."""
    tiny_checkpoint(tmp_path / "ckpt")
    spec = {
        "name": "evjob",
        "env": {"type": "toy", "num_envs": 2, "max_episode_steps": 12, "obs": {"image_size": 16, "cameras": ["top"]}},
        "model": {"type": "openvla-oft", "action_chunk": 2, "action_dim": 2, "path": str(tmp_path / "ckpt")},
        "algo": {"type": "ppo"},
        "rollout": {"seed": 3},
        "resources": {
            "layout": "disaggregated",
            "simulator": {"nodes": 1, "tasks_per_node": 2, "cpus_per_task": 1},
            "generator": {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1},
            "trainer": {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1},
        },
        "slurm": {"partition": "cpu", "time": "00:10:00"},
    }
    path = tmp_path / "evjob.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slurm
@pytest.mark.slow
def test_eval_job_on_the_cluster_equals_local(local_slurm, tmp_path: Path) -> None:
    """`vlaslurm eval` as a real job (simulator and generator steps, no trainer): the per-task table, each
    episode's outcome and the failed trajectories' actions equal `--local` for the same seed and checkpoint."""
    import numpy as np
    from conftest import vlaslurm

    from vlaslurm.rundir import exit_records as exit_record
    from vlaslurm.rundir import read_info

    spec, root = tiny_checkpoint_spec(tmp_path), tmp_path / "runs"
    proc = vlaslurm(
        "eval",
        str(spec),
        "--episodes",
        "5",
        "--keep-failed",
        "2",
        "--wait",
        "--site",
        "local",
        runs_root=root,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.search(r"submitted eval job (\d+)", proc.stdout).group(1)
    job_dir = Path(next(p for p in (root / "evjob-eval").iterdir() if p.name.endswith(f"-{job_id}")))
    assert read_info(job_dir).ranks == {"simulator": 2, "generator": 1}
    assert sorted(r["step"] for r in exit_record(job_dir)) == ["generator", "job", "simulator"]
    assert not (job_dir / "logs" / "trainer").exists()
    job = json.loads((job_dir / EVAL_FILE).read_text())
    assert job["episodes"] == 5 and job["episodes_per_task"] == {"reach": 5}
    assert re.search(r"reach\s+│?\s*5", proc.stdout), proc.stdout  # --wait printed the table

    local = tmp_path / "local"
    assert (
        vlaslurm(
            "eval",
            str(spec),
            "--episodes",
            "5",
            "--keep-failed",
            "2",
            "--local",
            "--site",
            "local",
            runs_root=local,
            timeout=600,
        ).returncode
        == 0
    )
    local_dir = next((local / "evjob-eval").iterdir())
    expected = json.loads((local_dir / EVAL_FILE).read_text())
    assert {k: job[k] for k in ("success", "episodes_per_task", "outcomes")} == {
        k: expected[k] for k in ("success", "episodes_per_task", "outcomes")
    }
    failed = {name: _failed_by_episode(d) for name, d in (("job", job_dir), ("local", local_dir))}
    both = sorted(set(failed["job"]) & set(failed["local"]))
    assert both  # each keeps 2 per task (the job: per simulator rank), so some episodes are kept by both
    for episode in both:  # the frozen checkpoint acted the same, action for action
        np.testing.assert_allclose(failed["job"][episode], failed["local"][episode], rtol=0, atol=1e-6)

    shown = vlaslurm("eval", "--show", job_id, runs_root=root)
    assert shown.returncode == 0 and str(job_dir) in shown.stdout, shown.stderr


def test_cli_eval_local_then_show_and_bad_episode_counts(tmp_path: Path, capsys) -> None:
    from vlaslurm.cli import USER_ERROR, main

    spec = str(spec_file(tmp_path, 1.0))
    assert main(["--runs-root", str(tmp_path / "runs"), "eval", spec, "--episodes", "4", "--local"]) == 0
    directory = next((tmp_path / "runs" / "ev-eval").iterdir())
    capsys.readouterr()
    assert main(["eval", "--show", str(directory)]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"\ba\W+2\W+1\.00\b", shown) and re.search(r"\bb\W+2\W+1\.00\b", shown), shown
    assert main(["eval", spec, "--episodes", "0", "--local"]) == USER_ERROR
    assert "--episodes >= 1" in capsys.readouterr().err
    # One episode for two tasks: task b would never be played, so nothing runs and nothing is written.
    runs = len(list((tmp_path / "runs" / "ev-eval").iterdir()))
    assert main(["--runs-root", str(tmp_path / "runs"), "eval", spec, "--episodes", "1", "--local"]) == USER_ERROR
    assert "--episodes 1 is fewer than the spec's 2 tasks (env.tasks)" in capsys.readouterr().err
    assert len(list((tmp_path / "runs" / "ev-eval").iterdir())) == runs


def test_evaluation_while_training_runs_beside_the_rollouts(tmp_path: Path) -> None:
    """eval.every_versions: trainer rank 0 hands the weights of every third version to a process beside it; each
    evaluation that ran left its line (the same 4 episodes, both tasks) and eval.json, and its weights were removed.
    One still running when the next is due makes that one skipped, so at least the first one runs."""
    from runtime_helpers import run_spec, synthetic_spec

    from vlaslurm.rundir import RunDir

    spec = synthetic_spec("async", total_env_steps=960, steps_per_update=64, max_staleness=1000, stale_policy="drop")
    spec["env"].update(tasks=["a", "b"], success_prob=0.5)
    spec["eval"] = {"every_versions": 3, "episodes": 4, "keep_failed": 1}
    run = run_spec(tmp_path, spec)
    assert run.rc == 0, run.log("trainer", 0)[-2000:]
    layout = RunDir(run.run_dir)
    lines = [json.loads(line) for line in layout.evals_log.read_text().splitlines()]
    versions = [line["version"] for line in lines]
    assert versions and versions == sorted(set(versions)) and all(v % 3 == 0 for v in versions), versions
    for line in lines:
        assert line["episodes"] == 4 and 0.0 <= line["success_rate"] <= 1.0 and line["env_steps"] >= 64 * 3
        assert {"success/a", "success/b"} <= set(line)
        summary = json.loads(RunDir(layout.periodic_eval(line["version"])).eval.read_text())
        assert summary["episodes_per_task"] == {"a": 2, "b": 2}
        assert not layout.periodic_eval_weights(line["version"]).exists()
