"""The denoising path of a flow-matching policy and its log-density: the πRL samplers, as pure torch functions.

Time runs from t = 1 (noise) to t = 0 (actions) on the grid t_k = 1 - k/K, k = 0..K, with dt = -1/K, and the
model's velocity v_k = v(x_k, t_k) points from actions to noise (transformers' PI0: x_t = t eps + (1 - t) a).
A step is an ODE step x_{k+1} = x_k + dt v_k, or a stochastic step x_{k+1} ~ N(mean_k, std_k^2 I):

- Flow-SDE: the reverse SDE with the ODE's marginals, Euler-Maruyama discretised (as Flow-GRPO and πRL):
  mean_k = x_k + dt [v_k + s_k^2 / (2 t_k) (x_k + (1 - t_k) v_k)], std_k = s_k sqrt(|dt|),
  s_k = a sqrt(t'/(1 - t')) with a = `noise_level` and t' = min(t_k, 1 - 1/(2K)) (the ratio is infinite at t = 1).
- Flow-Noise: mean_k = x_k + dt v_k, std_k = lo + (hi - lo) sigmoid(noise head) per element, in
  [`noise_min`, `noise_max`], learned with the policy.

The log-prob of a sample is that of its path: the sum over its stochastic steps of the Gaussian transition
log-densities (ODE steps are deterministic given the path, and the initial noise's N(0, I) density does not
depend on the weights, so neither enters). Flow-Noise makes all K steps stochastic, Flow-SDE `sde_steps` of them,
drawn per sample. Details: docs/models.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Literal, Optional, Tuple

import torch

from vlaslurm.spec.model_types import flow_problem

Method = Literal["flow_noise", "flow_sde"]
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class FlowSettings:
    """How a chunk is denoised and which steps are stochastic (the spec's `model.*` fields of the same names)."""

    denoise_steps: int = 10
    noise_method: Method = "flow_sde"
    sde_steps: int = 1
    noise_level: float = 0.5
    noise_min: float = 0.08
    noise_max: float = 0.16

    def __post_init__(self) -> None:
        problem = flow_problem(self)
        if problem is not None:
            raise ValueError(f"model.{problem[0]}: {problem[1]}")

    @property
    def stochastic(self) -> int:
        """Stochastic steps per sample."""
        return self.denoise_steps if self.noise_method == "flow_noise" else self.sde_steps

    @property
    def dt(self) -> float:
        return -1.0 / self.denoise_steps


def times(settings: FlowSettings, device: torch.device) -> torch.Tensor:
    """float32 [K + 1]: t_k = 1 - k / K."""
    steps = settings.denoise_steps
    return 1.0 - torch.arange(steps + 1, dtype=torch.float32, device=device) / steps


# --- one step ---------------------------------------------------------------------------------------------------


def sde_scale(settings: FlowSettings, t: torch.Tensor) -> torch.Tensor:
    """s(t) = a sqrt(t' / (1 - t')), t' = min(t, 1 - 1/(2K)); t [B] -> [B]."""
    clipped = t.clamp(max=1.0 - 0.5 / settings.denoise_steps)
    return settings.noise_level * (clipped / (1.0 - clipped)).sqrt()


def ode_step(settings: FlowSettings, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return x + settings.dt * v


def transition(
    settings: FlowSettings, x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, noise_raw: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of a stochastic step from x [B, ...] with velocity v [B, ...] at times t [B]; `noise_raw`
    [B, ...] is the noise head's output (Flow-Noise only). std broadcasts against mean."""
    if settings.noise_method == "flow_noise":
        if noise_raw is None:
            raise ValueError("flow_noise needs the noise head's output")
        return ode_step(settings, x, v), noise_std(settings, noise_raw)
    shape = (-1,) + (1,) * (x.ndim - 1)
    scale, tt = sde_scale(settings, t).view(shape), t.view(shape)
    drift = v + scale.pow(2) / (2 * tt) * (x + (1 - tt) * v)
    return x + settings.dt * drift, scale * math.sqrt(-settings.dt)


def noise_std(settings: FlowSettings, raw: torch.Tensor) -> torch.Tensor:
    """The learned std in [noise_min, noise_max]."""
    return settings.noise_min + (settings.noise_max - settings.noise_min) * torch.sigmoid(raw)


def gaussian_logdensity(y: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(y; mean, std^2)."""
    std = std.expand_as(mean)
    return -0.5 * ((y - mean) / std).pow(2) - std.log() - HALF_LOG_2PI


def gaussian_entropy(std: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Elementwise entropy of N(., std^2), shaped as `like`."""
    return (0.5 + HALF_LOG_2PI + std.log()).expand_as(like)


# --- the draws of one sample ------------------------------------------------------------------------------------


@dataclass
class Draws:
    """What a sample's randomness decides: the initial noise, each step's noise, which steps are stochastic."""

    initial: torch.Tensor  # float32 [B, chunk, D]
    noise: torch.Tensor  # float32 [B, K, chunk, D]: the standard normal of step k (used if k is stochastic)
    steps: torch.Tensor  # int64 [B, S]: the stochastic steps, ascending


def draw(
    settings: FlowSettings, seeds: Optional[torch.Tensor], batch: int, chunk: int, dim: int, device: torch.device
) -> Draws:
    """Each row from its own seed when given (a sample does not depend on its batch), else from torch's RNG."""
    K, S = settings.denoise_steps, settings.stochastic
    rows: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for b in range(batch):
        gen = None if seeds is None else torch.Generator().manual_seed(int(seeds[b]))
        normals = torch.randn(K + 1, chunk, dim, generator=gen)
        steps = torch.randperm(K, generator=gen)[:S].sort().values if S < K else torch.arange(K)
        rows.append((normals, steps))
    if not rows:
        empty = torch.zeros(0, K + 1, chunk, dim)
        return Draws(empty[:, 0].to(device), empty[:, 1:].to(device), torch.zeros(0, S, dtype=torch.long))
    normals = torch.stack([r[0] for r in rows]).to(device)
    return Draws(normals[:, 0], normals[:, 1:], torch.stack([r[1] for r in rows]).to(device))


def stochastic_mask(steps: torch.Tensor, denoise_steps: int) -> torch.Tensor:
    """bool [B, K]: whether step k of each row is stochastic."""
    mask = torch.zeros(steps.shape[0], denoise_steps, dtype=torch.bool, device=steps.device)
    return mask.scatter(1, steps, True)
