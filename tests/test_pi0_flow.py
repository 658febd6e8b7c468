"""The πRL samplers' maths (vlaslurm/models/pi0/flow.py), without a model: each Gaussian transition is a density,
the draws are a function of the seed alone, and the settings are checked as the spec checks them. Wall time ~1 s."""

from __future__ import annotations

import pytest
import torch

from vlaslurm.models.pi0.flow import (
    FlowSettings,
    Method,
    draw,
    gaussian_logdensity,
    ode_step,
    sde_scale,
    stochastic_mask,
    times,
    transition,
)


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
@pytest.mark.parametrize("k", [0, 2, 3])
def test_each_transition_density_integrates_to_one(method: Method, k: int) -> None:
    """A 1-D case: x, v and the noise head's output fixed, the density of x_{k+1} integrated on a fine grid."""
    s = FlowSettings(denoise_steps=4, noise_method=method, sde_steps=2)
    x, v, raw = torch.tensor([0.7], dtype=torch.float64), torch.tensor([-1.3], dtype=torch.float64), torch.tensor([0.4])
    t = times(s, torch.device("cpu"))[k : k + 1].double()
    mean, std = transition(s, x, v, t, raw.double())
    grid = torch.linspace(float(mean) - 12 * float(std), float(mean) + 12 * float(std), 200_001, dtype=torch.float64)
    density = gaussian_logdensity(grid, mean.expand_as(grid), std.expand_as(grid)).exp()
    assert torch.trapezoid(density, grid).item() == pytest.approx(1.0, abs=1e-6)
    assert float(std) > 0


def test_sde_mean_is_the_ode_step_plus_the_score_correction() -> None:
    """The SDE's mean moves off the ODE step by dt s^2 / (2t) (x + (1-t) v); with a tiny noise level it is the ODE."""
    x, v, t = torch.tensor([[0.5, -0.2]]), torch.tensor([[1.0, 2.0]]), torch.tensor([0.5])
    quiet = FlowSettings(denoise_steps=5, noise_level=1e-4)
    mean, std = transition(quiet, x, v, t, None)
    assert torch.allclose(mean, ode_step(quiet, x, v), atol=1e-6) and float(std.max()) < 1e-4
    loud = FlowSettings(denoise_steps=5, noise_level=0.8)
    mean, std = transition(loud, x, v, t, None)
    s2 = sde_scale(loud, t) ** 2
    expected = x + loud.dt * (v + s2 / (2 * t) * (x + (1 - t) * v))
    assert torch.allclose(mean, expected) and torch.allclose(std, (s2 * 0.2).sqrt().view(1, 1))


def test_noise_std_stays_within_its_bounds() -> None:
    s = FlowSettings(noise_method="flow_noise", noise_min=0.1, noise_max=0.3)
    _, std = transition(s, torch.zeros(3), torch.zeros(3), torch.ones(3), torch.tensor([-1e4, 0.0, 1e4]))
    assert torch.allclose(std, torch.tensor([0.1, 0.2, 0.3]))


def test_draws_are_a_function_of_each_rows_seed() -> None:
    s = FlowSettings(denoise_steps=6, sde_steps=2)
    both = draw(s, torch.tensor([7, 8]), 2, 3, 2, torch.device("cpu"))
    alone = draw(s, torch.tensor([8]), 1, 3, 2, torch.device("cpu"))
    assert torch.equal(both.initial[1], alone.initial[0]) and torch.equal(both.noise[1], alone.noise[0])
    assert torch.equal(both.steps[1], alone.steps[0]) and not torch.equal(both.initial[0], both.initial[1])
    assert both.steps.shape == (2, 2) and bool((both.steps[:, 1] > both.steps[:, 0]).all())
    assert stochastic_mask(both.steps, 6).sum(1).tolist() == [2, 2]
    every = draw(FlowSettings(denoise_steps=3, noise_method="flow_noise"), None, 2, 1, 1, torch.device("cpu"))
    assert every.steps.tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"denoise_steps": 0}, "denoise_steps"),
        ({"denoise_steps": 3, "sde_steps": 4}, "sde_steps"),
        ({"noise_level": 0.0}, "noise_level"),
        ({"noise_min": 0.3, "noise_max": 0.2}, "noise_min"),
        ({"noise_method": "ddim"}, "noise_method"),
    ],
)
def test_settings_name_the_field_to_fix(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"model.{field}"):
        FlowSettings(**fields)
