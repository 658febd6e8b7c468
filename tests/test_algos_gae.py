"""GAE against plain Python loops, including partial resets and action chunks."""

import math
import random

import pytest
import torch

from vlaslurm.algos import (
    action_level_gae,
    chunk_rewards,
    compute_gae,
    expand_chunk,
    flatten_chunks,
    unflatten_chunks,
)


def ref_gae(rewards, values, next_values, terminated, truncated, gammas, lam):
    """One env's GAE over lists of floats, written as the textbook recursion."""
    T = len(rewards)
    advantages = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        if terminated[t] or truncated[t]:
            last = 0.0  # the next step belongs to another episode
        bootstrap = 0.0 if terminated[t] else next_values[t]
        delta = rewards[t] + gammas[t] * bootstrap - values[t]
        last = delta + gammas[t] * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def column(x, n):
    return [float(v) for v in x[:, n].tolist()]


def uniform(rng, *shape):
    """A float64 tensor of U(-1, 1) drawn from a seeded Python RNG."""
    flat = [rng.uniform(-1, 1) for _ in range(math.prod(shape))]
    return torch.tensor(flat, dtype=torch.float64).reshape(shape)


def random_batch(rng, T, N):
    def rand():
        return uniform(rng, T, N)

    terminated = torch.tensor([[rng.random() < 0.15 for _ in range(N)] for _ in range(T)])
    truncated = torch.tensor([[rng.random() < 0.15 for _ in range(N)] for _ in range(T)]) & ~terminated
    return rand(), rand(), rand(), terminated, truncated


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_reference_random(seed):
    rng = random.Random(seed)
    T, N, gamma, lam = 12, 4, 0.97, 0.9
    rewards, values, next_values, terminated, truncated = random_batch(rng, T, N)
    adv, ret = compute_gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    for n in range(N):
        ref_adv, ref_ret = ref_gae(
            column(rewards, n),
            column(values, n),
            column(next_values, n),
            column(terminated, n),
            column(truncated, n),
            [gamma] * T,
            lam,
        )
        assert adv[:, n].tolist() == pytest.approx(ref_adv, abs=1e-10)
        assert ret[:, n].tolist() == pytest.approx(ref_ret, abs=1e-10)


def test_truncation_bootstraps_termination_does_not():
    # Env 0 terminates at t=1, env 1 is truncated at t=1; both reset and run on (partial reset).
    # With lam=1 the return is the discounted sum up to the episode end (+ gamma * V_final on
    # truncation), and nothing from the next episode leaks in.
    gamma = 0.5
    rewards = torch.tensor([[1.0, 1.0], [2.0, 2.0], [100.0, 100.0]], dtype=torch.float64)
    values = torch.zeros(3, 2, dtype=torch.float64)
    next_values = torch.tensor([[0.0, 0.0], [8.0, 8.0], [4.0, 4.0]], dtype=torch.float64)
    terminated = torch.tensor([[False, False], [True, False], [False, False]])
    truncated = torch.tensor([[False, False], [False, True], [False, False]])
    _, ret = compute_gae(rewards, values, next_values, terminated, truncated, gamma, 1.0)
    assert ret[:, 0].tolist() == pytest.approx([1 + 0.5 * 2, 2, 100 + 0.5 * 4])
    assert ret[:, 1].tolist() == pytest.approx([1 + 0.5 * (2 + 0.5 * 8), 2 + 0.5 * 8, 100 + 0.5 * 4])


def test_gae_lam_zero_is_one_step_td():
    rng = random.Random(7)
    rewards, values, next_values, terminated, truncated = random_batch(rng, 6, 3)
    adv, _ = compute_gae(rewards, values, next_values, terminated, truncated, 0.9, 0.0)
    boot = torch.where(terminated, torch.zeros_like(next_values), next_values)
    assert torch.allclose(adv, rewards + 0.9 * boot - values)


def chunk_batch(rng, T, N, C):
    """Per-action rewards with episodes that may end inside a chunk (padded after)."""
    rewards = uniform(rng, T, N, C)
    n_valid = [[C for _ in range(N)] for _ in range(T)]
    terminated = [[False] * N for _ in range(T)]
    truncated = [[False] * N for _ in range(T)]
    for t in range(T):
        for n in range(N):
            u = rng.random()
            if u < 0.3:
                n_valid[t][n] = rng.randint(1, C)
                terminated[t][n] = u < 0.15
                truncated[t][n] = u >= 0.15
    mask = torch.tensor([[[k < n_valid[t][n] for k in range(C)] for n in range(N)] for t in range(T)])
    return rewards, mask, torch.tensor(terminated), torch.tensor(truncated)


@pytest.mark.parametrize("seed", range(3))
def test_chunk_rewards_reference(seed):
    rng = random.Random(seed)
    gamma = 0.9
    rewards, mask, _, _ = chunk_batch(rng, 5, 3, 4)
    reward, discount = chunk_rewards(rewards, mask, gamma)
    for t in range(5):
        for n in range(3):
            total, g = 0.0, 1.0
            for k in range(4):
                if mask[t, n, k]:
                    total += g * float(rewards[t, n, k])
                    g *= gamma
            assert float(reward[t, n]) == pytest.approx(total)
            assert float(discount[t, n]) == pytest.approx(g)


@pytest.mark.parametrize("seed", range(3))
def test_chunk_gae_lam_one_equals_per_action_monte_carlo(seed):
    # Chunk-level GAE with gamma**n_valid per step must give, at lam=1 and zero values, the
    # per-env-step discounted return, bootstrapping V_final at the exact step a time limit hit.
    rng = random.Random(seed)
    T, N, C, gamma = 6, 3, 4, 0.9
    rewards, mask, terminated, truncated = chunk_batch(rng, T, N, C)
    final_values = uniform(rng, T, N)
    reward, discount = chunk_rewards(rewards, mask, gamma)
    values = torch.zeros(T, N, dtype=torch.float64)
    # next_values[t] = V(s_{t+1}) = 0 inside an episode; V(final obs) at a done or the last step.
    bootstrap_at = terminated | truncated
    bootstrap_at[-1] = True
    next_values = torch.where(bootstrap_at, final_values, values)
    _, ret = compute_gae(reward, values, next_values, terminated, truncated, discount, 1.0)
    for n in range(N):
        # Flat list of env steps; the last step of each chunk carries the chunk's flags.
        steps = []
        for t in range(T):
            valid = [k for k in range(C) if mask[t, n, k]]
            for k in valid:
                last = k == valid[-1]
                steps.append(
                    (
                        t,
                        float(rewards[t, n, k]),
                        last,
                        bool(terminated[t, n]) and last,
                        bool(truncated[t, n]) and last,
                        float(final_values[t, n]),
                    )
                )
        running, expected = 0.0, {}
        for t, r, last, term, trunc, v_final in reversed(steps):
            if term:
                running = 0.0
            elif trunc or (last and t == T - 1):
                running = v_final  # time limit or end of rollout: bootstrap
            running = r + gamma * running
            expected[t] = running  # first action of the chunk is written last
        assert ret[:, n].tolist() == pytest.approx([expected[t] for t in range(T)], abs=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_action_level_gae_reference(seed):
    rng = random.Random(seed)
    T, N, C, gamma, lam = 5, 3, 3, 0.95, 0.8
    rewards, mask, terminated, truncated = chunk_batch(rng, T, N, C)
    values = uniform(rng, T, N, C)
    next_values = uniform(rng, T, N)
    rewards[~mask] = float("nan")  # padding must never be read
    values[~mask] = float("nan")
    adv, ret = action_level_gae(rewards, values, next_values, mask, terminated, truncated, gamma, lam)
    for n in range(N):
        index, r, v, nv, term, trunc = [], [], [], [], [], []
        for t in range(T):
            valid = [k for k in range(C) if mask[t, n, k]]
            for i, k in enumerate(valid):
                last = i == len(valid) - 1
                index.append((t, k))
                r.append(float(rewards[t, n, k]))
                v.append(float(values[t, n, k]))
                nv.append(float(next_values[t, n]) if last else float(values[t, n, valid[i + 1]]))
                term.append(last and bool(terminated[t, n]))
                trunc.append(last and bool(truncated[t, n]))
        ref_adv, ref_ret = ref_gae(r, v, nv, term, trunc, [gamma] * len(r), lam)
        for (t, k), a, g in zip(index, ref_adv, ref_ret):
            assert float(adv[t, n, k]) == pytest.approx(a, abs=1e-10)
            assert float(ret[t, n, k]) == pytest.approx(g, abs=1e-10)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_flatten_roundtrip_and_expand():
    x = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    flat = flatten_chunks(x)
    assert flat.shape == (8, 3)
    assert flat[1 * 4 + 2, 1] == x[1, 1, 2]  # action k of chunk t sits at row t*C + k
    assert torch.equal(unflatten_chunks(flat, 4), x)
    e = expand_chunk(torch.tensor([[1.0, 2.0]]), 3)
    assert e.shape == (1, 2, 3) and e[0, 1].tolist() == [2.0, 2.0, 2.0]


def ref_vtrace_advantage(deltas, gammas, done, traces, lam, s):
    """V-trace's advantage of step s written as its sum (not the recursion): sum over t >= s up to the end of the
    episode of (gamma lam)^(t - s) x the traces of steps s+1 .. t x delta_t (gammas per step)."""
    total, weight = 0.0, 1.0
    for t in range(s, len(deltas)):
        if t > s:
            weight *= gammas[t - 1] * lam * traces[t]
        total += weight * deltas[t]
        if done[t]:
            break
    return total


@pytest.mark.parametrize("seed", range(3))
def test_traced_gae_is_the_vtrace_sum(seed):
    rng = random.Random(seed)
    T, N, gamma, lam = 10, 3, 0.97, 0.9
    rewards, values, next_values, terminated, truncated = random_batch(rng, T, N)
    traces = uniform(rng, T, N).abs()  # in [0, 1]
    adv, ret = compute_gae(rewards, values, next_values, terminated, truncated, gamma, lam, traces)
    assert torch.equal(ret, adv + values)
    for n in range(N):
        done = [bool(terminated[t, n] or truncated[t, n]) for t in range(T)]
        boot = [0.0 if terminated[t, n] else float(next_values[t, n]) for t in range(T)]
        deltas = [float(rewards[t, n]) + gamma * boot[t] - float(values[t, n]) for t in range(T)]
        want = [ref_vtrace_advantage(deltas, [gamma] * T, done, column(traces, n), lam, s) for s in range(T)]
        assert adv[:, n].tolist() == pytest.approx(want, abs=1e-10)
    plain = compute_gae(rewards, values, next_values, terminated, truncated, gamma, lam)[0]
    ones = compute_gae(rewards, values, next_values, terminated, truncated, gamma, lam, torch.ones(T, N))[0]
    assert torch.equal(ones, plain)  # fresh samples: traces of 1 are plain GAE


def test_vtrace_traces_per_decision_and_per_action():
    from vlaslurm.algos.offpolicy import vtrace_traces

    behaviour = torch.zeros(1, 2, 3)
    proximal = torch.tensor([[[-0.5, 0.2, 9.0], [0.3, 0.4, 0.0]]])
    mask = torch.tensor([[[True, True, False], [True, True, True]]])  # the first chunk's third action not executed
    per_decision = vtrace_traces(proximal, behaviour, mask, per_action=False)
    assert per_decision[0].tolist() == pytest.approx([math.exp(-0.3), 1.0])  # the chunk's ratios multiplied, capped
    per_action = vtrace_traces(proximal, behaviour, mask, per_action=True)
    assert per_action[0].flatten().tolist() == pytest.approx([math.exp(-0.5), 1.0, 1.0, 1.0, 1.0, 1.0])
    tokens = torch.stack([proximal, proximal], dim=-1) / 2  # two action dimensions, their log-probs summed
    assert torch.allclose(vtrace_traces(tokens, torch.zeros(1, 2, 3, 2), mask, per_action=False), per_decision)


def test_action_level_traces_weigh_each_action():
    """A zero trace on an action stops what follows it from reaching the actions before it; ones change nothing."""
    T, N, C = 2, 1, 2
    rewards = torch.tensor([[[1.0, 2.0]], [[4.0, 8.0]]])
    values = torch.zeros(T, N, C)
    mask = torch.ones(T, N, C, dtype=torch.bool)
    flags = torch.zeros(T, N, dtype=torch.bool)
    args = (rewards, values, torch.zeros(T, N), mask, flags, flags, 1.0, 1.0)
    plain = action_level_gae(*args)[0]
    assert torch.equal(action_level_gae(*args, torch.ones(T, N, C))[0], plain)
    assert plain.flatten().tolist() == [15.0, 14.0, 12.0, 8.0]  # lam = gamma = 1: rewards-to-go over actions
    cut = torch.ones(T, N, C)
    cut[1, 0, 0] = 0.0  # the second chunk's first action: the current policy would not take it
    assert action_level_gae(*args, cut)[0].flatten().tolist() == [3.0, 2.0, 12.0, 8.0]
