"""Real runtime segments for learner tests: the toy env stepped by a tiny policy, cut by `EnvTrack`.

No mocks: `run_chunk` and `EnvTrack` are the simulator's own pieces, so the segments
look exactly like those the trainer receives (episodes in pieces, partial chunks at
an episode's end, a version change cutting a segment mid-episode).
"""

from __future__ import annotations

from typing import Any, Dict, List, cast

import numpy as np
import torch

from vlaslurm.envs.toy import make as make_toy
from vlaslurm.models import PolicyInput, build_policy
from vlaslurm.runtime.episodes import EnvObs, EnvTrack, mix_seed, run_chunk, split_obs, stack_obs
from vlaslurm.runtime.messages import Segment
from vlaslurm.spec.algo_types import GRPOConfig, PPOConfig
from vlaslurm.spec.env_types import ToyEnvConfig
from vlaslurm.spec.model_types import OpenVLAOFTConfig

CHUNK = 4


def tiny_policy(seed: int = 0, std: str = "learned"):
    cfg = OpenVLAOFTConfig(type="openvla-oft", action_chunk=CHUNK, init_seed=seed, std=std)  # type: ignore[arg-type]
    return build_policy(cfg, action_dim=2, state_dim=2, image_size=32, num_cameras=1)


LR = 1e-3  # the learner tests' learning rate (`algo_config`)


def assert_same_update(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], label: str = "") -> None:
    """Parameters after the same update computed two ways (ranks, shards, micro-batches) agree: 99.9% of all
    elements within rtol 1e-4 / atol 2e-6, and every element within 5% of one step (0.05 lr). Adam divides each
    gradient by its own magnitude, so an element whose gradient nearly cancels to zero turns the float noise of
    a different summation order into a visible part of its step; a wrong update moves every element by ~lr."""
    assert set(got) == set(want), f"{label}: {sorted(set(got) ^ set(want))}"
    loose, total = 0, 0
    for name, value in want.items():
        diff = (got[name].float() - value.float()).abs()
        loose += int((diff > 2e-6 + 1e-4 * value.float().abs()).sum())
        total += value.numel()
        assert float(diff.max()) <= 0.05 * LR, f"{label} {name}: differs by {float(diff.max()):.3g} (> 0.05 lr)"
    assert loose <= 1e-3 * total, f"{label}: {loose} of {total} elements differ beyond rtol 1e-4 / atol 2e-6"


def algo_config(kind: str, level: str, minibatches: int = 3):
    """The learner tests' PPO or GRPO (groups of 4) at `algo.logprob_level` `level`: 2 epochs, lr 1e-3. GRPO keeps
    every group on the chunk advantage (the defaults before issue 17), so that every update on these short
    rollouts, whose groups often all fail, moves the parameters."""
    common: Dict[str, Any] = dict(lr=LR, epochs=2, minibatches=minibatches, logprob_level=level)
    if kind == "ppo":
        return PPOConfig(type="ppo", **common)
    return GRPOConfig(type="grpo", group_size=4, success_filter=[0.0, 1.0], advantage="chunk", **common)


def rollout_segments(
    policy,
    num_envs: int = 8,
    chunks: int = 10,
    group_size: int = 1,
    seed: int = 0,
    version_every: int = 0,
    max_len: int = 64,
) -> List[Segment]:
    """`chunks` decision steps of every env; groups of `group_size` envs reset from one seed per episode
    (as the simulator does for GRPO). With `version_every`, the behaviour version goes up every that many
    chunks, which cuts segments mid-episode. Open segments are cut at the end (bootstrapped)."""
    env = make_toy(ToyEnvConfig(type="toy"), num_envs=num_envs, seed=seed)
    clock = iter(range(10**9)).__next__
    tracks = [EnvTrack(i, i, "reach", max_len, lambda: float(clock()), 0) for i in range(num_envs)]

    def reset(ids: List[int]) -> None:
        seeds = [mix_seed(seed, tracks[i].gid // group_size, tracks[i].episode + 1) for i in ids]
        for i, obs in zip(ids, split_obs(env.reset(ids, seeds))):
            tracks[i].start_episode(obs)

    reset(list(range(num_envs)))
    segments: List[Segment] = []
    gen = torch.Generator().manual_seed(seed)
    for step in range(chunks):
        version = step // version_every if version_every else 0
        obs = stack_obs([cast(EnvObs, t.obs) for t in tracks])  # every track has started
        inp = PolicyInput(
            torch.from_numpy(obs.images),
            torch.from_numpy(obs.state),
            obs.instructions,
            torch.randint(0, 2**31, (num_envs,), generator=gen),
        )
        out = policy.act(inp)
        ids = np.arange(num_envs)
        res = run_chunk(env, ids, out.actions.numpy())
        finished = []
        for i in ids:
            segments += tracks[i].record(
                version,
                out.actions[i].numpy(),
                out.logprob[i].numpy(),
                float(out.value[i]),
                res.rewards[i],
                res.mask[i],
                res.last_obs[i],
                bool(res.terminated[i]),
                bool(res.truncated[i]),
                bool(res.success[i]),
                None if out.token_logprob is None else out.token_logprob[i].numpy(),
                None if out.replay is None else {k: v[i].numpy() for k, v in out.replay.items()},
            )
            if res.terminated[i] or res.truncated[i]:
                finished.append(int(i))
        if finished:
            reset(finished)
    segments += [t.cut() for t in tracks if t.has_steps()]
    return segments
