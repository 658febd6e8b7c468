"""PPO losses and off-policy corrections against plain Python loops."""

import math
import random

import pytest
import torch

from vlaslurm.algos import (
    entropy_bonus,
    explained_variance,
    masked_mean,
    policy_loss,
    ppo_policy_loss,
    value_loss,
)


def clip(x, low, high):
    return max(low, min(high, x))


def ref_ppo(new, old, adv, mask, low, high, weight=None):
    """Loss, d loss / d new, approx_kl, clipfrac over flat lists of floats."""
    n_valid = sum(mask)
    weight = weight or [1.0] * len(new)
    loss, grads, kl, clipped = 0.0, [], 0.0, 0
    for n, o, a, m, w in zip(new, old, adv, mask, weight):
        r = math.exp(n - o)
        unclipped, clipped_obj = r * a, clip(r, 1 - low, 1 + high) * a
        if not m:
            grads.append(0.0)
            continue
        loss -= w * min(unclipped, clipped_obj) / n_valid
        # The gradient flows only through the unclipped branch, when it is the minimum.
        grads.append(-w * r * a / n_valid if unclipped <= clipped_obj else 0.0)
        kl += ((r - 1) - (n - o)) / n_valid
        clipped += r < 1 - low or r > 1 + high
    return loss, grads, kl, clipped / n_valid


def random_case(rng, size, spread=0.4):
    old = [rng.uniform(-2, 0) for _ in range(size)]
    new = [o + rng.uniform(-spread, spread) for o in old]
    adv = [rng.uniform(-1, 1) for _ in range(size)]
    mask = [rng.random() < 0.8 for _ in range(size)]
    mask[0] = True
    return new, old, adv, mask


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(5))
def test_ppo_policy_loss_reference(seed):
    rng = random.Random(seed)
    new, old, adv, mask = random_case(rng, 40)
    low, high = 0.2, 0.28
    new_t = t64(new).requires_grad_()
    loss, stats = ppo_policy_loss(new_t, t64(old), t64(adv), low, high, torch.tensor(mask))
    loss.backward()
    ref_loss, ref_grad, ref_kl, ref_clipfrac = ref_ppo(new, old, adv, mask, low, high)
    assert loss.item() == pytest.approx(ref_loss)
    assert new_t.grad.tolist() == pytest.approx(ref_grad, abs=1e-12)
    assert float(stats["losses/approx_kl"]) == pytest.approx(ref_kl)
    assert float(stats["losses/clipfrac"]) == pytest.approx(ref_clipfrac)
    assert float(stats["losses/policy_loss"]) == pytest.approx(ref_loss)


def test_asymmetric_clip_zeroes_gradient_in_clipped_region():
    low, high = 0.1, 0.3
    # ratio 1.35 > 1 + high with A > 0: clipped. ratio 0.85 < 1 - low with A < 0: clipped.
    # ratio 1.2 inside [0.9, 1.3]: not clipped (it would be with a symmetric 0.1 clip).
    # ratio 1.35 with A < 0 and 0.85 with A > 0: the pessimistic min keeps the gradient.
    ratios = [1.35, 0.85, 1.2, 1.35, 0.85]
    adv = [1.0, -1.0, 1.0, -1.0, 1.0]
    new = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_policy_loss(new, torch.zeros(5, dtype=torch.float64), t64(adv), low, high)
    loss.backward()
    g = new.grad.tolist()
    assert g[0] == 0.0 and g[1] == 0.0
    assert g[2:] == pytest.approx([-1.2 / 5, 1.35 / 5, -0.85 / 5])
    assert float(stats["losses/clipfrac"]) == pytest.approx(4 / 5)


def test_all_masked_is_zero_and_finite():
    new = torch.tensor([[0.1, float("nan")], [0.3, 50.0]], requires_grad=True)
    old = torch.zeros(2, 2)
    mask = torch.zeros(2, 2, dtype=torch.bool)
    loss, stats = ppo_policy_loss(new, old, torch.ones(2, 2), 0.2, 0.2, mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(new.grad, torch.zeros(2, 2))
    assert all(math.isfinite(float(v)) for v in stats.values())
    # A fully padded row next to a valid one: the padded nan/huge entries do not leak.
    mask = torch.tensor([[True, False], [False, False]])
    loss, _ = ppo_policy_loss(new, old, torch.ones(2, 2), 0.2, 0.2, mask)
    assert loss.item() == pytest.approx(-math.exp(0.1))


def test_masked_mean_reference():
    x = t64([1.0, 2.0, 3.0, 4.0])
    assert float(masked_mean(x, torch.tensor([True, False, True, False]))) == pytest.approx(2.0)
    assert float(masked_mean(x)) == pytest.approx(2.5)


@pytest.mark.parametrize("seed", range(3))
def test_value_loss_reference(seed):
    rng = random.Random(seed)
    size, c = 30, 0.2
    new = [rng.uniform(-1, 1) for _ in range(size)]
    old = [v + rng.uniform(-0.5, 0.5) for v in new]
    ret = [rng.uniform(-1, 1) for _ in range(size)]
    mask = [rng.random() < 0.7 for _ in range(size)]
    plain = sum(0.5 * (v - r) ** 2 for v, r, m in zip(new, ret, mask) if m) / sum(mask)
    clipped_ref = 0.0
    for v, o, r, m in zip(new, old, ret, mask):
        if m:
            vc = o + clip(v - o, -c, c)
            clipped_ref += 0.5 * max((v - r) ** 2, (vc - r) ** 2) / sum(mask)
    m = torch.tensor(mask)
    assert float(value_loss(t64(new), t64(ret), mask=m)) == pytest.approx(plain)
    assert float(value_loss(t64(new), t64(ret), t64(old), c, m)) == pytest.approx(clipped_ref)


def test_entropy_and_explained_variance():
    ent = t64([1.0, 2.0, 6.0])
    assert float(entropy_bonus(ent, torch.tensor([True, True, False]))) == pytest.approx(1.5)
    y_true, y_pred = [1.0, 2.0, 4.0, 7.0], [1.5, 2.0, 3.0, 7.5]

    def var(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    ref = 1 - var([t - p for t, p in zip(y_true, y_pred)]) / var(y_true)
    assert explained_variance(t64(y_pred), t64(y_true)) == pytest.approx(ref)
    assert explained_variance(t64(y_true), t64(y_true)) == pytest.approx(1.0)
    keep = torch.tensor([True] * 4 + [False])
    masked = explained_variance(t64(y_pred + [99.0]), t64(y_true + [-99.0]), keep)
    assert masked == pytest.approx(ref)
    assert math.isnan(explained_variance(t64([1.0, 2.0]), t64([3.0, 3.0])))


@pytest.mark.parametrize("seed", range(3))
def test_decoupled_equals_standard_when_behaviour_is_proximal(seed):
    rng = random.Random(seed)
    new, old, adv, mask = random_case(rng, 25)
    args = (t64(old), t64(old), t64(adv), 0.2, 0.28)
    grads = []
    for correction in ("none", "decoupled"):
        new_t = t64(new).requires_grad_()
        loss, _ = policy_loss(new_t, *args, correction, tis_cap=2.0, mask=torch.tensor(mask))
        loss.backward()
        grads.append((loss.item(), new_t.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0])
    assert torch.allclose(grads[0][1], grads[1][1])


@pytest.mark.parametrize("seed", range(4))
def test_decoupled_reference(seed):
    rng = random.Random(seed)
    new, prox, adv, mask = random_case(rng, 30)
    behav = [p + rng.uniform(-1.0, 1.0) for p in prox]  # stale: some weights exceed the cap
    cap = 1.5
    weight = [min(math.exp(p - b), cap) for p, b in zip(prox, behav)]
    ref_loss, ref_grad, ref_kl, ref_clipfrac = ref_ppo(new, prox, adv, mask, 0.2, 0.2, weight)
    new_t = t64(new).requires_grad_()
    loss, stats = policy_loss(new_t, t64(prox), t64(behav), t64(adv), 0.2, 0.2, "decoupled", cap, torch.tensor(mask))
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss)
    assert new_t.grad.tolist() == pytest.approx(ref_grad, abs=1e-12)
    assert float(stats["losses/approx_kl"]) == pytest.approx(ref_kl)  # measured against proximal
    assert float(stats["losses/clipfrac"]) == pytest.approx(ref_clipfrac)
    valid = [w for w, m in zip(weight, mask) if m]
    assert float(stats["losses/is_weight"]) == pytest.approx(sum(valid) / len(valid))
    assert float(stats["losses/is_capfrac"]) == pytest.approx(
        sum(math.exp(p - b) > cap for p, b, m in zip(prox, behav, mask) if m) / len(valid)
    )


@pytest.mark.parametrize("seed", range(3))
def test_tis_reference(seed):
    rng = random.Random(seed)
    new, behav, adv, mask = random_case(rng, 30, spread=1.5)
    cap, n_valid = 2.0, sum(mask)
    ref_loss, ref_grad = 0.0, []
    for n, b, a, m in zip(new, behav, adv, mask):
        w = min(math.exp(n - b), cap)
        ref_loss -= w * a / n_valid if m else 0.0
        ref_grad.append(-w * a / n_valid if m else 0.0)  # d/dnew of -w*A*log pi, w held fixed
    new_t = t64(new).requires_grad_()
    prox = torch.full((30,), float("nan"), dtype=torch.float64)  # tis never reads it
    loss, stats = policy_loss(new_t, prox, t64(behav), t64(adv), 0.2, 0.2, "tis", cap, torch.tensor(mask))
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss)
    assert new_t.grad.tolist() == pytest.approx(ref_grad, abs=1e-12)
    assert 0.0 < float(stats["losses/is_capfrac"]) < 1.0


def test_unknown_correction_lists_valid_ones():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="none.*decoupled.*tis"):
        policy_loss(x, x, x, x, 0.2, 0.2, "vtrace", 2.0)


@pytest.mark.parametrize("correction", ["none", "decoupled", "tis"])
def test_padded_nan_entries_do_not_leak_in_any_correction(correction):
    mask = torch.tensor([[True, False], [False, False]])
    nan = float("nan")
    new = torch.tensor([[0.1, nan], [0.3, -math.inf]], requires_grad=True)
    prox = torch.tensor([[0.0, nan], [0.0, 0.0]])
    behav = torch.tensor([[0.0, 0.0], [nan, 0.0]])
    adv = torch.tensor([[1.0, nan], [1.0, nan]])
    loss, stats = policy_loss(new, prox, behav, adv, 0.2, 0.2, correction, 2.0, mask)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()
    assert new.grad[0, 1] == 0 and new.grad[1].eq(0).all() and new.grad[0, 0] != 0
    assert all(math.isfinite(float(v)) for v in stats.values())


def test_decoupled_caps_its_behaviour_weight_with_its_own_cap():
    """The behaviour weight proximal / behaviour = e^2 (7.39): kept under the decoupled cap of 10, cut to 2 by a
    cap of 2; without a weight cap the tis cap applies (the old single knob)."""
    new = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    args = (new, torch.zeros(1, dtype=torch.float64), torch.full((1,), -2.0, dtype=torch.float64), torch.ones(1))
    _, wide = policy_loss(*args, 0.2, 0.2, "decoupled", tis_cap=2.0, weight_cap=10.0)
    _, tight = policy_loss(*args, 0.2, 0.2, "decoupled", tis_cap=2.0, weight_cap=2.0)
    _, fallback = policy_loss(*args, 0.2, 0.2, "decoupled", tis_cap=2.0)
    assert float(wide["losses/is_weight"]) == pytest.approx(math.exp(2.0))
    assert float(wide["losses/is_capfrac"]) == 0.0 and float(tight["losses/is_capfrac"]) == 1.0
    assert float(tight["losses/is_weight"]) == 2.0 == float(fallback["losses/is_weight"])
