"""Config dataclasses for each registered `model.type`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional, Protocol, Tuple, Union

from vlaslurm.spec.registry import doc, register


@dataclass
class ModelConfig:
    """Fields shared by every policy type."""

    type: str = doc("", "Policy type; selects the dataclass below (e.g. openvla-oft, synthetic).")
    path: Optional[str] = doc(
        None,
        "Checkpoint folder (openvla types: a released OpenVLA / OpenVLA-OFT folder, or a LoRA adapter folder "
        "over one); None = random init.",
    )
    action_chunk: int = doc(1, "Actions predicted per forward pass (executed open-loop).")
    execute_actions: Optional[int] = doc(
        None,
        "Actions of each chunk the environment executes, the first ones (None: all action_chunk); the rest are "
        "predicted and dropped, and no ratio, reward or value counts them. πRL's LIBERO recipes execute 5 of "
        "π0's 50.",
    )
    action_dim: int = doc(7, "Dimensions of one action (overridden by the simulator when it knows).")
    precision: Literal["fp32", "bf16", "fp16"] = doc("fp32", "Compute precision: fp32, bf16 or fp16.")

    @property
    def steps_per_decision(self) -> int:
        """Env steps one decision (one chunk) takes at most: what the schedule and the budgets count in."""
        return self.action_chunk if self.execute_actions is None else min(self.execute_actions, self.action_chunk)


@dataclass
class BackboneConfig:
    """Size of a random-init (model.path: null) VLA's Llama, which keeps the release's vocabulary and prompt."""

    hidden_size: int = doc(128, "Width of the language model.")
    num_layers: int = doc(2, "Transformer layers.")
    num_heads: int = doc(4, "Attention heads.")
    intermediate_size: int = doc(256, "MLP width.")
    vision_channels: int = doc(32, "Channels of the film-stem vision backbone's convolutions.")
    num_keypoints: int = doc(16, "Spatial-softmax keypoints pooled by the film-stem vision backbone.")


@dataclass
class LoraSpec:
    """LoRA adapters through peft (only the adapters and heads train); the defaults are openvla's finetune.py."""

    rank: int = doc(32, "r, the adapters' inner size (openvla and RLinf use 32).")
    alpha: float = doc(16.0, "The update is scaled by alpha / rank (openvla: min(rank, 16); RLinf: alpha = rank).")
    dropout: float = doc(0.0, "Dropout on the adapters' input while training, in [0, 1).")
    target_modules: Union[str, List[str]] = doc(
        "all-linear",
        "'all-linear' (every linear layer of the language model but lm_head) or a list of module names "
        "such as [q_proj, v_proj].",
    )
    publish: Literal["adapters", "merged"] = doc(
        "adapters",
        "What each weight publication sends the generators: 'adapters' (the LoRA factors and heads; generators "
        "run the adapted layers) or 'merged' (every adapted layer's W + scale B A and the heads; generators run "
        "plain layers, no adapter cost per forward, as inference engines need). Checkpoints keep the adapters. "
        "openvla and openvla-oft only.",
    )


@dataclass
class VLAConfig(ModelConfig):
    """Fields of the OpenVLA-family types that describe a released checkpoint in `path` and how to use it."""

    base_path: Optional[str] = doc(
        None,
        "Release folder under a LoRA adapter given in path (default: the adapter_config.json's "
        "base_model_name_or_path).",
    )
    unnorm_key: Optional[str] = doc(
        None, "Dataset statistics entry used to de-normalise actions; required when the checkpoint holds several."
    )
    center_crop: bool = doc(False, "The release's centre crop (0.9 of the area) before resizing, as in OFT LIBERO.")
    gripper: Literal["none", "libero"] = doc(
        "none", "Post-processing between policy and environment: none, or libero (the release's LIBERO gripper)."
    )
    lora: Optional[LoraSpec] = field(
        default=None, metadata={"doc": "LoRA adapters (rank, alpha, dropout, target_modules); None trains in full."}
    )
    # A random init (path: null): a tiny configuration of the release's classes (vlaslurm/models/vla/tiny.py)
    backbone: BackboneConfig = field(
        default_factory=BackboneConfig, metadata={"doc": "Size of the random init's Llama (path: null only)."}
    )
    vision: Literal["film-stem", "dinosiglip"] = doc(
        "film-stem",
        "Random init's vision backbone (path: null only): film-stem (a FiLM-conditioned conv stem, one token per "
        "camera; learns the toy task fast) or dinosiglip (the release's fused towers at tiny size, frames at 224).",
    )
    init_seed: int = doc(0, "Seed of the random initialisation when path is None (equal on every rank).")


@register("model", "openvla")
@dataclass
class OpenVLAConfig(VLAConfig):
    """OpenVLA: discrete action tokens (the release's 256 bins) decoded autoregressively."""

    temperature: float = doc(1.0, "Sampling temperature for action tokens during rollouts.")


@register("model", "openvla-oft")
@dataclass
class OpenVLAOFTConfig(VLAConfig):
    """OpenVLA-OFT: an action chunk decoded in parallel, by the L1 head (Gaussian around it) or action tokens."""

    std: Literal["learned", "scheduled"] = doc(
        "learned", "Action std: learned (a state-independent parameter) or scheduled."
    )
    init_std: float = doc(0.5, "Initial action standard deviation.")
    final_std: float = doc(0.1, "Final std when std is 'scheduled' (linear over the run).")
    head: Literal["l1", "discrete"] = doc(
        "l1", "Action head: l1 (the release's L1-regression MLP) or discrete (the LLM's action tokens)."
    )
    temperature: float = doc(1.0, "Sampling temperature of the discrete head's action tokens during rollouts.")


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


@register("model", "pi0")
@dataclass
class PI0PolicyConfig(ModelConfig):
    """π0 (transformers' PI0ForConditionalGeneration): a flow-matching action chunk, log-probs of the denoising path
    (πRL's Flow-SDE or Flow-Noise); path: a folder in transformers' PI0 layout, None = a tiny random π0."""

    action_chunk: int = doc(50, "Actions per chunk: the checkpoint's chunk_size (50 for the π0 releases).")
    denoise_steps: int = doc(10, "K, the denoising steps per chunk (π0's num_inference_steps).")
    noise_method: Literal["flow_sde", "flow_noise"] = doc(
        "flow_sde",
        "flow_sde: sde_steps of the K steps (drawn per sample) are SDE steps, the rest ODE; flow_noise: every "
        "step adds noise of a learned std in [noise_min, noise_max].",
    )
    sde_steps: int = doc(1, "flow_sde: stochastic steps per chunk, 1..denoise_steps.")
    noise_level: float = doc(0.5, "flow_sde: a in the SDE's noise scale a sqrt(t / (1 - t)).")
    noise_min: float = doc(0.08, "flow_noise: lower bound of the learned noise std.")
    noise_max: float = doc(0.16, "flow_noise: upper bound of the learned noise std.")
    value_from: Literal["expert", "prefix"] = doc(
        "expert", "Where the critic reads: the action expert's hidden states, or the PaliGemma prefix's."
    )
    vision: Literal["siglip", "stem"] = doc(
        "siglip",
        "siglip: PaliGemma's vision tower reads the frames (what a release's weights expect); stem: a small FiLM + "
        "spatial-softmax stem conditioned on the instruction gives the image tokens instead (tiny policies: ViT "
        "patches of a random tower did not learn the toy task); a folder must have been saved with the same.",
    )
    lora: Optional[LoraSpec] = doc(
        None,
        "LoRA adapters on the linear layers of PaliGemma's language model (the rest of PaliGemma frozen; the action "
        "expert, the stem and the heads train in full), as RLinf's is_lora; null trains in full.",
    )
    train_expert_only: bool = doc(
        False,
        "Freeze PaliGemma (vision tower, projector, language model): only the action expert, its projections, the "
        "stem and the heads train, as in πRL's recipes; weight publications and checkpoints then carry only those.",
    )
    init_seed: int = doc(0, "Seed of the random initialisation when path is None (equal on every rank).")


class FlowFields(Protocol):
    """The π0 sampler's fields, in the spec (PI0PolicyConfig) and in the policy (models/pi0/flow.py FlowSettings)."""

    @property
    def denoise_steps(self) -> int: ...

    @property
    def noise_method(self) -> str: ...

    @property
    def sde_steps(self) -> int: ...

    @property
    def noise_level(self) -> float: ...

    @property
    def noise_min(self) -> float: ...

    @property
    def noise_max(self) -> float: ...


FLOW_METHODS = ("flow_sde", "flow_noise")


def flow_problem(s: FlowFields) -> Optional[Tuple[str, str]]:
    """(field under model., why) of the first invalid sampler setting, or None."""
    if s.noise_method not in FLOW_METHODS:
        return "noise_method", f"must be one of {', '.join(FLOW_METHODS)}, got {s.noise_method!r}"
    if s.denoise_steps < 1:
        return "denoise_steps", f"must be at least 1, got {s.denoise_steps}"
    if not 1 <= s.sde_steps <= s.denoise_steps:
        return "sde_steps", f"must lie in [1, model.denoise_steps = {s.denoise_steps}], got {s.sde_steps}"
    if not s.noise_level > 0:
        return "noise_level", f"must be greater than 0, got {s.noise_level}"
    if not 0 < s.noise_min <= s.noise_max:
        return (
            "noise_min",
            f"and model.noise_max must satisfy 0 < noise_min <= noise_max, got {s.noise_min}, {s.noise_max}",
        )
    return None
