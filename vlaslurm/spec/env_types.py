"""Config dataclasses for each registered `env.type`.

Every field carries its documentation in the `doc` metadata, so `vlaslurm plan`
and error messages can show it. Simulator code lives in `vlaslurm/envs/`; only
the typed contract lives here, so loading a spec never imports a simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional

from vlaslurm.spec.registry import doc, register

# What the ManiSkill adapter can turn into observations: privileged state, or camera images.
ManiSkillObsMode = Literal[
    "state", "state_dict", "rgb", "rgbd", "rgb+depth", "rgb+segmentation", "rgb+depth+segmentation", "sensor_data"
]


@dataclass
class ObsConfig:
    """What each environment instance observes."""

    image_size: int = doc(64, "Side length in pixels of each square camera image (0 = no images).")
    cameras: List[str] = doc(["head"], "Camera names to render, in order.")
    state: bool = doc(True, "Whether the proprioceptive state vector is part of the observation.")


@dataclass
class EnvConfig:
    """Fields shared by every simulator type."""

    type: str = doc("", "Simulator type; selects the dataclass below (e.g. toy, synthetic, maniskill).")
    tasks: List[str] = doc(
        [], "Task names; they take turns by GRPO group (algo.group_size environments), else by environment."
    )
    num_envs: int = doc(16, "Environment instances in total, over all simulator ranks.")
    max_episode_steps: int = doc(100, "Steps after which an episode is truncated.")
    obs: ObsConfig = field(default_factory=ObsConfig, metadata={"doc": "Observation settings."})
    reset_seeds: List[int] = doc(
        [],
        "Fixed reset seeds (reset-state ids), for evaluation that compares like with like: episode i (its "
        "episode number x the number of groups + its group) resets with reset_seeds[i mod len]; "
        "empty = seeds drawn from rollout.seed.",
    )
    reset_seeds_file: Optional[str] = doc(
        None, "A text file of reset seeds (integers separated by spaces, commas or lines; # comments), instead."
    )

    def episode_limit(self) -> int:
        """The most env steps an episode can last."""
        return self.max_episode_steps

    def reset_seed_list(self) -> List[int]:
        """`reset_seeds`, or the integers of `reset_seeds_file` (ValueError naming the file and line)."""
        if self.reset_seeds_file is None:
            return list(self.reset_seeds)
        return read_seed_file(self.reset_seeds_file)


def read_seed_file(path: str) -> List[int]:
    """The integers of a seed file: separated by whitespace or commas, `#` starts a comment."""
    seeds: List[int] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            for word in line.split("#", 1)[0].replace(",", " ").split():
                try:
                    seeds.append(int(word))
                except ValueError:
                    raise ValueError(f"{path}:{number}: {word!r} is not an integer seed") from None
    if not seeds:
        raise ValueError(f"{path}: holds no seeds")
    return seeds


@register("env", "toy")
@dataclass
class ToyEnvConfig(EnvConfig):
    """A small language-conditioned visual reaching task shipped with vlaslurm (CPU)."""

    tasks: List[str] = doc(["reach"], "Task names (the toy task has one family: reach).")
    num_objects: int = doc(3, "Coloured objects drawn in each image.")
    reward: Literal["shaped", "sparse"] = doc("shaped", "Reward: shaped (distance decrease + success bonus) or sparse.")
    max_episode_steps: int = doc(24, "Steps after which an episode is truncated.")
    obs: ObsConfig = field(
        default_factory=lambda: ObsConfig(image_size=32, cameras=["top"], state=True),
        metadata={"doc": "Observation settings."},
    )


@dataclass
class StepTimeConfig:
    """Distribution of one synthetic environment step's duration."""

    dist: Literal["constant", "lognormal", "pareto"] = doc("constant", "Step time distribution.")
    mean: float = doc(10.0, "Mean step time in milliseconds.")
    sigma: float = doc(1.0, "Sigma of the underlying normal (lognormal only).")
    alpha: float = doc(1.5, "Tail index (pareto only; must be > 1 for a finite mean).")
    per_env: float = doc(
        0.0,
        "Added ms per instance a call steps, on one shared device per simulator rank (a GPU simulator): "
        "concurrent calls queue for it. 0: instances are independent parallel hardware.",
    )


@register("env", "synthetic")
@dataclass
class SyntheticEnvConfig(EnvConfig):
    """Sleeps instead of simulating, to measure the runtime's scheduling."""

    tasks: List[str] = doc(["synthetic"], "Task names.")
    step_ms: StepTimeConfig = field(default_factory=StepTimeConfig, metadata={"doc": "Step time distribution."})
    slow_fraction: float = doc(0.0, "Fraction of environments that are slower than the rest.")
    slow_factor: float = doc(1.0, "How many times slower the slow environments step.")
    success_prob: float = doc(0.5, "Probability that an episode ends in success.")
    episode_steps: int = doc(20, "Steps after which a synthetic episode terminates.")
    state_dim: int = doc(8, "Length of the synthetic state vector.")

    def episode_limit(self) -> int:
        return min(self.episode_steps, self.max_episode_steps)

    obs: ObsConfig = field(
        default_factory=lambda: ObsConfig(image_size=0, cameras=[], state=True),
        metadata={"doc": "Observation settings."},
    )


@register("env", "maniskill")
@dataclass
class ManiSkillEnvConfig(EnvConfig):
    """ManiSkill3 tasks (GPU-parallel simulation on clusters, CPU here)."""

    tasks: List[str] = doc(["PushCube-v1"], "ManiSkill task ids, e.g. PickCube-v1.")
    sim_backend: Literal["auto", "cpu", "gpu"] = doc("auto", "ManiSkill sim backend: auto, cpu or gpu.")
    control_mode: str = doc("pd_ee_delta_pose", "ManiSkill controller name.")
    obs_mode: ManiSkillObsMode = doc("rgb", "ManiSkill obs_mode: state (no images; privileged state), rgb, rgbd ...")
    max_episode_steps: int = doc(50, "Steps after which an episode is truncated.")
    obs: ObsConfig = field(
        default_factory=lambda: ObsConfig(image_size=128, cameras=["base_camera"], state=True),
        metadata={"doc": "Observation settings (cameras are ManiSkill sensor names, e.g. base_camera)."},
    )
    reward_mode: Literal["sparse", "dense", "normalized_dense", "none"] = doc(
        "normalized_dense", "ManiSkill reward_mode."
    )
    render_backend: str = doc("gpu", "ManiSkill render_backend: gpu (falls back to cpu without CUDA), cpu or none.")
    action_convention: Literal["vla", "native"] = doc(
        "vla",
        "vla: 7-D [delta xyz, delta axis-angle, gripper (+1 closes)] in [-1, 1] mapped onto the controller; "
        "native: the controller's own action vector.",
    )
    vulkan_icd: str = doc(
        "auto",
        "Vulkan ICD json for SAPIEN's renderer, or auto ($VK_ICD_FILENAMES, then the "
        "system's ICDs, then the lavapipe unpacked by .ci/setup-sims).",
    )
    instructions: Dict[str, str] = doc({}, "Language instruction per task id, overriding the built-in ones.")


@register("env", "libero")
@dataclass
class LiberoEnvConfig(EnvConfig):
    """LIBERO suites (MuJoCo, CPU)."""

    tasks: List[str] = doc(["libero_spatial"], "LIBERO suite names (libero_spatial, libero_object, ...).")
    task_ids: List[int] = doc([], "Task indices within each suite (empty = all).")
    mujoco_gl: Literal["egl", "osmesa"] = doc("egl", "MUJOCO_GL backend for headless rendering: egl or osmesa.")
    max_episode_steps: int = doc(300, "Steps after which an episode is truncated.")
    settle_steps: int = doc(10, "No-op steps after each reset so objects settle (not counted as episode steps).")
    obs: ObsConfig = field(
        default_factory=lambda: ObsConfig(image_size=128, cameras=["agentview", "wrist"], state=True),
        metadata={"doc": "Observation settings (cameras: agentview, wrist)."},
    )


@register("env", "robotwin")
@dataclass
class RoboTwinEnvConfig(EnvConfig):
    """RoboTwin 2.0 dual-arm tasks (needs RoboTwin installed on the cluster)."""

    tasks: List[str] = doc(["beat_block_hammer"], "RoboTwin task names.")
    root: Optional[str] = doc(None, "Path of the RoboTwin checkout (default: $ROBOTWIN_ROOT).")
    task_config: str = doc("demo_randomized", "RoboTwin task_config name.")
    max_episode_steps: int = doc(300, "Steps after which an episode is truncated.")
    action_type: Literal["qpos", "ee"] = doc(
        "qpos", "RoboTwin take_action type: qpos (joint targets, 14-D for aloha-agilex) or ee (16-D)."
    )
    instruction_type: Literal["seen", "unseen"] = doc("seen", "RoboTwin instruction set: seen or unseen.")
    expert_check: bool = doc(True, "Skip seeds whose scripted expert fails, as RoboTwin's evaluation does.")
    max_seed_tries: int = doc(20, "Seeds tried per reset before giving up (unstable scenes, failed experts).")
    obs: ObsConfig = field(
        default_factory=lambda: ObsConfig(image_size=128, cameras=["head"], state=True),
        metadata={"doc": "Observation settings (cameras: head, left_wrist, right_wrist)."},
    )
