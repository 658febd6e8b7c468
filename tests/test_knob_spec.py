"""Issue 17's spec fields: loaded, validated with errors naming the field, shown in the resolved spec (what
`vlaslurm plan`'s `LoadedSpec.to_dict` gives, the run's spec.yaml and MLflow's params), and `env.reset_seeds`
reaching the simulator's resets. ~3 s."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, cast

import pytest
import yaml

from vlaslurm.envs.base import listed_seed
from vlaslurm.envs.toy import make as make_toy
from vlaslurm.runtime.roles.simulator import Simulator, SimulatorConfig
from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.env_types import ToyEnvConfig


def spec_file(tmp_path: Path, algo: dict, rollout: Optional[dict] = None, env: Optional[dict] = None) -> Path:
    spec = {
        "name": "knobs",
        "env": {"type": "toy", "num_envs": 8, **(env or {})},
        "model": {"type": "openvla-oft", "action_chunk": 4, "action_dim": 2},
        "algo": algo,
        "rollout": rollout or {},
    }
    path = tmp_path / "knobs.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_resolved_spec_shows_every_new_field(tmp_path):
    resolved = load_spec(spec_file(tmp_path, {"type": "grpo", "group_size": 4})).to_dict()
    algo, rollout, env = resolved["algo"], resolved["rollout"], resolved["env"]
    assert (algo["advantage"], algo["success_filter"], algo["clip"]) == ("episode", [0.1, 0.9], [0.2, 0.28])
    assert (algo["kl_coef"], algo["reward_scale"], algo["entropy_level"]) == (0.0, 1.0, "action")
    assert rollout["publish_every"] == 1 and env["reset_seeds"] == [] and env["reset_seeds_file"] is None
    ppo = load_spec(spec_file(tmp_path, {"type": "ppo"})).to_dict()["algo"]
    assert ppo["clip"] == [0.2, 0.2] and ppo["kl_coef"] == 0.0


@pytest.mark.parametrize(
    "algo,rollout,env,key,words",
    [
        ({"kl_coef": -0.1}, {}, {}, "algo.kl_coef", "at least 0"),
        ({"reward_scale": 0}, {}, {}, "algo.reward_scale", "greater than 0"),
        ({"entropy_level": "chunks"}, {}, {}, "algo.entropy_level", "chunk"),
        ({}, {"publish_every": 0}, {}, "rollout.publish_every", "at least 1"),
        ({}, {"publish_every": 2}, {}, "rollout.publish_every", "rollout.mode: async"),
        ({}, {"publish_every": 3, "mode": "async", "max_staleness": 1}, {}, "rollout.publish_every", "at least 2"),
        ({}, {}, {"reset_seeds": [1, -2]}, "env.reset_seeds", "at least 0"),
        ({}, {}, {"reset_seeds": [1], "reset_seeds_file": "s.txt"}, "env.reset_seeds_file", "give one"),
        ({}, {}, {"reset_seeds_file": "/no/such/seeds.txt"}, "env.reset_seeds_file", "cannot be read"),
    ],
)
def test_bad_values_name_their_field(tmp_path, algo, rollout, env, key, words):
    with pytest.raises(SpecError) as err:
        load_spec(spec_file(tmp_path, {"type": "ppo", **algo}, rollout, env))
    assert err.value.key == key and words in str(err.value), str(err.value)
    assert "knobs.yaml:" in str(err.value)  # file and line


def test_publish_every_within_the_staleness_bound_loads(tmp_path):
    rollout = {"publish_every": 3, "mode": "async", "max_staleness": 2}
    assert load_spec(spec_file(tmp_path, {"type": "ppo"}, rollout)).spec.rollout.publish_every == 3


def test_reset_seeds_file_and_its_errors(tmp_path):
    seeds = tmp_path / "seeds.txt"
    seeds.write_text("# evaluation states\n3, 5\n\n7 11  # last\n")
    env = load_spec(spec_file(tmp_path, {"type": "ppo"}, env={"reset_seeds_file": str(seeds)})).spec.env
    assert env.reset_seed_list() == [3, 5, 7, 11]
    seeds.write_text("3\n5 x\n")
    with pytest.raises(SpecError, match=r"seeds.txt:2: 'x' is not an integer seed") as err:
        load_spec(spec_file(tmp_path, {"type": "ppo"}, env={"reset_seeds_file": str(seeds)}))
    assert err.value.key == "env.reset_seeds_file"


def test_listed_seed_by_hand():
    seeds = [10, 11, 12, 13, 14]
    # 2 groups: episode 0 takes seeds 0, 1; episode 1 seeds 2, 3; episode 2 seeds 4, 0 (wrapping round)
    got = [[listed_seed(seeds, g, e, groups=2) for g in range(2)] for e in range(3)]
    assert got == [[10, 11], [12, 13], [14, 10]]


class RecordingToy:
    """The toy env, recording the seeds its resets get (a stand-in only for that record)."""

    def __init__(self, env):
        self.env, self.seeds = env, []

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, ids, seeds=None):
        self.seeds.append(list(seeds))
        return self.env.reset(ids, seeds)


def simulator(tmp_path: Path, env: dict, algo: dict) -> Simulator:
    cfg = SimulatorConfig.from_spec(load_spec(spec_file(tmp_path, algo, {"mode": "async"}, env)).spec)
    toy = RecordingToy(make_toy(cast(ToyEnvConfig, cfg.env), num_envs=cfg.env.num_envs, group_size=cfg.group_size))
    # a fake rank context: only the run directory, rank and clock the simulator's records use
    ctx = SimpleNamespace(run_dir=tmp_path, rank=0, now=time.monotonic)
    return Simulator(cfg, ctx, toy, first_gid=0)  # type: ignore[arg-type]


def test_simulator_resets_episode_i_with_listed_seed_i(tmp_path):
    sim = simulator(tmp_path, {"num_envs": 4, "reset_seeds": [100, 101, 102]}, {"type": "grpo", "group_size": 2})
    sim.reset([0, 1, 2, 3])  # episode 0 of groups 0, 0, 1, 1
    sim.reset([2, 3])  # episode 1 of group 1: i = 1 * 2 + 1 = 3 -> 100
    sim.reset([0, 1])  # episode 1 of group 0: i = 2 -> 102
    assert sim.env.seeds == [[100, 100, 101, 101], [100, 100], [102, 102]]
    drawn = simulator(tmp_path, {"num_envs": 4}, {"type": "grpo", "group_size": 2})
    drawn.reset([0, 1, 2, 3])
    first = drawn.env.seeds[0]
    assert first[0] == first[1] != first[2] == first[3] and not set(first) & {100, 101, 102}
