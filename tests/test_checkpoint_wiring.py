"""Released checkpoints in `model.path`: which folders, the preflight that `plan` runs, the map from the policy's
actions to the environment's, and `vlaslurm.models.load_pretrained`.

The checkpoints are tiny random ones in the released layout (tests/tiny_checkpoints.py), written once per module.
"""

from __future__ import annotations

import json
import shutil
from typing import List

import numpy as np
import pytest
import torch
import yaml
from conftest import vlaslurm
from tiny_checkpoints import write_tiny_adapter, write_tiny_release

from vlaslurm.envs import make_env
from vlaslurm.models import CheckpointError, build_policy, check_checkpoint, env_action_transform, load_pretrained
from vlaslurm.models.checkpoint import checkpoint_folders
from vlaslurm.models.prismatic.oft import ReleasedOpenVLAOFT
from vlaslurm.models.prismatic.release import ReleasedOpenVLA, ReleaseError
from vlaslurm.runtime.episodes import run_chunk
from vlaslurm.runtime.evaluate import EvalConfig, Outcomes, run_episodes
from vlaslurm.runtime.roles.simulator import SimulatorConfig
from vlaslurm.spec import load_spec
from vlaslurm.spec.env_types import StepTimeConfig, SyntheticEnvConfig
from vlaslurm.spec.model_types import LoraSpec, OpenVLAConfig, OpenVLAOFTConfig, SyntheticModelConfig

torch.set_num_threads(2)

LIBERO = "libero_spatial_no_noops"
BRIDGE = "bridge_orig"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("checkpoints")
    release = write_tiny_release(root / "openvla")
    out = {
        "release": release,
        "multi": write_tiny_release(root / "multi", datasets=(LIBERO, BRIDGE)),
        "oft": write_tiny_release(root / "oft", oft=True),
        "adapter": write_tiny_adapter(release, root / "adapter"),
    }
    # a random-init policy as a run's final_model/ saves it (config.json model_type vlaslurm-tiny-vla)
    tiny = build_policy(openvla(None, action_chunk=1), action_dim=7, state_dim=0, image_size=16, num_cameras=1)
    out["tiny"] = tiny.save_pretrained(root / "tiny")
    return out


def openvla(path, **fields) -> OpenVLAConfig:
    return OpenVLAConfig(type="openvla", path=None if path is None else str(path), **fields)


def oft(path, **fields) -> OpenVLAOFTConfig:
    return OpenVLAOFTConfig(type="openvla-oft", path=None if path is None else str(path), **fields)


def field_of(call) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        call()
    return info.value


# --- folders --------------------------------------------------------------------------------------------------


def test_folders_of_releases_and_adapters(folders, tmp_path):
    plain = checkpoint_folders(openvla(folders["release"]))
    assert (plain.release, plain.adapter, plain.is_oft) == (folders["release"], None, False)
    assert checkpoint_folders(oft(folders["oft"])).is_oft
    recorded = checkpoint_folders(openvla(folders["adapter"]))  # the base adapter_config.json records
    assert (recorded.release, recorded.adapter) == (folders["release"], folders["adapter"])
    explicit = checkpoint_folders(openvla(folders["adapter"], base_path=str(folders["multi"])))
    assert (explicit.release, explicit.adapter) == (folders["multi"], folders["adapter"])

    moved = tmp_path / "moved adapter"
    shutil.copytree(folders["adapter"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/openvla"}))
    err = field_of(lambda: checkpoint_folders(openvla(moved)))
    assert err.field == "model.base_path" and "/gone/openvla" in str(err)
    assert checkpoint_folders(openvla(moved, base_path=str(folders["release"]))).release == folders["release"]

    cases = {
        "model.path": openvla(tmp_path / "nowhere"),
        "model.base_path": openvla(folders["release"], base_path=str(folders["release"])),  # not an adapter
    }
    for field, cfg in cases.items():
        assert field_of(lambda cfg=cfg: checkpoint_folders(cfg)).field == field
    err = field_of(lambda: checkpoint_folders(openvla(folders["adapter"], base_path=str(tmp_path / "no base"))))
    assert err.field == "model.base_path" and "does not exist" in err.reason
    err = field_of(lambda: checkpoint_folders(openvla(folders["adapter"], base_path=str(tmp_path))))
    assert err.field == "model.base_path" and "config.json" in err.reason


# --- the preflight --------------------------------------------------------------------------------------------


def test_check_checkpoint_accepts_what_loads(folders):
    check_checkpoint(openvla(None))  # random init
    check_checkpoint(openvla(folders["tiny"]), action_dim=7)  # a saved random init: its recorded type and shapes
    check_checkpoint(openvla(folders["release"]), action_dim=7)
    check_checkpoint(openvla(folders["multi"], unnorm_key=BRIDGE))
    check_checkpoint(oft(folders["oft"]), action_dim=7)
    check_checkpoint(openvla(folders["oft"]))  # an OFT folder holds an OpenVLA model too
    check_checkpoint(oft(folders["release"], head="discrete"))  # the LLM's own tokens need no head file
    check_checkpoint(openvla(folders["adapter"]))
    check_checkpoint(SyntheticModelConfig(type="synthetic", path="/not/a/vla"))


def test_check_checkpoint_names_the_field(folders, tmp_path):
    err = field_of(lambda: check_checkpoint(openvla(folders["multi"])))
    assert err.field == "model.unnorm_key" and "2 datasets" in err.reason and BRIDGE in err.reason
    err = field_of(lambda: check_checkpoint(openvla(folders["multi"], unnorm_key="bridge_orgi")))
    assert err.field == "model.unnorm_key" and err.suggestions == [BRIDGE]
    assert "did you mean: bridge_orig?" in str(err)
    err = field_of(lambda: check_checkpoint(openvla(folders["release"]), action_dim=6))
    assert err.field == "model.unnorm_key" and "7 action dimensions" in err.reason and "takes 6" in err.reason
    err = field_of(lambda: check_checkpoint(oft(folders["release"])))
    assert err.field == "model.path" and "action_head" in err.reason and "model.head: discrete" in err.reason

    broken = tmp_path / "no weights"
    shutil.copytree(folders["release"], broken, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert "no weights" in field_of(lambda: check_checkpoint(openvla(broken))).reason
    err = field_of(lambda: check_checkpoint(openvla(folders["adapter"], base_path=str(folders["multi"]))))
    assert err.field == "model.unnorm_key"  # the base's statistics decide, through the adapter

    check_checkpoint(openvla(folders["adapter"], lora=LoraSpec(rank=4, alpha=4.0)))  # the adapter's own sizes
    err = field_of(lambda: check_checkpoint(openvla(folders["adapter"], lora=LoraSpec(rank=8, alpha=4.0))))
    assert err.field == "model.lora.rank" and "trained with 4" in err.reason

    no_proprio = tmp_path / "oft without proprio statistics"
    shutil.copytree(folders["oft"], no_proprio)
    statistics = json.loads((no_proprio / "dataset_statistics.json").read_text())
    del statistics[LIBERO]["proprio"]
    (no_proprio / "dataset_statistics.json").write_text(json.dumps(statistics))
    err = field_of(lambda: check_checkpoint(oft(no_proprio)))
    assert err.field == "model.unnorm_key" and "no proprio statistics" in err.reason


# --- policy space -> environment ------------------------------------------------------------------------------

# tiny_norm_stats: dimension i of dataset k spans q01 = -0.5 + 0.1 i + 0.25 k .. q99 = 1.5 + 0.3 i + 0.25 k, and
# the last (gripper) dimension is not normalised.
NORMED = np.array([[-1.0, 0.0, 1.0, 0.5, -0.5, 0.25, 0.8], [1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.2]], np.float32)


def hand_unnormalised(k: int) -> np.ndarray:
    out = NORMED.astype(np.float64).copy()
    for i in range(6):
        low, high = -0.5 + 0.1 * i + 0.25 * k, 1.5 + 0.3 * i + 0.25 * k
        out[:, i] = 0.5 * (NORMED[:, i] + 1.0) * (high - low) + low
    return out


def test_env_action_transform_unnormalises_with_the_chosen_statistics(folders):
    expected = hand_unnormalised(0)
    # row 0: -1 -> q01, 0 -> the middle, 1 -> q99 (dimensions 0, 1, 2); the gripper passes through
    np.testing.assert_allclose(expected[0, :3], [-0.5, (-0.4 + 1.8) / 2, 2.1])
    got = env_action_transform(openvla(folders["release"]))(NORMED)
    assert got.dtype == np.float32 and got.shape == NORMED.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert got[0, 6] == np.float32(0.8) and got[1, 6] == np.float32(0.2)
    bridge = env_action_transform(openvla(folders["multi"], unnorm_key=BRIDGE))(NORMED)
    np.testing.assert_allclose(bridge, hand_unnormalised(1), rtol=0, atol=1e-6)
    # OFT scales by (high - low + 1e-8): below float32's resolution here, but the same formula
    np.testing.assert_allclose(env_action_transform(oft(folders["oft"]))(NORMED), expected, rtol=0, atol=1e-6)
    chunk = np.stack([NORMED, NORMED])  # [..., A]: a chunk per instance
    np.testing.assert_allclose(env_action_transform(openvla(folders["release"]))(chunk)[1], expected, atol=1e-6)


def test_libero_gripper_after_unnormalising(folders):
    libero = env_action_transform(openvla(folders["release"], gripper="libero"))(NORMED)
    np.testing.assert_allclose(libero[:, :6], hand_unnormalised(0)[:, :6], rtol=0, atol=1e-6)
    # g in [0, 1] (0 = close): g > 0.5 -> -1 (open), g < 0.5 -> +1 (close), as the release's LIBERO eval
    assert libero[:, 6].tolist() == [-1.0, 1.0]
    random_init = env_action_transform(oft(None, gripper="libero"))(NORMED)
    np.testing.assert_array_equal(random_init[:, :6], NORMED[:, :6])
    assert random_init[:, 6].tolist() == [-1.0, 1.0]


def test_identity_for_random_init_and_saved_tiny_policies(folders):
    for cfg in (openvla(None), oft(None), openvla(folders["tiny"]), SyntheticModelConfig(type="synthetic")):
        out = env_action_transform(cfg)(NORMED)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, NORMED)
    with pytest.raises(CheckpointError, match="model.unnorm_key"):
        env_action_transform(openvla(folders["multi"]))


class Recording:
    """A synthetic env that remembers the actions it was stepped with."""

    def __init__(self, num_envs: int = 2) -> None:
        cfg = SyntheticEnvConfig(type="synthetic", step_ms=StepTimeConfig(dist="constant", mean=0.01), episode_steps=3)
        self.inner = make_env(cfg, num_envs=num_envs, rank=0, seed=0)
        self.seen: List[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, env_ids, actions):
        self.seen.append(actions.copy())
        return self.inner.step(env_ids, actions)


def test_the_environment_gets_transformed_actions_and_records_keep_the_policys(folders, tmp_path):
    env = Recording()
    env.reset([0, 1])
    policy = np.zeros((2, 2, env.action_dim), np.float32)
    run_chunk(env, np.array([0, 1]), policy, to_env=lambda a: a + 10.0)
    assert [s.tolist() for s in env.seen] == [np.full((2, env.action_dim), 10.0).tolist()] * 2
    assert not policy.any()  # the caller's (policy-space) actions are left as they were

    env = Recording()
    traces: list = []

    class Keep(Outcomes):
        def add(self, task, episode, success, instruction, trace, last):
            traces.extend(step[1] for step in trace)

    def act(obs, decision):
        return np.full((len(decision.gids), 1, env.action_dim), 0.5, np.float32)

    (tmp_path / "eval").mkdir()
    run_episodes(env, 0, 2, EvalConfig(episodes=2), 0, act, Keep(tmp_path / "eval", 0), to_env=lambda a: -a)
    assert traces and all(np.all(t == 0.5) for t in traces)
    assert env.seen and all(np.all(s == -0.5) for s in env.seen)


def test_simulator_config_carries_the_model(tmp_path):
    spec = tmp_path / "sim.yaml"
    spec.write_text(
        "name: sim\nenv: {type: synthetic, num_envs: 8, obs: {image_size: 16, cameras: [c]}}\n"
        "model: {type: openvla, gripper: libero}\nalgo: {type: ppo}\n"
    )
    cfg = SimulatorConfig.from_spec(load_spec(spec).spec)
    assert isinstance(cfg.model, OpenVLAConfig) and cfg.model.gripper == "libero"


# --- load_pretrained ------------------------------------------------------------------------------------------


def frame(seed: int, shape=(96, 128, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_load_pretrained_dispatch_and_predict_action(folders):
    policy = load_pretrained(folders["release"])
    assert isinstance(policy, ReleasedOpenVLA)
    first = policy.predict_action(frame(0), "pick up the black bowl")
    assert first.shape == (7,)
    assert np.array_equal(first, policy.predict_action([frame(0)], "pick up the black bowl"))  # a list of one
    assert np.array_equal(first, policy.predict_action(frame(0), "pick up the black bowl", LIBERO))
    with pytest.raises(ValueError, match="OpenVLA takes no proprio"):
        policy.predict_action(frame(0), "pick up the black bowl", proprio=np.zeros(8))
    with pytest.raises(ValueError, match="one camera frame, got 2"):
        policy.predict_action([frame(0), frame(1)], "pick up the black bowl")

    chunked = load_pretrained(folders["oft"])
    assert isinstance(chunked, ReleasedOpenVLAOFT) and (chunked.shape.chunk, chunked.shape.action_dim) == (8, 7)
    proprio = np.linspace(-1.0, 2.0, 8)
    images = [frame(0), frame(1, (64, 64, 3))]
    chunk = chunked.predict_action(images, "open the top drawer", proprio=proprio)
    assert chunk.shape == (8, 7)
    assert np.array_equal(chunk, chunked.predict_action(images, "open the top drawer", LIBERO, proprio))
    assert chunked.predict_action(frame(0), "open the top drawer", proprio=proprio).shape == (8, 7)  # one camera

    with pytest.raises(ReleaseError, match="adapter folder"):
        load_pretrained(folders["adapter"])
    with pytest.raises(TypeError, match="chunk apply to OpenVLA-OFT folders only"):
        load_pretrained(folders["release"], chunk=4)


# --- the command line -----------------------------------------------------------------------------------------


def test_plan_refuses_an_unnorm_key_the_checkpoint_lacks(folders, tmp_path):
    spec = tmp_path / "bad key.yaml"
    model = {"type": "openvla", "path": str(folders["multi"]), "unnorm_key": "bridge_orgi"}
    spec.write_text(
        yaml.safe_dump(
            {"name": "key", "env": {"type": "toy", "num_envs": 8}, "model": model, "algo": {"type": "ppo"}},
            sort_keys=False,
        )
    )
    line = next(i for i, text in enumerate(spec.read_text().splitlines(), 1) if "unnorm_key" in text)
    proc = vlaslurm("plan", str(spec), runs_root=tmp_path / "runs", env={"VLASLURM_SITE": "none"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert f"{spec}:{line}: model.unnorm_key:" in proc.stderr and "bridge_orig" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_known_action_sizes_are_the_simulators(tmp_path):
    from vlaslurm.envs import known_action_dim, make_env
    from vlaslurm.envs.libero import ACTION_DIM
    from vlaslurm.spec.env_types import LiberoEnvConfig, ManiSkillEnvConfig, ToyEnvConfig

    assert known_action_dim(ToyEnvConfig(type="toy")) == make_env(ToyEnvConfig(type="toy"), 1, 0, 0).action_dim
    assert known_action_dim(LiberoEnvConfig(type="libero")) == ACTION_DIM
    assert known_action_dim(ManiSkillEnvConfig(type="maniskill", action_convention="native")) is None


def test_known_state_sizes_are_the_simulators():
    from vlaslurm.envs import known_state_dim, make_env
    from vlaslurm.envs.libero import STATE_DIM
    from vlaslurm.spec.env_types import LiberoEnvConfig, ManiSkillEnvConfig, SyntheticEnvConfig, ToyEnvConfig

    for cfg in (ToyEnvConfig(type="toy"), SyntheticEnvConfig(type="synthetic", state_dim=5)):
        assert known_state_dim(cfg) == make_env(cfg, 1, 0, 0).state_dim
    assert known_state_dim(LiberoEnvConfig(type="libero")) == STATE_DIM
    assert known_state_dim(ManiSkillEnvConfig(type="maniskill")) is None


def test_plan_refuses_a_saved_tiny_policy_of_another_state_size(tmp_path):
    """A tiny policy saved for LIBERO's 8-value state, on the toy task (2 values): plan refuses it, naming the
    field, as the runtime's build would (it did not: plan accepted it and the run failed at build)."""
    from vlaslurm.models.vla.tiny import build_tiny
    from vlaslurm.spec.model_types import BackboneConfig

    saved = tmp_path / "libero policy"
    policy = build_tiny(
        "openvla-oft", BackboneConfig(), action_chunk=4, action_dim=2, state_dim=8, image_size=32, num_cameras=1, seed=0
    )
    policy.save_pretrained(saved)
    spec = tmp_path / "toy.yaml"
    model = {"type": "openvla-oft", "path": str(saved), "action_chunk": 4}
    env = {"type": "toy", "num_envs": 4, "obs": {"image_size": 32, "cameras": ["top"], "state": True}}
    spec.write_text(yaml.safe_dump({"name": "dims", "env": env, "model": model, "algo": {"type": "ppo"}}))
    proc = vlaslurm("plan", str(spec), runs_root=tmp_path / "runs", env={"VLASLURM_SITE": "none"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "env.obs.state: the environment gives 2 state values" in proc.stderr and "saved with 8" in proc.stderr


def test_plan_refuses_a_checkpoint_for_another_robot(folders, tmp_path):
    """The toy task takes 2-dim actions; a LIBERO checkpoint's statistics have 7: plan says so, naming the field."""
    spec = tmp_path / "toy.yaml"
    model = {"type": "openvla", "path": str(folders["release"])}
    env = {"type": "toy", "num_envs": 4, "obs": {"image_size": 32, "cameras": ["top"], "state": False}}
    spec.write_text(yaml.safe_dump({"name": "dims", "env": env, "model": model, "algo": {"type": "ppo"}}))
    proc = vlaslurm("plan", str(spec), runs_root=tmp_path / "runs", env={"VLASLURM_SITE": "none"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "model.unnorm_key" in proc.stderr and "7 action dimensions" in proc.stderr and "takes 2" in proc.stderr


def test_plan_refuses_an_oft_checkpoint_without_the_state_it_reads(folders, tmp_path):
    spec = tmp_path / "libero.yaml"
    env = {"type": "libero", "num_envs": 2, "obs": {"image_size": 224, "cameras": ["agentview"], "state": False}}
    model = {"type": "openvla-oft", "path": str(folders["oft"]), "action_chunk": 8}
    spec.write_text(yaml.safe_dump({"name": "state", "env": env, "model": model, "algo": {"type": "ppo"}}))
    proc = vlaslurm("plan", str(spec), runs_root=tmp_path / "runs", env={"VLASLURM_SITE": "none"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "model.path" in proc.stderr and "env.obs.state: true" in proc.stderr
