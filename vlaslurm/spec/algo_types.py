"""Config dataclasses for each registered `algo.type`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, get_args

from vlaslurm.spec.registry import doc, register

GrpoAdvantage = Literal["chunk", "step", "episode"]
GRPO_ADVANTAGES: tuple = get_args(GrpoAdvantage)
Level = Literal["token", "action", "chunk"]  # the granularity of a log-prob, an entropy or a KL term
LEVELS: tuple = get_args(Level)


@dataclass
class AlgoConfig:
    """Fields shared by every algorithm."""

    type: str = doc("", "Algorithm; selects the dataclass below (ppo, grpo, synthetic).")
    lr: float = doc(3.0e-4, "Learning rate.")
    steps_per_update: int = doc(256, "Env steps the trainer consumes per policy update (its batch).")
    epochs: int = doc(4, "Passes over each batch.")
    minibatches: int = doc(
        4,
        "Minibatches per pass over steps_per_update env steps; a larger batch (async GRPO's whole groups) is split "
        "into proportionally more, so that a sample buys as many optimizer steps as in sync mode.",
    )
    max_grad_norm: float = doc(1.0, "Gradient clipping norm.")
    clip: List[float] = doc([0.2, 0.2], "PPO ratio clip [low, high]; asymmetric allowed, e.g. [0.2, 0.28].")
    offpolicy_correction: Literal["none", "decoupled", "tis"] = doc(
        "decoupled", "Stale-sample correction: none, decoupled (decoupled PPO) or tis (truncated IS)."
    )
    tis_cap: float = doc(
        2.0, "tis: upper bound of the importance weight new / behaviour (with several epochs, all that bounds a step)."
    )
    behaviour_weight_cap: float = doc(
        10.0,
        "decoupled: upper bound of the behaviour weight proximal / behaviour (AReaL's behav_imp_weight_cap); the "
        "clip bounds the step, so the cap only bounds variance, and a tight one (2) cut the weight of the actions "
        "the current policy learned to prefer (issue 17's measurements).",
    )
    logprob_level: Level = doc("chunk", "Granularity of log-probs.")
    dual_clip: Optional[float] = doc(
        None, "Dual-clip PPO's c > 1 (RLinf's clip_ratio_c, e.g. 3): a negative advantage's loss is at most -c A."
    )
    entropy_level: Level = doc(
        "action",
        "Entropy bonus per token (an action dimension's entropy), per action (the sum over its dimensions) or "
        "per chunk (the sum over the chunk's executed actions), averaged over the minibatch at that level.",
    )
    kl_coef: float = doc(
        0.0,
        "Weight of a KL penalty to the frozen initial policy, estimated with k3 = exp(ref - new) - (ref - new) - 1 "
        "per ratio at logprob_level (0: off, no reference kept).",
    )
    reward_scale: float = doc(1.0, "Every env reward is multiplied by this before returns and advantages.")

    @property
    def episodes_per_group(self) -> int:
        """Episodes that start from one seed and are judged together (GRPO's group_size); 1 for the others."""
        return 1


@register("algo", "ppo")
@dataclass
class PPOConfig(AlgoConfig):
    """PPO with GAE and a value head on the shared backbone."""

    gamma: float = doc(0.99, "Discount factor per env step.")
    gae_lambda: float = doc(0.95, "GAE lambda.")
    value_coef: float = doc(0.5, "Weight of the value loss.")
    entropy_coef: float = doc(0.0, "Weight of the entropy bonus.")
    value_level: Literal["action", "chunk"] = doc("chunk", "Value and advantage granularity: action or chunk.")
    gae_traces: Literal["vtrace", "none"] = doc(
        "vtrace",
        "vtrace: each step's advantage carries later steps' TD errors weighted by V-trace's truncated ratios "
        "min(1, proximal / behaviour), so stale samples give the current policy's advantages (1 on fresh "
        "samples: plain GAE); none: plain GAE of the sampling policy's trajectory.",
    )
    value_clip: Optional[float] = doc(
        None, "Clip the value's change to +-value_clip around the value before the update (None: no clipping)."
    )
    value_loss: Literal["mse", "huber"] = doc("mse", "Value loss: mse (0.5 (V - R)^2) or huber (with huber_delta).")
    huber_delta: float = doc(1.0, "Where the Huber value loss turns from quadratic to linear.")


@register("algo", "grpo")
@dataclass
class GRPOConfig(AlgoConfig):
    """GRPO: group-relative advantages, no critic."""

    group_size: int = doc(8, "Rollouts per group (same task and initial state).")
    clip: List[float] = doc([0.2, 0.28], "Ratio clip [low, high]: the clip-higher of DAPO and RLinf-VLA's recipes.")
    success_filter: List[float] = doc(
        [0.1, 0.9],
        "Keep groups whose success rate lies in [low, high]; the default drops all-fail and all-succeed groups, "
        "which carry no advantage ([0, 1] keeps every group).",
    )
    advantage: GrpoAdvantage = doc(
        "episode",
        "episode: the episode return normalised within its group, for every chunk (the paper's outcome "
        "reward); chunk: each chunk's reward normalised within its group at that chunk index (dense shaped "
        "rewards only); step: the reward-to-go of those.",
    )
    entropy_coef: float = doc(0.0, "Weight of the entropy bonus.")

    @property
    def episodes_per_group(self) -> int:
        return self.group_size


@register("algo", "synthetic")
@dataclass
class SyntheticAlgoConfig(AlgoConfig):
    """Sleeps instead of updating, to measure the runtime."""

    update_ms: float = doc(20.0, "Time of one update, in milliseconds.")
