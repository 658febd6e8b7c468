"""GRPO advantages, filters and loss against plain Python loops."""

import math
import random

import pytest
import torch

from vlaslurm.algos import (
    group_advantages,
    group_advantages_per_step,
    grpo_policy_loss,
    policy_loss,
    reward_to_go,
    success_filter_mask,
    valid_action_mask,
)

EPS = 1e-6


def ref_group_norm(values, groups, eps=EPS):
    """Normalise each value within its group (population std); dict-of-lists version."""
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(values)
    for idx in members.values():
        xs = [values[i] for i in idx]
        mu = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))
        for i in idx:
            out[i] = 0.0 if std <= eps else (values[i] - mu) / (std + eps)
    return out


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_reference_uneven_groups(seed):
    rng = random.Random(seed)
    # Groups of sizes 1..6 with non-contiguous, shuffled, non-consecutive ids.
    groups = [g * 7 + 3 for g, size in enumerate(range(1, 7)) for _ in range(size)]
    rng.shuffle(groups)
    returns = [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in groups]
    adv = group_advantages(t64(returns), torch.tensor(groups))
    assert adv.tolist() == pytest.approx(ref_group_norm(returns, groups), abs=1e-9)


def test_zero_std_groups_get_zero_advantage():
    returns = t64([1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])  # all-success, equal floats, mixed, singleton
    adv = group_advantages(returns, groups)
    assert adv[:6].tolist() == [0.0] * 6 and adv[8] == 0.0
    assert adv[6:8].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_group_advantages_per_step_reference(seed):
    rng = random.Random(seed)
    N, T = 9, 5
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    lengths = [rng.randint(0, T) for _ in range(N)]
    returns = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(N)]
    mask = valid_action_mask(torch.tensor(lengths), T)
    adv = group_advantages_per_step(t64(returns), torch.tensor(groups), mask)
    for t in range(T):
        running = [n for n in range(N) if t < lengths[n]]
        ref = ref_group_norm([returns[n][t] for n in running], [groups[n] for n in running])
        for n, a in zip(running, ref):
            assert float(adv[n, t]) == pytest.approx(a, abs=1e-9)
        for n in set(range(N)) - set(running):
            assert float(adv[n, t]) == 0.0


def test_reward_to_go_reference():
    rewards = [[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]]
    lengths, gamma = [3, 2], 0.5
    out = reward_to_go(t64(rewards), valid_action_mask(torch.tensor(lengths), 3), gamma)
    for n in range(2):
        for t in range(3):
            ref = sum(gamma ** (k - t) * rewards[n][k] for k in range(t, lengths[n]))
            assert float(out[n, t]) == pytest.approx(ref)


def test_success_filter_boundaries():
    # Success rates: g0 = 0, g1 = 1/4, g2 = 1/2, g3 = 1, g4 = 1/3 (3 members), g5 = 2/3.
    success = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]
    groups = [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4, 5, 5, 5, 0]
    g = torch.tensor(groups)
    s = torch.tensor(success, dtype=torch.bool)

    def kept(low, high):
        keep = success_filter_mask(s, g, low, high)
        return sorted({groups[i] for i in range(len(groups)) if keep[i]})

    assert kept(0.25, 0.5) == [1, 2, 4]  # both ends inclusive
    assert kept(1 / 3, 2 / 3) == [2, 4, 5]
    assert kept(0.0, 1.0) == [0, 1, 2, 3, 4, 5]
    assert kept(0.26, 0.49) == [4]
    keep = success_filter_mask(s, g, 0.25, 0.5)
    assert all(bool(keep[i]) == (groups[i] in (1, 2, 4)) for i in range(len(groups)))


def test_valid_action_mask():
    m = valid_action_mask(torch.tensor([0, 2, 4]), 4)
    assert m.tolist() == [[False] * 4, [True, True, False, False], [True] * 4]


def ref_grpo_loss(new, old, adv, lengths, low, high):
    per_traj = []
    for n in range(len(new)):
        if lengths[n] == 0:
            continue  # no valid step: not part of the average
        total = 0.0
        for t in range(lengths[n]):
            a = adv[n] if not isinstance(adv[n], list) else adv[n][t]
            r = math.exp(new[n][t] - old[n][t])
            total += min(r * a, max(1 - low, min(1 + high, r)) * a)
        per_traj.append(-total / lengths[n])
    return sum(per_traj) / len(per_traj)


@pytest.mark.parametrize("seed", range(4))
def test_grpo_policy_loss_reference(seed):
    rng = random.Random(seed)
    N, T, low, high = 6, 7, 0.2, 0.28
    lengths = [rng.randint(1, T) for _ in range(N)]
    lengths[2] = 0  # an all-masked row
    old = [[rng.uniform(-2, 0) for _ in range(T)] for _ in range(N)]
    new = [[o + rng.uniform(-0.4, 0.4) for o in row] for row in old]
    mask = valid_action_mask(torch.tensor(lengths), T)
    adv_episode = [rng.uniform(-1, 1) for _ in range(N)]
    adv_step = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(N)]
    for adv in (adv_episode, adv_step):
        loss, stats = grpo_policy_loss(t64(new), t64(old), t64(adv), mask, low, high)
        assert loss.item() == pytest.approx(ref_grpo_loss(new, old, adv, lengths, low, high))
        # Same thing through the off-policy entry point with no staleness.
        a = t64(adv) if isinstance(adv[0], list) else t64(adv).unsqueeze(-1)
        loss2, _ = policy_loss(t64(new), t64(old), t64(old), a, low, high, "decoupled", 2.0, mask, "sequence")
        assert loss2.item() == pytest.approx(loss.item())


def test_grpo_short_and_long_trajectories_weigh_the_same():
    # One trajectory of 1 step and one of 4 steps: each contributes half of the loss.
    lengths = torch.tensor([1, 4])
    mask = valid_action_mask(lengths, 4)
    zeros = torch.zeros(2, 4, dtype=torch.float64)
    loss, _ = grpo_policy_loss(zeros, zeros, t64([1.0, 3.0]), mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-(1.0 + 3.0) / 2)
    all_masked = torch.zeros(2, 4, dtype=torch.bool)
    loss, _ = grpo_policy_loss(zeros, zeros, t64([1.0, 3.0]), all_masked, 0.2, 0.2)
    assert loss.item() == 0.0
