"""The trainer's own settings (`trainer:`): how one update is computed on the trainer ranks.

What the algorithm optimises is `algo:`; this section says how the trainer computes it: replicated or sharded
(FSDP2) state, precision, micro-batches and the optimizer's settings. `fsdp_problem` holds the rules that need
the rest of the spec (the trainer's rank count, the layout, LoRA), for the loader's cross-field pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional, Tuple

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

    strategy: Literal["replicate", "fsdp"] = doc(
        "replicate",
        "replicate: every trainer rank holds the whole model and sums gradients (data parallel; tiny models). "
        "fsdp: parameters, gradients and optimizer state sharded over the trainer ranks (FSDP2, one unit per "
        "transformer / ViT block plus the root); checkpoints are sharded (torch.distributed.checkpoint) and "
        "resume on any number of trainer ranks.",
    )
    mixed_precision: Literal["fp32", "bf16"] = doc(
        "fp32", "fsdp: bf16 parameters in compute, float32 gradient reduction and float32 master state."
    )
    activation_checkpointing: bool = doc(
        False, "fsdp: recompute each block's activations in backward instead of keeping them (less memory)."
    )
    cpu_offload: bool = doc(False, "fsdp: keep the shards and the optimizer state in host memory (FSDP2's offload).")
    replicas: int = doc(
        1,
        "fsdp: hybrid sharding: the trainer ranks form `replicas` groups of N / replicas ranks; each group shards "
        "the model, the groups replicate it (one group per node keeps the reduce-scatter inside a node).",
    )
    micro_batch_size: Optional[int] = doc(
        None,
        "Decision steps per forward and backward on one rank; gradients accumulate over a minibatch's "
        "micro-batches, so the update is the same (None: a rank's whole share of the minibatch at once).",
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"doc": "Optimizer settings."})


FSDP_ONLY = ("mixed_precision", "activation_checkpointing", "cpu_offload", "replicas")


def fsdp_problem(
    trainer: TrainerSpec, ranks: int, layout: str, ranks_from: str = "resources.trainer"
) -> Optional[Tuple[str, str]]:
    """(field, message) of the first `trainer:` setting the runtime cannot do with `ranks` trainer ranks (counted
    from `ranks_from`) and the `layout`, or None. The loader's cross-field pass raises it with the
    field's line; the trainer checks it again at start."""
    if trainer.strategy != "fsdp":
        changed = [name for name in FSDP_ONLY if getattr(trainer, name) != getattr(TrainerSpec, name)]
        if changed:
            return f"trainer.{changed[0]}", "applies to trainer.strategy: fsdp only; set strategy: fsdp or remove it"
        return None
    if trainer.replicas < 1 or ranks % trainer.replicas:
        return (
            "trainer.replicas",
            f"must divide the number of trainer ranks, {ranks} ({ranks_from}); got {trainer.replicas}",
        )
    if layout == "collocated":
        return (
            "trainer.strategy",
            "fsdp with resources.layout: collocated is not supported: the collocated offload moves whole modules "
            "between host and GPU, not FSDP shards; use trainer.cpu_offload: true for tight memory with "
            "layout: disaggregated, or strategy: replicate",
        )
    return None
