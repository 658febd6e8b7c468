"""The RoboTwin adapter against a STAND-IN, not RoboTwin.

RoboTwin 2.0 is a checkout plus hub-downloaded assets, so it cannot run here. `robotwin_standin/root`
mimics the part of its API the adapter uses; `test_standin_matches_the_pinned_robotwin_api` keeps its
signatures equal to those extracted from RoboTwin at `robotwin_standin/PINNED_COMMIT`
(`SIGNATURES.txt`). What these tests show is that the adapter drives that API the way RoboTwin's own
evaluation does (config assembly, unstable seeds skipped, expert check, instructions, take_action,
eval_success, step_lim, close_env); they do not show RoboTwin's physics or rendering.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from vlaslurm.envs import make_env
from vlaslurm.envs.robotwin import RoboTwinInstance, episode_args, root_problems
from vlaslurm.spec.env_types import ObsConfig, RoboTwinEnvConfig

STANDIN = Path(__file__).parent / "robotwin_standin"
ROOT = STANDIN / "root"


def config(**fields) -> RoboTwinEnvConfig:
    fields.setdefault("obs", ObsConfig(image_size=16, cameras=["head", "left_wrist"], state=True))
    return RoboTwinEnvConfig(type="robotwin", root=str(ROOT), **fields)


def test_standin_matches_the_pinned_robotwin_api():
    sys.path.insert(0, str(STANDIN))
    try:
        from extract_signatures import extract, from_dir
    finally:
        sys.path.remove(str(STANDIN))
    pinned = (STANDIN / "SIGNATURES.txt").read_text().splitlines()
    assert (STANDIN / "PINNED_COMMIT").read_text().strip() == "c3ddfa8b97d5519efa828b075999bd0006778e5e"
    assert extract(from_dir(ROOT)) == pinned


def test_episode_args_are_assembled_like_robotwins_eval():
    args = episode_args(str(ROOT), "beat_block_hammer", "demo_randomized", want_rgb=True)
    assert args["task_name"] == "beat_block_hammer" and args["eval_mode"] is True
    assert (args["head_camera_h"], args["head_camera_w"]) == (240, 320)  # D435 from _camera_config.yml
    assert args["left_robot_file"] == args["right_robot_file"] == "./assets/embodiments/aloha-agilex/"
    assert args["dual_arm_embodied"] is True
    assert len(args["left_embodiment_config"]["arm_joints_name"][0]) == 6
    assert args["data_type"]["rgb"] and args["data_type"]["qpos"]


def test_reset_step_success_and_partial_reset():
    env = make_env(config(tasks=["beat_block_hammer", "lift_pot"]), num_envs=2, rank=0, seed=0)
    try:
        assert (env.action_dim, env.state_dim, env.thread_safe) == (14, 14, True)
        assert env.tasks == ["beat_block_hammer", "lift_pot"]
        obs = env.reset([0, 1], seeds=[3, 5])
        # seed 3 is unstable in the stand-in (UnStableError), so RoboTwin's rule moves on to 4;
        # lift_pot's expert fails on odd seeds, so 5 -> 6.
        assert env.seeds_used == [4, 6]
        assert obs.images.shape == (2, 2, 16, 16, 3) and obs.state.shape == (2, 14)
        assert obs.instructions[0] in (
            "Pick the hammer and strike the block.",
            "Lift the hammer using the left arm to hit the block.",
        )
        assert obs.instructions[1] in ("Lift the kitchenpot with both arms.", "Raise the pot using both arms.")
        hold = np.zeros((2, 14), np.float32)
        for _ in range(3):
            result = env.step([0, 1], hold)
            assert not result.success.any()
        swing = hold.copy()
        swing[0, 0] = 0.6  # the stand-in's beat_block_hammer succeeds past 0.5 on the first joint
        result = env.step([0, 1], swing)
        assert result.success.tolist() == [True, False] and result.terminated.tolist() == [True, False]
        assert result.reward.tolist() == [1.0, 0.0]
        again = env.reset([0], seeds=[12])  # partial reset of the finished one
        assert env.seeds_used == [12, 6] and len(again) == 1
        result = env.step([1], hold[:1])
        assert not result.truncated[0]
    finally:
        env.close()


def test_robotwin_step_limit_truncates():
    env = make_env(
        config(tasks=["lift_pot"], obs=ObsConfig(image_size=0, cameras=[], state=True)), num_envs=1, rank=0, seed=0
    )
    try:
        env.reset([0], seeds=[0])
        for _ in range(12):  # _eval_step_limit.yml: lift_pot 12
            result = env.step([0], np.zeros((1, 14), np.float32))
        assert bool(result.truncated[0]) and not bool(result.terminated[0])
        assert result.obs.images is None
    finally:
        env.close()


def test_instances_step_from_threads():
    env = make_env(config(tasks=["beat_block_hammer"]), num_envs=3, rank=1, seed=0)
    try:
        env.reset([0, 1, 2], seeds=[0, 1, 2])
        errors = []

        def run(i):
            try:
                for _ in range(5):
                    env.step([i], np.zeros((1, 14), np.float32))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    finally:
        env.close()


def test_protocol_calls_close_env_between_episodes(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    inst = RoboTwinInstance(str(ROOT), "beat_block_hammer", config(expert_check=True), [], 0, True, 0)
    from envs._base_task import CALLS

    CALLS.clear()
    inst.reset(0)
    inst.reset(1)
    inst.close()
    kinds = [c[0] for c in CALLS]
    # expert setup, close, episode setup; then the same again after closing the live episode; close
    assert kinds == [
        "setup_demo",
        "close_env",
        "setup_demo",
        "close_env",
        "setup_demo",
        "close_env",
        "setup_demo",
        "close_env",
    ]
    assert all(c[1]["is_test"] and c[1]["eval_mode"] for c in CALLS if c[0] == "setup_demo")
    for name in [m for m in sys.modules if m == "envs" or m.startswith("envs.")]:
        monkeypatch.delitem(sys.modules, name)


def test_missing_pieces_are_named(tmp_path):
    assert "set env.root or $ROBOTWIN_ROOT" in root_problems(None)[0]
    problems = root_problems(str(tmp_path))
    assert any("envs/_base_task.py" in p for p in problems)
    assert any("assets/_download.py" in p for p in problems)
    with pytest.raises(ValueError, match="unknown RoboTwin task.*beat_block_hamer"):
        make_env(config(tasks=["beat_block_hamer"]), num_envs=1, rank=0, seed=0)
    with pytest.raises(ValueError, match="env.task_config 'demo_clean' is not in"):
        make_env(config(task_config="demo_clean"), num_envs=1, rank=0, seed=0)
