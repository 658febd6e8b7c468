"""Config dataclasses for each registered `model.type`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from vlaslurm.spec.registry import doc, register


@dataclass
class ModelConfig:
    """Fields shared by every policy type."""

    type: str = doc("", "Policy type; selects the dataclass below (e.g. openvla-oft, synthetic).")
    path: Optional[str] = doc(None, "Checkpoint folder loaded with from_pretrained (None = random init).")
    action_chunk: int = doc(1, "Actions predicted per forward pass (executed open-loop).")
    action_dim: int = doc(7, "Dimensions of one action (overridden by the simulator when it knows).")
    precision: Literal["fp32", "bf16", "fp16"] = doc("fp32", "Compute precision: fp32, bf16 or fp16.")


@dataclass
class BackboneConfig:
    """Size of the causal language model that reads instruction and image tokens."""

    hidden_size: int = doc(128, "Width of the language model.")
    num_layers: int = doc(2, "Transformer layers.")
    num_heads: int = doc(4, "Attention heads.")
    intermediate_size: int = doc(256, "MLP width.")
    vocab_size: int = doc(512, "Tokenizer vocabulary size (hashed words).")
    max_instruction_tokens: int = doc(16, "Instruction tokens kept (padded or cut).")
    vision_channels: int = doc(32, "Channels of the convolutional vision stem.")
    num_keypoints: int = doc(16, "Spatial-softmax keypoints pooled from the vision stem.")


@register("model", "openvla")
@dataclass
class OpenVLAConfig(ModelConfig):
    """OpenVLA-style policy: discrete action tokens (256 bins) decoded autoregressively."""

    backbone: BackboneConfig = field(default_factory=BackboneConfig, metadata={"doc": "Backbone size."})
    n_bins: int = doc(256, "Bins per action dimension, mapped onto the last vocabulary tokens.")
    action_low: float = doc(-1.0, "Lower bound of the action range quantised into bins.")
    action_high: float = doc(1.0, "Upper bound of the action range quantised into bins.")
    temperature: float = doc(1.0, "Sampling temperature for action tokens during rollouts.")
    init_seed: int = doc(0, "Seed of the random initialisation when path is None (equal on every rank).")


@register("model", "openvla-oft")
@dataclass
class OpenVLAOFTConfig(ModelConfig):
    """OpenVLA-OFT-style policy: a chunk of continuous actions decoded in parallel, Gaussian head."""

    backbone: BackboneConfig = field(default_factory=BackboneConfig, metadata={"doc": "Backbone size."})
    std: Literal["learned", "scheduled"] = doc(
        "learned", "Action std: learned (a state-independent parameter) or scheduled."
    )
    init_std: float = doc(0.5, "Initial action standard deviation.")
    final_std: float = doc(0.1, "Final std when std is 'scheduled' (linear over the run).")
    init_seed: int = doc(0, "Seed of the random initialisation when path is None (equal on every rank).")


@dataclass
class ForwardCostConfig:
    """Synthetic forward-pass time: base + per_item * batch size, in milliseconds."""

    base: float = doc(2.0, "Fixed cost per forward pass (ms).")
    per_item: float = doc(0.2, "Additional cost per request in the batch (ms).")


@register("model", "synthetic")
@dataclass
class SyntheticModelConfig(ModelConfig):
    """Sleeps instead of computing; returns random actions."""

    forward_ms: ForwardCostConfig = field(default_factory=ForwardCostConfig, metadata={"doc": "Forward cost."})
    num_params: int = doc(1024, "Size of the fake weight vector that is synchronised.")
