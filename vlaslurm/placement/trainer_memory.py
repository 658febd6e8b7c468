"""A trainer rank's memory at the peak of an update, from the model's shape: what the placement check reads.

Per parameter the trainer keeps float32 master state: the parameter (4 bytes), its gradient (4) and Adam's two
moments (8), 16 bytes. `replicate` holds all of it on every rank. `fsdp` holds 1/S of it (S = trainer ranks /
trainer.replicas, the ranks one copy is sharded over), plus the full parameters of the block it computes and of the
next one (FSDP2 prefetches one), in bf16 with `mixed_precision: bf16`; with `cpu_offload` the shards, gradients and
Adam's state live in host memory instead. Activations are an estimate (Korthikanti et al. 2022, "Reducing
activation recomputation"): a transformer layer with fused attention keeps about 34 * tokens * width bytes of
16-bit activations per sequence for backward; with activation checkpointing each layer keeps only its input (2 *
tokens * width) and one layer's full set is live while it is recomputed. float32 compute doubles both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Tuple

from vlaslurm.spec.trainer_types import TrainerSpec

if TYPE_CHECKING:
    from vlaslurm.models.prismatic.release import ReleaseConfig

GiB = 2.0**30
STATE_BYTES = {"params": 4, "grads": 4, "adam": 8}  # float32 master state per parameter
ACTIVATION_BYTES_PER_TOKEN_WIDTH = 34  # one layer, 16-bit activations, fused (SDPA) attention
PROMPT_TOKENS = 64  # instruction, proprio and action tokens of a VLA decision step, on top of the image patches


@dataclass(frozen=True)
class Stack:
    """The transformer layers of one part of the model (the LLM, a vision tower) and the sequence through it."""

    layers: int
    width: int
    tokens: int


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a model: its parameters, its largest FSDP unit (block), its stacks."""

    parameters: int
    largest_block: int
    stacks: Tuple[Stack, ...]


@dataclass(frozen=True)
class TrainerBytes:
    """Bytes one trainer rank holds on its GPU at the peak of an update, by what takes them."""

    params: float
    grads: float
    adam: float
    gathered: float  # fsdp: the full parameters of the blocks in flight
    activations: float
    how: str  # "replicate" or "fsdp, sharded over N ranks"

    @property
    def total(self) -> float:
        return self.params + self.grads + self.adam + self.gathered + self.activations

    def describe(self) -> str:
        parts = [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("Adam state", self.adam),
            ("gathered blocks", self.gathered),
            ("activations (estimate)", self.activations),
        ]
        listed = ", ".join(f"{name} {value / GiB:.1f}" for name, value in parts if value or name == "activations")
        return f"{self.total / GiB:.1f} GiB per trainer rank ({self.how}): {listed} GiB"


def trainer_bytes(shape: ModelShape, trainer: TrainerSpec, ranks: int, sequences: int) -> TrainerBytes:
    """The peak of one rank of `ranks` computing `sequences` decision steps per forward and backward."""
    fsdp = trainer.strategy == "fsdp"
    shard = ranks // max(1, trainer.replicas) if fsdp else 1
    on_gpu = 0.0 if fsdp and trainer.cpu_offload else 1.0
    state = {key: on_gpu * per * shape.parameters / max(1, shard) for key, per in STATE_BYTES.items()}
    compute_bytes = 2 if fsdp and trainer.mixed_precision == "bf16" else 4
    gathered = 2 * shape.largest_block * compute_bytes if fsdp and shard > 1 else 0.0
    checkpointing = fsdp and trainer.activation_checkpointing
    activations = activation_bytes(shape.stacks, sequences, checkpointing, compute_bytes)
    how = f"fsdp, sharded over {shard} ranks" if fsdp else "replicate"
    return TrainerBytes(state["params"], state["grads"], state["adam"], gathered, activations, how)


def activation_bytes(stacks: Tuple[Stack, ...], sequences: int, checkpointing: bool, value_bytes: int) -> float:
    """The activations kept for backward over every stack, for `sequences` sequences (the estimate above)."""
    scale = value_bytes / 2  # the 34 is for 16-bit values
    per_layer = [ACTIVATION_BYTES_PER_TOKEN_WIDTH * s.tokens * s.width * scale * sequences for s in stacks]
    if not checkpointing:
        return sum(p * s.layers for p, s in zip(per_layer, stacks))
    inputs = sum(2 * s.tokens * s.width * scale * sequences * s.layers for s in stacks)
    return inputs + max(per_layer, default=0.0)


def sequences_per_rank(trainer: TrainerSpec, steps_per_update: int, minibatches: int, ranks: int) -> int:
    """Decision steps one rank puts through a forward: its micro-batch, or its whole share of a minibatch."""
    share = -(-steps_per_update // max(1, minibatches * ranks))
    return max(1, min(share, trainer.micro_batch_size or share))


def vla_shape(config: ReleaseConfig, prompt_tokens: int = PROMPT_TOKENS) -> ModelShape:
    """The shape of the OpenVLA of a release config, counted on the meta device (nothing is allocated)."""
    from vlaslurm.algos.sharding import BLOCK_CLASSES
    from vlaslurm.models.prismatic.release import build_vla

    vla = build_vla(config, device="meta")
    blocks = [m for m in vla.modules() if type(m).__name__ in BLOCK_CLASSES]
    dino, siglip = config.towers()
    llm = config.llama()
    patches = dino.num_patches
    stacks = (
        Stack(dino.depth, dino.embed_dim, patches),
        Stack(siglip.depth, siglip.embed_dim, patches),
        Stack(llm.num_hidden_layers, llm.hidden_size, patches + prompt_tokens),
    )
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    return ModelShape(sum(p.numel() for p in vla.parameters()), largest, stacks)


def spec_trainer_bytes(spec, shape: ModelShape, ranks: int) -> TrainerBytes:
    """`trainer_bytes` with the spec's `trainer:` section and batch (`algo.steps_per_update`, `minibatches`)."""
    sequences = sequences_per_rank(spec.trainer, spec.algo.steps_per_update, spec.algo.minibatches, ranks)
    return trainer_bytes(shape, spec.trainer, ranks, sequences)


def trainer_memory_problem(spec, shape: ModelShape, ranks: int, capacity: float) -> Optional[str]:
    """Why the spec's trainer does not fit `capacity` bytes per GPU on `ranks` ranks (None when it fits)."""
    need = spec_trainer_bytes(spec, shape, ranks)
    if need.total <= capacity:
        return None
    hint = (
        "use trainer.strategy: fsdp"
        if spec.trainer.strategy != "fsdp"
        else "add trainer ranks, set trainer.activation_checkpointing, a smaller trainer.micro_batch_size "
        "or trainer.cpu_offload"
    )
    return f"trainer needs {need.describe()} > {capacity / GiB:.1f} GiB per GPU; {hint}"


def spec_model_shape(spec) -> Optional[ModelShape]:
    """The shape of the spec's model where it is an OpenVLA release folder (`model.path` with its config.json);
    None otherwise (the profile's measured trainer memory is all there is)."""
    path = getattr(spec.model, "path", None)
    if path is None:  # before the import: it loads transformers (~5 s)
        return None
    from vlaslurm.models.prismatic.release import CONFIG_FILE, read_release_config

    if not (Path(path) / CONFIG_FILE).is_file():
        return None
    return vla_shape(read_release_config(path))
