"""Stand-in for RoboTwin's Base_Task: same method signatures, toy state (see README.md)."""

import os
from typing import Literal

import gymnasium as gym
import numpy as np
import yaml

from ._GLOBAL_CONFIGS import CONFIGS_PATH
from .utils.create_actor import UnStableError

CALLS = []  # (method, kwargs) of every call, for tests that check the adapter's protocol


class Base_Task(gym.Env):
    def __init__(self):
        pass

    # The mutable default is RoboTwin's own signature, which SIGNATURES.txt pins; it is never mutated here.
    def _init_task_env_(self, table_xy_bias=[0, 0], table_height_bias=0, **kwags):  # noqa: B006
        seed = kwags.get("seed", 0)
        CALLS.append(
            ("setup_demo", {k: kwags[k] for k in ("seed", "now_ep_num", "is_test", "eval_mode") if k in kwags})
        )
        if seed % 7 == 3:  # some seeds are unstable, as in RoboTwin
            raise UnStableError(f"Objects is unstable in seed({seed})")
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.task_name = kwags.get("task_name")
        self.data_type = kwags.get("data_type")
        self.h, self.w = kwags["head_camera_h"], kwags["head_camera_w"]
        left = kwags["left_embodiment_config"]["arm_joints_name"][0]
        right = kwags["right_embodiment_config"]["arm_joints_name"][1]
        self.dims = (len(left), len(right))
        self.joints = np.concatenate(
            [self.rng.uniform(-0.1, 0.1, len(left)), [1.0], self.rng.uniform(-0.1, 0.1, len(right)), [1.0]]
        )
        self.plan_success = True
        self.eval_success = False
        self.take_action_cnt = 0
        self.instruction = None
        self.step_lim = None
        if kwags.get("eval_mode", False):
            with open(os.path.join(CONFIGS_PATH, "_eval_step_limit.yml")) as f:
                self.step_lim = yaml.safe_load(f)[self.task_name]
        self.closed = False

    def play_once(self):
        pass

    def check_success(self):
        pass

    def get_obs(self):
        obs = {"observation": {}, "pointcloud": [], "joint_action": {}, "endpose": {}}
        if self.data_type.get("rgb", False):
            shade = np.uint8(100 + 100 * np.tanh(self.joints[0]))
            for name in ("head_camera", "left_camera", "right_camera"):
                obs["observation"][name] = {"rgb": np.full((self.h, self.w, 3), shade, np.uint8)}
        if self.data_type.get("qpos", False):
            obs["joint_action"]["vector"] = self.joints.copy()
        return obs

    def set_instruction(self, instruction=None):
        self.instruction = instruction

    def get_instruction(self, instruction=None):
        return self.instruction

    def close_env(self, clear_cache=False):
        CALLS.append(("close_env", {"clear_cache": clear_cache}))
        self.closed = True

    def take_action(self, action, action_type: Literal["qpos", "ee"] = "qpos"):
        if self.take_action_cnt == self.step_lim or self.eval_success:
            return
        self.take_action_cnt += 1
        if action_type == "qpos":
            self.joints = np.asarray(action, np.float64).copy()
        if self.check_success():
            self.eval_success = True
