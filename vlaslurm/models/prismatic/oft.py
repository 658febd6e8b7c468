"""OpenVLA-OFT: parallel decoding of an action chunk with the release's L1 head and proprio projector.

`load_oft(folder)` loads an OpenVLA release folder strictly (release.py) plus its `action_head--*checkpoint.pt` and
`proprio_projector--*checkpoint.pt`, and returns a `ReleasedOpenVLAOFT` whose `predict_action` maps the cameras'
frames, an instruction and the raw proprio state to a [chunk, action_dim] chunk in one bidirectional LLM pass.
`head="discrete"` decodes the LLM's own action tokens instead, greedily or sampled at a temperature (for RL).
Facts: /work/shared/facts/openvla-checkpoints.md, sections 1, 3 (OFT), 7 and 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Literal, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch
from torch import nn

from vlaslurm.models.prismatic.actions import (
    OFT_UNNORM_EPS,
    ActionBins,
    ArrayStats,
    Normalization,
    NormStats,
    normalize_proprio,
    unnormalize_actions,
)
from vlaslurm.models.prismatic.preprocess import STOP_TOKEN_ID, oft_query_ids, prompt_token_ids
from vlaslurm.models.prismatic.release import ReleasedOpenVLA, ReleaseError, load_pretrained, read_release_config
from vlaslurm.models.prismatic.vla import PrismaticVLA

PathLike = Union[str, Path]
Head = Literal["l1", "discrete"]
HEADS: Tuple[str, ...] = ("l1", "discrete")
ModuleT = TypeVar("ModuleT", bound=nn.Module)

HEAD_LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which the release's head uses (1e-6 is a known trap)
DDP_PREFIX = "module."  # the heads were saved from DDP-wrapped modules
ACTION_HEAD = "action_head"
PROPRIO_PROJECTOR = "proprio_projector"
CHECKPOINT_WORD = "checkpoint"
# Components an OFT folder may hold that this loader does not implement; it refuses them rather than ignore them.
UNSUPPORTED_COMPONENTS = {
    "noisy_action_projector": "a diffusion action head",
    "vision_backbone": "FiLM language conditioning of the vision backbone",
}


class OFTHeadError(ReleaseError):
    """An OFT head file that is missing, ambiguous, unreadable, or does not match the requested shapes."""


@dataclass(frozen=True)
class OFTShape:
    """The constants OFT fixes per robot platform (prismatic/vla/constants.py); no release file stores `chunk`."""

    chunk: int = 8
    """Actions per chunk (NUM_ACTIONS_CHUNK): one placeholder slot per action dimension of each."""
    action_dim: int = 7
    """Dimensions of one action (ACTION_DIM); the L1 head's output width."""
    proprio_dim: int = 8
    """Dimensions of the proprio state (PROPRIO_DIM); the proprio projector's input width."""

    def __post_init__(self) -> None:
        for name in ("chunk", "action_dim", "proprio_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def slots(self) -> int:
        """Action placeholders in the sequence (LIBERO: 8 x 7 = 56)."""
        return self.chunk * self.action_dim


PLATFORMS: Dict[str, OFTShape] = {
    "libero": OFTShape(8, 7, 8),
    "aloha": OFTShape(25, 14, 14),
    "bridge": OFTShape(5, 7, 7),
}


# --- the heads, with the release's parameter names ------------------------------------------------------------


class MLPResNetBlock(nn.Module):
    """`x + ReLU(Linear(LayerNorm(x)))`, pre-norm; keys `ffn.0` (LayerNorm) and `ffn.1` (Linear)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim, eps=HEAD_LAYER_NORM_EPS), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    """LayerNorm, Linear, ReLU, residual blocks, LayerNorm, Linear."""

    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim, eps=HEAD_LAYER_NORM_EPS)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(MLPResNetBlock(hidden_dim) for _ in range(num_blocks))
        self.layer_norm2 = nn.LayerNorm(hidden_dim, eps=HEAD_LAYER_NORM_EPS)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """The OFT L1 head: the action_dim hidden states of one action, concatenated, to that action.

    Keys `model.layer_norm1`, `model.fc1`, `model.mlp_resnet_blocks.{0,1}.ffn.{0,1}`, `model.layer_norm2`,
    `model.fc2`; 151,117,831 parameters at LIBERO's full size (llm_dim 4096, action_dim 7).
    """

    def __init__(self, llm_dim: int = 4096, action_dim: int = 7, num_blocks: int = 2) -> None:
        super().__init__()
        self.llm_dim, self.action_dim = llm_dim, action_dim
        self.model = MLPResNet(num_blocks, llm_dim * action_dim, llm_dim, action_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, chunk * action_dim, llm_dim] -> normalised actions [B, chunk, action_dim] (not clipped)."""
        batch, slots, width = hidden.shape
        if width != self.llm_dim or slots % self.action_dim:
            raise ValueError(
                f"hidden states must be [B, chunk * {self.action_dim}, {self.llm_dim}], got {list(hidden.shape)}"
            )
        # Slot t * action_dim + d holds dimension d of action t: each action reads its own action_dim slots.
        return self.model(hidden.reshape(batch, slots // self.action_dim, self.action_dim * width))


class ProprioProjector(nn.Module):
    """The proprio state to one LLM token: fc1, exact GELU, fc2 (16,818,176 parameters for LIBERO's 8 -> 4096)."""

    def __init__(self, llm_dim: int = 4096, proprio_dim: int = 8) -> None:
        super().__init__()
        self.llm_dim, self.proprio_dim = llm_dim, proprio_dim
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.act_fn1 = nn.GELU(approximate="none")
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, proprio: torch.Tensor) -> torch.Tensor:
        """proprio [B, proprio_dim] (normalised) -> [B, 1, llm_dim]."""
        return self.fc2(self.act_fn1(self.fc1(proprio)))[:, None]


# --- head files -----------------------------------------------------------------------------------------------


def find_component_file(folder: PathLike, component: str) -> Optional[Path]:
    """Upstream's `find_checkpoint_file`: the one file whose name contains `component` and "checkpoint".

    None when there is none (e.g. no proprio projector); an error naming them when there are several, since
    upstream would then not know which step to load either.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise OFTHeadError(f"{folder} is not a folder; pass an OFT release folder")
    found = sorted(p for p in folder.iterdir() if component in p.name and CHECKPOINT_WORD in p.name and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise OFTHeadError(
            f"{folder} holds {len(found)} {component} checkpoints ({names}); keep exactly one "
            f"({component}--{{STEP}}_checkpoint.pt) so it is clear which training step to load"
        )
    return found[0] if found else None


def head_file_name(component: str, step: Union[int, str] = "latest") -> str:
    """The release's name of a head file: `action_head--150000_checkpoint.pt`, `..--latest_checkpoint.pt`."""
    if not (isinstance(step, int) and step >= 0) and step != "latest":
        raise ValueError(f"step must be a non-negative training step or 'latest', got {step!r}")
    return f"{component}--{step}_{CHECKPOINT_WORD}.pt"


def read_component_state(path: PathLike) -> Dict[str, torch.Tensor]:
    """A head file's tensors on CPU, `module.` stripped. weights_only: the pickle may hold tensors only."""
    path = Path(path)
    try:
        raw = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # an arbitrary object in the pickle is refused here, by design
        raise OFTHeadError(
            f"{path}: not a state dict of tensors that torch.load(weights_only=True) reads ({err})"
        ) from err
    if not isinstance(raw, Mapping) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise OFTHeadError(f"{path}: expected a state dict (name -> tensor), got {type(raw).__name__}")
    return {_strip_ddp(str(key)): tensor for key, tensor in raw.items()}


def _strip_ddp(key: str) -> str:
    return key[len(DDP_PREFIX) :] if key.startswith(DDP_PREFIX) else key


def check_component_keys(module: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Strict: exactly the module's keys (shapes are checked separately, with the argument to change)."""
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise OFTHeadError(
            f"{where} does not hold the release's {type(module).__name__} keys: missing {missing or 'none'}, "
            f"unexpected {unexpected or 'none'}"
        )


def action_head_dims(state: Mapping[str, torch.Tensor]) -> Tuple[int, int]:
    """(action_dim, llm_dim) of a stored L1 head, read from `model.fc2.weight` [action_dim, llm_dim]."""
    action_dim, llm_dim = state["model.fc2.weight"].shape
    return int(action_dim), int(llm_dim)


def proprio_projector_dims(state: Mapping[str, torch.Tensor]) -> Tuple[int, int]:
    """(proprio_dim, llm_dim) of a stored projector, read from `fc1.weight` [llm_dim, proprio_dim]."""
    llm_dim, proprio_dim = state["fc1.weight"].shape
    return int(proprio_dim), int(llm_dim)


def check_dims(found: Mapping[str, int], shape: OFTShape, llm_dim: int, where: str) -> None:
    """The file's dimensions against the arguments and the LLM; the error names the argument to set."""
    if found["llm_dim"] != llm_dim:
        raise OFTHeadError(
            f"{where} was trained on a {found['llm_dim']}-wide LLM but the release's text_config has hidden_size "
            f"{llm_dim}; the head files belong to another base model"
        )
    for name, value in found.items():
        if name != "llm_dim" and value != getattr(shape, name):
            hint = "".join(
                f" ({platform}'s constants: chunk={p.chunk}, action_dim={p.action_dim}, proprio_dim={p.proprio_dim})"
                for platform, p in PLATFORMS.items()
                if getattr(p, name) == value
            )
            raise OFTHeadError(
                f"{where} has {name} {value} but load_oft got {name}={getattr(shape, name)}; pass {name}={value}{hint}"
            )


def load_component(module: ModuleT, state: Mapping[str, torch.Tensor]) -> ModuleT:
    """Load a checked state strictly into `module` (already in its dtype and on its device), in eval mode."""
    module.load_state_dict(dict(state), strict=True)
    return module.eval()


def load_action_head(
    path: Path, shape: OFTShape, llm_dim: int, dtype: torch.dtype, device: Union[str, torch.device]
) -> L1RegressionActionHead:
    """A head file as an `L1RegressionActionHead` for `shape.action_dim` on an `llm_dim`-wide LLM, strictly."""
    state = read_component_state(path)
    head = L1RegressionActionHead(llm_dim, shape.action_dim).to(device=device, dtype=dtype)
    check_component_keys(head, state, str(path))  # before reading dims: a diffusion head has other keys
    action_dim, width = action_head_dims(state)
    check_dims({"action_dim": action_dim, "llm_dim": width}, shape, llm_dim, str(path))
    return load_component(head, state)


def load_proprio_projector(
    path: Path, shape: OFTShape, llm_dim: int, dtype: torch.dtype, device: Union[str, torch.device]
) -> ProprioProjector:
    """A projector file as a `ProprioProjector` for `shape.proprio_dim`, strictly."""
    state = read_component_state(path)
    projector = ProprioProjector(llm_dim, shape.proprio_dim).to(device=device, dtype=dtype)
    check_component_keys(projector, state, str(path))
    proprio_dim, width = proprio_projector_dims(state)
    check_dims({"proprio_dim": proprio_dim, "llm_dim": width}, shape, llm_dim, str(path))
    return load_component(projector, state)


def check_supported_components(folder: Path) -> None:
    for component, what in UNSUPPORTED_COMPONENTS.items():
        path = find_component_file(folder, component)
        if path is not None:
            raise OFTHeadError(f"{path} means the checkpoint uses {what}, which load_oft does not implement")


def save_oft_heads(
    folder: PathLike,
    action_head: Optional[L1RegressionActionHead] = None,
    proprio_projector: Optional[ProprioProjector] = None,
    step: Union[int, str] = "latest",
    keep_dtype: bool = False,
) -> List[Path]:
    """Write head files as the release stores them: `module.` keys, the action head in bf16, the projector fp32
    (with `keep_dtype`, each in its own dtype: a trained fp32 head is not rounded to bf16 on the way out)."""
    folder = Path(folder)
    written = []
    for component, module, dtype in (
        (ACTION_HEAD, action_head, torch.bfloat16),
        (PROPRIO_PROJECTOR, proprio_projector, torch.float32),
    ):
        if module is None:
            continue
        state = {
            DDP_PREFIX + key: t.detach().to("cpu", t.dtype if keep_dtype else dtype).clone()
            for key, t in module.state_dict().items()
        }
        path = folder / head_file_name(component, step)
        torch.save(state, str(path))
        written.append(path)
    return written


# --- parallel decoding ----------------------------------------------------------------------------------------


def bidirectional_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] (1 = token, 0 = pad) -> additive [B, 1, S, S]: every query sees every non-pad key.

    A 4-D mask is used by transformers as given (no causal triangle is added) and, not being None, keeps SDPA's
    `is_causal` off: the stock Llama then attends as the OFT fork's does (the last row of its causal + padding mask).
    """
    blocked = torch.finfo(dtype).min
    keys = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill(key_mask == 0, blocked)
    length = key_mask.shape[1]
    return keys[:, None, None, :].expand(-1, 1, length, length)


def project_images(vla: PrismaticVLA, pixel_values: torch.Tensor) -> torch.Tensor:
    """pixel_values [B, 6 N, S, S] (N cameras on channels) -> projected patches [B, N * P, H], camera 0 first."""
    batch, channels = pixel_values.shape[:2]
    if channels % 6:
        raise ValueError(f"pixel_values must hold 6 channels per camera, got {list(pixel_values.shape)}")
    cameras = channels // 6
    # The cameras are independent through the towers: fold them into the batch for one pass.
    per_camera = pixel_values.reshape(batch * cameras, 6, *pixel_values.shape[2:])
    patches = vla.projector(vla.vision_backbone(per_camera.to(vla.dtype)))
    return patches.reshape(batch, cameras * patches.shape[1], patches.shape[2])


def oft_embeddings(
    vla: PrismaticVLA,
    pixel_values: torch.Tensor,
    input_ids: torch.Tensor,
    slots: int,
    proprio_features: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, int]:
    """(embeddings [B, 1 + NUM_PATCHES + T - 1, H], NUM_PATCHES).

    `input_ids` [B, T] = `<bos> prompt 29871, 1 x slots, </s>` (`oft_query_ids`). The sequence is
    `[<bos>, patches of every camera, proprio token, prompt_ids[1:], 0 x slots, </s>]`: the placeholders' embeddings
    are zeroed (the stop token keeps its own); NUM_PATCHES counts the proprio token.
    """
    if input_ids.ndim != 2 or input_ids.shape[1] < slots + 2 or bool((input_ids[:, -1] != STOP_TOKEN_ID).any()):
        raise ValueError(
            f"input_ids must be [B, T] ending with {slots} placeholders and </s> ({STOP_TOKEN_ID}), as oft_query_ids "
            f"builds them; got shape {list(input_ids.shape)}"
        )
    text = vla.language_model.get_input_embeddings()(input_ids)
    placeholders = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    placeholders[:, -1 - slots : -1] = True
    text = text.masked_fill(placeholders[..., None], 0.0)
    prefix = project_images(vla, pixel_values)
    if proprio_features is not None:
        prefix = torch.cat([prefix, proprio_features.to(prefix.dtype)], dim=1)
    return torch.cat([text[:, :1], prefix, text[:, 1:]], dim=1), prefix.shape[1]


def bidirectional_hidden_states(
    vla: PrismaticVLA, embeddings: torch.Tensor, key_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The Llama's final-normed last hidden states [B, S, H] with full (pad-keys-only masked) attention."""
    if key_mask is None:
        key_mask = torch.ones(embeddings.shape[:2], dtype=torch.long, device=embeddings.device)
    mask = bidirectional_mask(key_mask, embeddings.dtype)
    # is_causal=False as well, for attention kernels that read the flag rather than the mask (flash attention).
    out = vla.language_model.model(inputs_embeds=embeddings, attention_mask=mask, use_cache=False, is_causal=False)
    return out.last_hidden_state


def action_hidden_states(hidden: torch.Tensor, num_patches: int, num_prompt_tokens: int, slots: int) -> torch.Tensor:
    """[B, slots, H] at `[NUM_PATCHES + NUM_PROMPT_TOKENS, + slots)`: one position before each action slot
    (29871, then the first slots - 1 placeholders), as OFT trains and predicts."""
    start = num_patches + num_prompt_tokens
    return hidden[:, start : start + slots]


# --- discrete actions: greedy, or sampled at a temperature ----------------------------------------------------


def action_token_logits(logits: torch.Tensor, bins: ActionBins) -> torch.Tensor:
    """[..., V] -> float32 [..., n_bins]: the logits of the action ids first_token..last_token (31744..31999)."""
    return logits[..., bins.first_token : bins.last_token + 1].float()


def action_token_log_probs(logits: torch.Tensor, bins: ActionBins, temperature: float) -> torch.Tensor:
    """log pi(token) for each action id, [..., n_bins]: `log_softmax(logits[action ids] / T)`.

    The sampling distribution is categorical over the 256 action-bin tokens only (other ids have probability 0),
    at temperature T > 0: `log pi(k) = l_k / T - logsumexp_j(l_j / T)`, j over the action ids. Token 31744 and
    31745 share a bin centre, so the log-prob is of the token, not of the action value.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample (None decodes greedily), got {temperature}")
    return torch.log_softmax(action_token_logits(logits, bins) / temperature, dim=-1)


def action_token_log_prob(
    logits: torch.Tensor, token_ids: torch.Tensor, bins: ActionBins, temperature: float
) -> torch.Tensor:
    """float32 [...] log-prob of `token_ids` [...] (action ids) under `action_token_log_probs`."""
    if bool(((token_ids < bins.first_token) | (token_ids > bins.last_token)).any()):
        raise ValueError(f"token ids must be action ids {bins.first_token}..{bins.last_token}")
    log_probs = action_token_log_probs(logits, bins, temperature)
    return log_probs.gather(-1, (token_ids - bins.first_token)[..., None].long())[..., 0]


def sample_action_tokens(
    logits: torch.Tensor, bins: ActionBins, temperature: float, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token ids [...] long, their log-prob [...] float32), drawn from `action_token_log_probs`."""
    log_probs = action_token_log_probs(logits, bins, temperature)
    flat = log_probs.reshape(-1, log_probs.shape[-1])
    draws = torch.multinomial(flat.exp(), 1, generator=generator)
    chosen = flat.gather(-1, draws)[:, 0].reshape(log_probs.shape[:-1])
    return (draws[:, 0] + bins.first_token).reshape(log_probs.shape[:-1]), chosen


def greedy_action_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The release's discrete OFT decode: argmax over the whole vocabulary (a non-action id is clipped later)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class DiscreteActions:
    """One discrete decode of a chunk: ids, their log-prob (None when greedy) and the un-normalised actions."""

    token_ids: torch.Tensor
    """long [chunk, action_dim]."""
    log_prob: Optional[torch.Tensor]
    """float32 [chunk, action_dim] under `action_token_log_probs` at the temperature used; None if greedy."""
    actions: np.ndarray
    """float64 [chunk, action_dim]."""


# --- the loaded policy ----------------------------------------------------------------------------------------


@dataclass
class ReleasedOpenVLAOFT:
    """A loaded OFT release: camera frames + instruction (+ proprio) -> an action chunk in one LLM pass."""

    base: ReleasedOpenVLA
    """The OpenVLA part (model, tokenizer, image transform, bins, statistics)."""
    action_head: Optional[L1RegressionActionHead]
    proprio_projector: Optional[ProprioProjector]
    shape: OFTShape
    normalization: Normalization = "bounds_q99"
    """BOUNDS_Q99 for LIBERO and Bridge, "bounds" (min/max) for ALOHA; used for actions and proprio alike."""

    @property
    def model(self) -> PrismaticVLA:
        return self.base.model

    @property
    def norm_stats(self) -> NormStats:
        return self.base.norm_stats

    def pixel_values(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """RGB uint8 [H, W, 3] frames (primary, then wrist...) -> [1, 6 N, S, S], concatenated on channels."""
        if isinstance(images, np.ndarray) or not images:
            raise ValueError("images must be a non-empty list of RGB uint8 frames (primary camera first)")
        return torch.cat([self.base.pixel_values(image) for image in images], dim=1)

    def query_ids(self, instruction: str) -> Tuple[torch.Tensor, int]:
        """([1, T] ids `<bos> prompt 29871, 1 x slots, </s>`, NUM_PROMPT_TOKENS)."""
        prompt = prompt_token_ids(self.base.tokenizer, instruction, self.base.prompt_template)
        ids, num_prompt_tokens = oft_query_ids(prompt, self.shape.action_dim, self.shape.chunk)
        return torch.tensor([ids], dtype=torch.long, device=self.model.device), num_prompt_tokens

    def proprio_features(self, proprio: Optional[np.ndarray], stats_key: str) -> Optional[torch.Tensor]:
        """Raw proprio [proprio_dim] -> the projected token [1, 1, H] (None without proprio: no token, as upstream)."""
        if proprio is None:
            return None
        if self.proprio_projector is None:
            raise OFTHeadError("proprio was given but the release folder has no proprio_projector--*checkpoint.pt")
        stats = self.norm_stats.datasets[stats_key].proprio
        if stats is None:
            raise OFTHeadError(f"{self.norm_stats.source}: {stats_key} has no proprio statistics to normalise with")
        state = np.asarray(proprio, dtype=np.float64).reshape(-1)
        if state.shape[0] != self.shape.proprio_dim:
            raise ValueError(f"proprio must have proprio_dim={self.shape.proprio_dim} values, got {state.shape[0]}")
        normed = normalize_proprio(state, stats, self.normalization)
        # float64 -> float32 -> model dtype, as upstream's torch.Tensor(proprio).to(dtype)
        tensor = torch.as_tensor(normed, dtype=torch.float32).to(self.model.device, self.model.dtype)
        return self.proprio_projector(tensor[None])

    def action_stats(self, unnorm_key: Optional[str]) -> Tuple[str, ArrayStats]:
        key = self.norm_stats.resolve_key(unnorm_key)
        stats = self.norm_stats.datasets[key].action
        if stats.dim != self.shape.action_dim:
            raise OFTHeadError(
                f"{self.norm_stats.source}: {key} has {stats.dim} action dimensions but the model predicts "
                f"action_dim={self.shape.action_dim}; pass the matching unnorm_key or action_dim"
            )
        return key, stats

    @torch.inference_mode()
    def hidden_states(
        self, images: Sequence[np.ndarray], instruction: str, stats_key: str, proprio: Optional[np.ndarray] = None
    ) -> torch.Tensor:
        """The action slots' final-normed hidden states [1, chunk * action_dim, H]."""
        ids, num_prompt_tokens = self.query_ids(instruction)
        features = self.proprio_features(proprio, stats_key)
        embeddings, num_patches = oft_embeddings(self.model, self.pixel_values(images), ids, self.shape.slots, features)
        hidden = bidirectional_hidden_states(self.model, embeddings)
        return action_hidden_states(hidden, num_patches, num_prompt_tokens, self.shape.slots)

    def predict_action(
        self,
        images: Union[np.ndarray, Sequence[np.ndarray]],
        instruction: str,
        unnorm_key: Optional[str] = None,
        proprio: Optional[np.ndarray] = None,
        head: Head = "l1",
        temperature: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
    ) -> np.ndarray:
        """float64 [chunk, action_dim] un-normalised actions (eps 1e-8, as OFT), deterministic unless sampled.

        head="l1": the L1 regression head. head="discrete": the LLM's action tokens at the action slots, argmax
        (temperature None) or sampled at `temperature` (see `decode_discrete` for the ids and log-probs).
        `images`: the frames, primary camera first (LIBERO: primary, then wrist), or one frame [H, W, 3] alone.
        """
        if isinstance(images, np.ndarray):
            images = [images]
        if head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}; got {head!r}")
        if head == "discrete":
            return self.decode_discrete(images, instruction, unnorm_key, proprio, temperature, generator).actions
        if temperature is not None:
            raise ValueError("temperature applies to head='discrete' only; the L1 head is deterministic")
        if self.action_head is None:
            raise OFTHeadError("head='l1' needs an action_head--*checkpoint.pt in the release folder")
        key, stats = self.action_stats(unnorm_key)
        with torch.inference_mode():
            normed = self.action_head(self.hidden_states(images, instruction, key, proprio))[0]
        return unnormalize_actions(normed.float().cpu().numpy(), stats, self.normalization, OFT_UNNORM_EPS)

    def decode_discrete(
        self,
        images: Sequence[np.ndarray],
        instruction: str,
        unnorm_key: Optional[str] = None,
        proprio: Optional[np.ndarray] = None,
        temperature: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
    ) -> DiscreteActions:
        """The discrete OFT variant: `lm_head` at the action slots, de-tokenised as OpenVLA, reshaped to a chunk."""
        key, stats = self.action_stats(unnorm_key)
        with torch.inference_mode():
            logits = self.model.language_model.lm_head(self.hidden_states(images, instruction, key, proprio))[0]
        log_prob: Optional[torch.Tensor] = None
        if temperature is None:
            tokens = greedy_action_tokens(logits)
        else:
            tokens, log_prob = sample_action_tokens(logits, self.base.bins, temperature, generator)
            log_prob = log_prob.reshape(self.shape.chunk, self.shape.action_dim)
        tokens = tokens.reshape(self.shape.chunk, self.shape.action_dim).cpu()
        normed = self.base.bins.decode(tokens.numpy())
        actions = unnormalize_actions(normed, stats, self.normalization, OFT_UNNORM_EPS)
        return DiscreteActions(token_ids=tokens, log_prob=log_prob, actions=actions)


def load_oft(
    path: PathLike,
    chunk: int = 8,
    action_dim: int = 7,
    proprio_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    normalization: Normalization = "bounds_q99",
) -> ReleasedOpenVLAOFT:
    """An OFT release folder: the OpenVLA layout plus `action_head--*` / `proprio_projector--*checkpoint.pt`.

    chunk / action_dim / proprio_dim default to LIBERO's (8, 7, 8). The head files are read and checked against
    them before the VLA itself is loaded; no file stores `chunk`, so it must be given for other platforms.
    """
    folder = Path(path)
    shape = OFTShape(chunk, action_dim, proprio_dim)
    check_supported_components(folder)
    files = {name: find_component_file(folder, name) for name in (ACTION_HEAD, PROPRIO_PROJECTOR)}
    if not any(files.values()):
        raise OFTHeadError(
            f"{folder} has no {ACTION_HEAD}--*checkpoint.pt or {PROPRIO_PROJECTOR}--*checkpoint.pt: it is a plain "
            "OpenVLA release; load it with release.load_pretrained"
        )
    llm_dim = read_release_config(folder).llama().hidden_size
    head_path, projector_path = files[ACTION_HEAD], files[PROPRIO_PROJECTOR]
    head = None if head_path is None else load_action_head(head_path, shape, llm_dim, dtype, device)
    projector = (
        None if projector_path is None else load_proprio_projector(projector_path, shape, llm_dim, dtype, device)
    )
    return ReleasedOpenVLAOFT(load_pretrained(folder, dtype, device), head, projector, shape, normalization)
