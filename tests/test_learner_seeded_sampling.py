"""Per-item sampling seeds: a sampled action depends on its observation and seed only, not on the batch
it was served in (the generator batches requests as they come), for both policies."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from vlaslurm.envs.toy import make as make_toy
from vlaslurm.models import PolicyInput, build_policy
from vlaslurm.spec.env_types import ToyEnvConfig
from vlaslurm.spec.model_types import OpenVLAConfig, OpenVLAOFTConfig


@pytest.mark.parametrize("cls,kind", [(OpenVLAOFTConfig, "openvla-oft"), (OpenVLAConfig, "openvla")])
def test_seeded_samples_do_not_depend_on_the_batch(cls, kind):
    torch.set_num_threads(1)
    policy = build_policy(cls(type=kind, action_chunk=2), action_dim=2, state_dim=2, image_size=32, num_cameras=1)
    obs = make_toy(ToyEnvConfig(type="toy"), num_envs=4, seed=0).reset(range(4), seeds=range(4))

    def inp(idx, seeds):
        return PolicyInput(
            torch.from_numpy(obs.images[idx]),
            torch.from_numpy(obs.state[idx]),
            [obs.instructions[i] for i in idx],
            torch.tensor(seeds),
        )

    torch.manual_seed(0)
    full = policy.act(inp([0, 1, 2, 3], [5, 6, 7, 8]))
    torch.manual_seed(1)  # the process RNG must not matter
    part = policy.act(inp([2, 3], [7, 8]))
    torch.testing.assert_close(full.actions[2:], part.actions, atol=1e-5, rtol=1e-5)  # batched maths: last bits
    torch.testing.assert_close(full.logprob[2:], part.logprob, atol=1e-5, rtol=1e-5)
    other = policy.act(inp([0, 1, 2, 3], [9, 10, 11, 12]))
    assert (full.actions - other.actions).abs().max() > 1e-3
    torch.testing.assert_close(
        policy.evaluate(inp([0, 1, 2, 3], [5, 6, 7, 8]), full.actions).logprob, full.logprob, atol=1e-4, rtol=1e-4
    )
