"""RL maths as small pure torch functions: GAE, PPO and GRPO losses, off-policy corrections."""

from vlaslurm.algos.gae import (
    action_level_gae,
    chunk_rewards,
    compute_gae,
    expand_chunk,
    flatten_chunks,
    unflatten_chunks,
)
from vlaslurm.algos.grpo import (
    group_advantages,
    group_advantages_per_step,
    grpo_policy_loss,
    reward_to_go,
    success_filter_mask,
    valid_action_mask,
)
from vlaslurm.algos.offpolicy import CORRECTIONS, policy_loss, tis_policy_loss, truncated_is_weight
from vlaslurm.algos.ppo import (
    entropy_at_level,
    entropy_bonus,
    explained_variance,
    kl_k3,
    masked_mean,
    ppo_policy_loss,
    sequence_mean,
    value_loss,
)

__all__ = [
    "CORRECTIONS",
    "action_level_gae",
    "chunk_rewards",
    "compute_gae",
    "entropy_at_level",
    "entropy_bonus",
    "expand_chunk",
    "explained_variance",
    "flatten_chunks",
    "group_advantages",
    "group_advantages_per_step",
    "grpo_policy_loss",
    "kl_k3",
    "masked_mean",
    "policy_loss",
    "ppo_policy_loss",
    "reward_to_go",
    "sequence_mean",
    "success_filter_mask",
    "tis_policy_loss",
    "truncated_is_weight",
    "unflatten_chunks",
    "valid_action_mask",
    "value_loss",
]
