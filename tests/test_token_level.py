"""`algo.logprob_level: token`: behaviour log-probs per action token travel from the generator's reply to the
batch, and the PPO ratio is then one per token, not one per action."""

from __future__ import annotations

import numpy as np
import torch
from learner_helpers import rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, PolicyStep, evaluate_all
from vlaslurm.runtime import messages as msgs
from vlaslurm.spec.algo_types import PPOConfig


def test_token_log_probs_survive_the_wire():
    tokens = np.random.default_rng(0).normal(size=(3, 4, 2)).astype(np.float32)
    reply = msgs.ActReply([0, 1, 2], 0, 7, np.zeros((3, 4, 2), np.float32), tokens.sum(-1), np.zeros(3), 1, tokens)
    back = msgs.decode_act(msgs.encode_act(reply))
    np.testing.assert_array_equal(back.token_logprob, tokens)
    plain = msgs.decode_act(
        msgs.encode_act(msgs.ActReply([0], 0, 7, np.zeros((1, 4, 2)), np.zeros((1, 4)), np.zeros(1)))
    )
    assert plain.token_logprob is None


def test_segments_and_batch_carry_token_log_probs():
    segments = rollout_segments(tiny_policy(seed=1), num_envs=4, chunks=5)
    for seg in segments:
        assert seg.token_logprob.shape == (*seg.logprob.shape, 2)
        np.testing.assert_allclose(seg.token_logprob.sum(-1), seg.logprob, atol=1e-5)
        back = msgs.decode_segment(msgs.encode_segment(seg))
        np.testing.assert_array_equal(back.token_logprob, seg.token_logprob)
    batch = collate(segments)
    assert batch.tensors["token_logprob"].shape == (*batch.tensors["logprob"].shape, 2)


def clipfrac(level: str, batch) -> float:
    policy = tiny_policy(seed=1)  # the behaviour policy itself: every true ratio is 1
    # no off-policy correction: the ratio is against the stored behaviour log-probs
    cfg = PPOConfig(type="ppo", lr=1e-9, logprob_level=level, clip=(0.2, 0.2), offpolicy_correction="none")  # type: ignore[arg-type]
    step = PolicyStep(cfg, policy, DataParallel(None, 0, 1), entropy_coef=0.0)
    _, prox = evaluate_all(policy, batch, values=False, tokens=level == "token")
    rows, cols = batch.tensors["step_valid"].nonzero(as_tuple=True)
    stats: dict = {}
    step(batch, rows, cols, torch.zeros(batch.tensors["step_valid"].shape), prox, stats)
    return stats["losses/clipfrac"][0]


def test_the_token_ratio_is_per_token():
    batch = collate(rollout_segments(tiny_policy(seed=1), num_envs=4, chunks=5))
    t = batch.tensors
    # Move the stored behaviour log-probs of the two dimensions of every action by +1 and -1: each action's sum,
    # and so its ratio, is unchanged, but every token's ratio is e or 1/e, far outside the clip range.
    shift = torch.tensor([1.0, -1.0])
    t["token_logprob"] = t["token_logprob"] + shift
    assert clipfrac("action", batch) < 0.01
    assert clipfrac("token", batch) > 0.99
