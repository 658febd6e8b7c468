"""The toy reaching task: interface shapes, partial resets, seeding, and that language matters."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from vlaslurm.envs import make_env
from vlaslurm.envs.toy import COLOURS, baseline_success, oracle_actions
from vlaslurm.spec.env_types import ObsConfig, ToyEnvConfig


def make(num_envs: int = 8, seed: int = 0, rank: int = 0, **fields):
    return make_env(ToyEnvConfig(type="toy", **fields), num_envs=num_envs, rank=rank, seed=seed)


def test_reset_and_step_shapes():
    env = make(5)
    assert (env.num_envs, env.action_dim, env.state_dim, env.thread_safe) == (5, 2, 2, True)
    assert env.tasks == ["reach"] * 5
    obs = env.reset(range(5))
    assert obs.images.shape == (5, 1, 32, 32, 3) and obs.images.dtype == np.uint8
    assert obs.state.shape == (5, 2) and obs.state.dtype == np.float32
    assert len(obs.instructions) == 5 and all(len(i.split()) == 5 for i in obs.instructions)
    res = env.step([1, 3], np.zeros((2, 2), np.float32))
    assert len(res.obs) == 2 and res.obs.images.shape == (2, 1, 32, 32, 3)
    assert res.reward.shape == (2,) and res.reward.dtype == np.float32
    for flags in (res.terminated, res.truncated, res.success):
        assert flags.shape == (2,) and flags.dtype == bool


def test_observation_switches():
    env = make(3, obs=ObsConfig(image_size=0, cameras=[], state=False))
    obs = env.reset(range(3))
    assert obs.images is None and obs.state is None and len(obs) == 3


def test_partial_reset_touches_only_named_instances():
    env = make(6)
    env.reset(range(6), seeds=range(6))
    env.step(range(6), np.full((6, 2), 0.3, np.float32))
    before = (env.agent_pos.copy(), env.object_pos.copy(), env.target.copy(), env.elapsed.copy())
    obs = env.reset([4, 1], seeds=[100, 101])
    untouched = [0, 2, 3, 5]
    for old, new in zip(before, (env.agent_pos, env.object_pos, env.target, env.elapsed)):
        np.testing.assert_array_equal(old[untouched], new[untouched])
    assert env.elapsed[[1, 4]].tolist() == [0, 0]
    np.testing.assert_array_equal(obs.state, env.agent_pos[[4, 1]])


def test_seeded_resets_are_deterministic():
    a, b = make(4, seed=0), make(4, seed=123)  # constructor seeds differ; reset seeds decide
    actions = np.random.default_rng(0).uniform(-1, 1, (10, 4, 2)).astype(np.float32)
    results = []
    for env in (a, b):
        obs = env.reset(range(4), seeds=[7, 8, 9, 10])
        steps = [env.step(range(4), act) for act in actions[:3]]
        results.append((obs, steps))
    (obs_a, steps_a), (obs_b, steps_b) = results
    np.testing.assert_array_equal(obs_a.images, obs_b.images)
    assert obs_a.instructions == obs_b.instructions
    for sa, sb in zip(steps_a, steps_b):
        np.testing.assert_array_equal(sa.reward, sb.reward)
        np.testing.assert_array_equal(sa.obs.state, sb.obs.state)
    assert not np.array_equal(make(4).reset(range(4), seeds=[1, 2, 3, 4]).images, obs_a.images)


def test_unseeded_streams_differ_across_ranks_and_repeat_per_seed():
    first = make(4, seed=5, rank=0).reset(range(4)).images
    assert np.array_equal(first, make(4, seed=5, rank=0).reset(range(4)).images)
    assert not np.array_equal(first, make(4, seed=5, rank=1).reset(range(4)).images)


def test_instruction_names_the_colour_drawn_at_the_target():
    env = make(64)
    obs = env.reset(range(64), seeds=range(64))
    rgb = {name: value for name, value in COLOURS}
    centres = np.rint(env.target_pos(range(64)) * 31).astype(int)
    for i, text in enumerate(obs.instructions):
        x, y = centres[i]
        assert tuple(obs.images[i, 0, y, x]) == rgb[text.split()[3]], text


def test_success_terminates_and_time_limit_truncates():
    env = make(2)
    env.reset(range(2), seeds=range(2))
    for _ in range(24):  # the oracle needs at most ~12 steps across the arena
        res = env.step([0], oracle_actions(env, [0]))
        if res.terminated[0]:
            break
    assert res.terminated[0] and res.success[0] and not res.truncated[0] and res.reward[0] > 1.0
    with pytest.raises(RuntimeError, match="reset them"):
        env.step([0], np.zeros((1, 2), np.float32))
    short = make(2, max_episode_steps=5)
    short.reset(range(2), seeds=range(2))
    for _ in range(5):  # standing still never reaches the target (the agent starts away from it)
        res = short.step([1], np.zeros((1, 2), np.float32))
    assert res.truncated[0] and not res.terminated[0] and not res.success[0]


def test_sparse_reward_is_only_the_success_bonus():
    env = make(16, reward="sparse")
    env.reset(range(16), seeds=range(16))
    res = env.step(range(16), oracle_actions(env, range(16)))
    assert set(res.reward.tolist()) <= {0.0, 1.0}
    np.testing.assert_array_equal(res.reward, res.success.astype(np.float32))


def test_disjoint_subsets_step_safely_from_threads():
    # Small moves: no instance may finish (and need a reset) within the 20 steps.
    actions = np.random.default_rng(1).uniform(-0.05, 0.05, (20, 8, 2)).astype(np.float32)

    def run(env, ids):
        for act in actions:
            env.step(ids, act[ids])

    threaded, serial = make(8), make(8)
    for env in (threaded, serial):
        env.reset(range(8), seeds=range(8))
    run(serial, np.arange(4)), run(serial, np.arange(4, 8))
    workers = [threading.Thread(target=run, args=(threaded, ids)) for ids in (np.arange(4), np.arange(4, 8))]
    [w.start() for w in workers], [w.join() for w in workers]
    np.testing.assert_array_equal(threaded.agent_pos, serial.agent_pos)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="env.reward"):
        make(reward="dense")
    with pytest.raises(ValueError, match="env.tasks"):
        make(tasks=["push"])


@pytest.mark.parametrize(
    "policy, low, high",
    [("random", 0.0, 0.20), ("nearest", 0.25, 0.42), ("oracle", 0.99, 1.0)],
)
def test_baseline_success_rates(policy, low, high):
    # Only a policy that reads the instruction can beat the language-blind "nearest" baseline.
    rate, _ = baseline_success(policy, episodes=512, seed=3)
    assert low <= rate <= high, f"{policy}: {rate:.3f}"
