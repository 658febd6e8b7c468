"""The trainer's own settings (`trainer:`): how one update is computed on the trainer ranks.

What the algorithm optimises is `algo:`; this section says how the trainer computes it: micro-batches and the
optimizer's settings. Sharding a model too large for one rank (FSDP) is the large-model trainer's, next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional

from vlaslurm.spec.registry import doc


@dataclass
class OptimizerConfig:
    """AdamW over the trainable parameters; the value head may have its own learning rate."""

    weight_decay: float = doc(0.0, "Decoupled weight decay (AdamW); 0 is Adam.")
    betas: List[float] = doc([0.9, 0.999], "Adam's [beta1, beta2].")
    eps: float = doc(1.0e-5, "Adam's epsilon (1e-5, as PPO implementations use, not torch's 1e-8).")
    value_lr: Optional[float] = doc(None, "Learning rate of the value head (None: algo.lr), as RLinf's critic.")


@dataclass
class TrainerSpec:
    """How a trainer rank computes one update."""

    strategy: Literal["replicate"] = doc(
        "replicate", "replicate: every trainer rank holds the whole model and sums gradients (data parallel)."
    )
    micro_batch_size: Optional[int] = doc(
        None,
        "Decision steps per forward and backward on one rank; gradients accumulate over a minibatch's "
        "micro-batches, so the update is the same (None: a rank's whole share of the minibatch at once).",
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"doc": "Optimizer settings."})
