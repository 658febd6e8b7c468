"""Released OpenVLA / OpenVLA-OFT checkpoints in `model.path`: which folders, a cheap preflight, and the map from
policy-space actions to environment actions.

- `checkpoint_folders(cfg)`: the release folder and, when `model.path` is a peft LoRA adapter folder, the adapter
  (its base from `model.base_path`, else the adapter_config.json's `base_model_name_or_path`).
- `check_checkpoint(cfg)`: what `plan` / `run` / `submit` / `eval` check before anything starts: the folders are
  readable, the type fits (an `openvla-oft` spec with the L1 head needs the head files), `model.unnorm_key`
  resolves, and the statistics' action size fits. It reads JSON files and file names only (no weights), so it
  costs milliseconds even for a 7B checkpoint. Errors are `CheckpointError`s naming the spec field.
- `env_action_transform(cfg)`: a policy's actions are normalised (the release's bins live in [-1, 1]); the
  environment gets them de-normalised with the statistics of `model.unnorm_key`, then post-processed
  (`model.gripper`). The simulator and the eval loops apply it right before `env.step`; segments keep the
  policy-space actions, which is what the learner's log-probs are of.
- `load_pretrained(path)`: the public entry for scripts; OFT when the folder holds head files, π0 when its
  config.json has transformers' `model_type: pi0` (`check_checkpoint` checks such a folder's files for
  `model.type: pi0`).

A folder a tiny random-init policy saved (config.json `model_type` "vlaslurm-tiny-vla": its build arguments and
weights) is not a released checkpoint: the preflight checks its recorded type and shapes, its transform is the
identity (no dataset statistics). Heavy imports are lazy:
`vlaslurm.models` is imported at startup, transformers / peft / safetensors only when a checkpoint is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch  # already imported with vlaslurm.models (base.py)

from vlaslurm.spec.errors import close_names
from vlaslurm.spec.model_types import ModelConfig, OpenVLAOFTConfig, PI0PolicyConfig, VLAConfig

if TYPE_CHECKING:
    from vlaslurm.models.pi0.policy import PI0Policy
    from vlaslurm.models.prismatic.actions import ArrayStats, NormStats
    from vlaslurm.models.prismatic.oft import ReleasedOpenVLAOFT
    from vlaslurm.models.prismatic.release import ReleasedOpenVLA

PathLike = Union[str, Path]
ActionTransform = Callable[[np.ndarray], np.ndarray]

# The release's and peft's file names, spelled here so that the preflight imports neither transformers nor peft
# (prismatic/release.py and prismatic/lora.py use the libraries' own constants, which are these).
CONFIG_FILE = "config.json"
RELEASE_MODEL_TYPE = "openvla"
PI0_MODEL_TYPE = "pi0"  # transformers' PI0Config.model_type
# A tiny random init this project saved (vla/tiny.py): config.json's model_type (its weights: one *.safetensors)
TINY_MODEL_TYPE = "vlaslurm-tiny-vla"
PI0_POLICY_FILE = "vlaslurm_pi0.json"  # beside a π0 this project saved: action size, sampler, critic, vision
WEIGHTS_SUFFIX = ".safetensors"  # the shards, or the one file save_pretrained writes when everything fits
TOKENIZER_FILE = "tokenizer.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# OFT's head files: upstream's find_checkpoint_file takes the one file whose name holds the component and
# "checkpoint" (action_head--150000_checkpoint.pt); prismatic/oft.py reads them.
ACTION_HEAD = "action_head"
PROPRIO_PROJECTOR = "proprio_projector"
HEAD_COMPONENTS = (ACTION_HEAD, PROPRIO_PROJECTOR)
CHECKPOINT_WORD = "checkpoint"


class CheckpointError(ValueError):
    """A checkpoint folder the runtime would refuse; `field` is the spec field to change (`model.path`, ...)."""

    def __init__(self, field: str, reason: str, suggestions: Sequence[str] = ()) -> None:
        self.field, self.reason, self.suggestions = field, reason, list(suggestions)
        hint = f" (did you mean: {', '.join(self.suggestions)}?)" if self.suggestions else ""
        super().__init__(f"{field}: {reason}{hint}")


@dataclass(frozen=True)
class CheckpointFolders:
    """Where a released checkpoint's files are."""

    release: Path
    """The folder with config.json (model_type "openvla"), the weights, the tokenizer and the statistics."""
    adapter: Optional[Path]
    """The peft LoRA adapter folder over `release` (`model.path`), or None."""
    is_oft: bool
    """Whether `release` holds OFT head files (action_head--*checkpoint.pt / proprio_projector--*checkpoint.pt)."""

    @property
    def release_field(self) -> str:
        """The spec field that names `release`, for error messages."""
        return "model.base_path" if self.adapter is not None else "model.path"


# --- folders --------------------------------------------------------------------------------------------------


def is_adapter_folder(path: PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def release_model_type(path: PathLike) -> Optional[str]:
    """config.json's `model_type` (None when there is no readable config.json holding a string there)."""
    try:
        raw = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("model_type") if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def is_released_checkpoint(path: PathLike) -> bool:
    """A release folder (config.json with model_type "openvla") or a peft adapter folder, as opposed to a folder
    a tiny policy saved (model_type "vlaslurm-tiny-vla") or nothing."""
    return is_adapter_folder(path) or release_model_type(path) == RELEASE_MODEL_TYPE


def head_files(folder: PathLike) -> Dict[str, List[Path]]:
    """{component: the files upstream's find_checkpoint_file would consider}, for both OFT heads."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    return {c: [p for p in files if c in p.name and CHECKPOINT_WORD in p.name] for c in HEAD_COMPONENTS}


def checkpoint_folders(cfg: ModelConfig) -> CheckpointFolders:
    """The release folder (and adapter folder) of `cfg.path`; a `CheckpointError` names the field to fix."""
    if cfg.path is None:
        raise CheckpointError("model.path", "is not set; name a released checkpoint folder or a LoRA adapter folder")
    path = Path(cfg.path).expanduser()
    if not path.is_dir():
        raise CheckpointError("model.path", f"folder {str(path)!r} does not exist (relative paths: from {Path.cwd()})")
    base_path = getattr(cfg, "base_path", None)
    adapter: Optional[Path] = None
    if is_adapter_folder(path):
        adapter = path
        release = _adapter_base(path, base_path)
    else:
        if base_path is not None:
            raise CheckpointError(
                "model.base_path",
                f"is set but model.path {str(path)!r} is not a LoRA adapter folder (no {ADAPTER_CONFIG_FILE}); "
                "remove model.base_path to load the release in model.path itself",
            )
        release = path
    field = "model.base_path" if adapter is not None else "model.path"
    if not (release / CONFIG_FILE).is_file():
        raise CheckpointError(
            field,
            f"folder {str(release)!r} holds no {CONFIG_FILE}: not an OpenVLA release folder (nor a LoRA adapter "
            f"folder: no {ADAPTER_CONFIG_FILE})",
        )
    if is_adapter_folder(release):
        raise CheckpointError(field, f"{str(release)!r} is itself an adapter folder; name the release it adapts")
    found = head_files(release)
    return CheckpointFolders(release=release, adapter=adapter, is_oft=any(found.values()))


def _adapter_base(adapter: Path, base_path: Optional[str]) -> Path:
    if base_path is not None:
        base = Path(base_path).expanduser()
        if not base.is_dir():
            raise CheckpointError(
                "model.base_path", f"folder {str(base)!r} does not exist (relative paths: from {Path.cwd()})"
            )
        return base
    config_file = adapter / ADAPTER_CONFIG_FILE
    raw = _read_json(config_file, "model.path")
    recorded = raw.get("base_model_name_or_path")
    if not isinstance(recorded, str) or not recorded:
        raise CheckpointError(
            "model.base_path",
            f"is needed: {config_file} records no base_model_name_or_path; set it to the release folder the "
            "adapter was trained on",
        )
    # As recorded (from the folder it was saved from, or absolute); else beside the adapter, for a moved pair.
    for candidate in (Path(recorded).expanduser(), adapter.parent / recorded, adapter / recorded):
        if candidate.is_dir():
            return candidate
    raise CheckpointError(
        "model.base_path",
        f"is needed: {config_file} records base_model_name_or_path {recorded!r}, which is not a folder here; "
        "set model.base_path to the release folder the adapter was trained on",
    )


# --- preflight ------------------------------------------------------------------------------------------------


def check_checkpoint(
    cfg: ModelConfig,
    action_dim: Optional[int] = None,
    state: Optional[bool] = None,
    images: Optional[bool] = None,
    state_dim: Optional[int] = None,
) -> None:
    """Raise a `CheckpointError` if the runtime would refuse `cfg.path`; nothing for a random init.

    `action_dim`, when given (the environment's), must equal the statistics' action dimensions; `state` and
    `images` (whether the environment gives them) must be true for a proprio projector and for any VLA;
    `state_dim` (the environment's state size), when given, must be a saved tiny policy's.
    """
    if cfg.path is not None and isinstance(cfg, PI0PolicyConfig):
        return _check_pi0_folder(Path(cfg.path).expanduser(), cfg.vision)
    if cfg.path is None or not isinstance(cfg, VLAConfig):
        return
    path = Path(cfg.path).expanduser()
    if path.is_dir() and release_model_type(path) == TINY_MODEL_TYPE:
        return _check_tiny_folder(path, cfg, action_dim, state_dim)
    folders = checkpoint_folders(cfg)
    field = folders.release_field
    model_type = _read_json(folders.release / CONFIG_FILE, field).get("model_type")
    if model_type != RELEASE_MODEL_TYPE:
        raise CheckpointError(
            field,
            f"{folders.release / CONFIG_FILE} has model_type {model_type!r}; a released checkpoint has "
            f"{RELEASE_MODEL_TYPE!r} (OpenVLAForActionPrediction), and an adapter must lie over one",
        )
    _check_files(folders, field)
    if folders.adapter is not None:
        _check_adapter(folders.adapter, cfg)
    _check_heads(cfg, folders, field)
    stats = _norm_stats(folders, field)
    key = resolve_unnorm_key(stats, cfg.unnorm_key)
    dim = stats.datasets[key].action.dim
    if head_files(folders.release)[PROPRIO_PROJECTOR] and stats.datasets[key].proprio is None:
        raise CheckpointError(
            "model.unnorm_key",
            f"{key!r} ({stats.source}) has no proprio statistics, which the checkpoint's proprio projector needs to "
            "normalise the robot state; pick a dataset that has them",
        )
    if images is False:
        raise CheckpointError("model.path", "a VLA reads camera images: set env.obs.image_size and env.obs.cameras")
    if state is False and head_files(folders.release)[PROPRIO_PROJECTOR]:
        raise CheckpointError(
            "model.path",
            f"{folders.release} has a proprio projector, which reads the robot state: set env.obs.state: true",
        )
    if action_dim is not None and dim != action_dim:
        raise CheckpointError(
            "model.unnorm_key",
            f"the statistics of {key!r} ({stats.source}) have {dim} action dimensions but the environment takes "
            f"{action_dim}; pick the dataset of this robot, or a checkpoint trained for it",
        )


def _check_tiny_folder(folder: Path, cfg: VLAConfig, action_dim: Optional[int], state_dim: Optional[int]) -> None:
    """A tiny policy's saved folder (vla/tiny.py): its recorded type and chunk against the spec's, its action and
    state sizes against the environment's (where known)."""
    recipe = _read_json(folder / CONFIG_FILE, "model.path").get("build_tiny")
    if not isinstance(recipe, dict):
        raise CheckpointError("model.path", f"{folder / CONFIG_FILE} records no build_tiny arguments")
    if not any(p.is_file() for p in folder.glob(f"*{WEIGHTS_SUFFIX}")):
        raise CheckpointError("model.path", f"folder {str(folder)!r} holds no weights (*{WEIGHTS_SUFFIX})")
    checks = [
        ("model.type", "kind", cfg.type, f"is {cfg.type!r}"),
        ("model.action_chunk", "action_chunk", cfg.action_chunk, f"is {cfg.action_chunk!r}"),
    ]
    if action_dim is not None:
        checks.append(("model.action_dim", "action_dim", action_dim, f"is {action_dim!r}"))
    if state_dim is not None:  # the proprio projector's input: the environment's state size (the field is a bool)
        checks.append(("env.obs.state", "state_dim", state_dim, f"the environment gives {state_dim} state values"))
    for field, key, wanted, spec_side in checks:
        if recipe.get(key) != wanted:
            raise CheckpointError(field, f"{spec_side} but the policy in {folder} was saved with {recipe.get(key)!r}")


def _check_pi0_folder(folder: Path, vision: str) -> None:
    if not folder.is_dir():
        raise CheckpointError(
            "model.path", f"folder {str(folder)!r} does not exist (relative paths: from {Path.cwd()})"
        )
    model_type = _read_json(folder / CONFIG_FILE, "model.path").get("model_type")
    if model_type != PI0_MODEL_TYPE:
        raise CheckpointError(
            "model.path",
            f"{folder / CONFIG_FILE} has model_type {model_type!r}; model.type pi0 reads a folder in transformers' "
            f"PI0 layout (model_type {PI0_MODEL_TYPE!r})",
        )
    if not any(p.is_file() for p in folder.glob(f"*{WEIGHTS_SUFFIX}")):
        raise CheckpointError("model.path", f"folder {str(folder)!r} holds no weights (*{WEIGHTS_SUFFIX} files)")
    saved = folder / PI0_POLICY_FILE
    saved_vision = _read_json(saved, "model.path").get("vision", "siglip") if saved.is_file() else "siglip"
    if saved_vision != vision:
        raise CheckpointError("model.vision", f"is {vision} but {folder} was saved with vision: {saved_vision}")


def _check_files(folders: CheckpointFolders, field: str) -> None:
    release = folders.release
    if not any(p.is_file() for p in release.glob(f"*{WEIGHTS_SUFFIX}")):
        raise CheckpointError(
            field, f"folder {str(release)!r} holds no weights (*{WEIGHTS_SUFFIX} files, as save_pretrained writes them)"
        )
    if not (release / TOKENIZER_FILE).is_file():
        raise CheckpointError(field, f"folder {str(release)!r} holds no {TOKENIZER_FILE} (the release's tokenizer)")


def _check_adapter(adapter: Path, cfg: VLAConfig) -> None:
    raw = _read_json(adapter / ADAPTER_CONFIG_FILE, "model.path")
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(
            "model.path",
            f"{adapter / ADAPTER_CONFIG_FILE} has peft_type {raw.get('peft_type')!r}; only LORA is supported",
        )
    if not (adapter / ADAPTER_WEIGHTS_FILE).is_file():
        raise CheckpointError("model.path", f"adapter folder {str(adapter)!r} holds no {ADAPTER_WEIGHTS_FILE}")
    if cfg.lora is None:
        return
    # With model.lora set, the adapters are made from it and the folder's weights loaded into them: the sizes
    # must be the folder's (remove model.lora to take the folder's settings as they are).
    for name, stored, ours in (("rank", raw.get("r"), cfg.lora.rank), ("alpha", raw.get("lora_alpha"), cfg.lora.alpha)):
        if stored is not None and stored != ours:
            raise CheckpointError(
                f"model.lora.{name}",
                f"is {ours} but the adapter in model.path was trained with {stored} ({adapter / ADAPTER_CONFIG_FILE}); "
                f"set {stored}, or remove model.lora to use the adapter's own settings",
            )


def _check_heads(cfg: VLAConfig, folders: CheckpointFolders, field: str) -> None:
    found = head_files(folders.release)
    for component, files in found.items():
        if len(files) > 1:
            names = ", ".join(p.name for p in files)
            raise CheckpointError(
                field, f"{folders.release} holds {len(files)} {component} checkpoints ({names}); keep exactly one"
            )
    if isinstance(cfg, OpenVLAOFTConfig) and cfg.head == "l1" and not found[ACTION_HEAD]:
        what = "an OpenVLA-OFT release folder" if folders.is_oft else "a plain OpenVLA release"
        raise CheckpointError(
            field,
            f"{folders.release} is {what} without an {ACTION_HEAD}--*{CHECKPOINT_WORD}.pt, which model.head: l1 "
            "reads; use model.head: discrete (the LLM's action tokens) or model.type: openvla",
        )


def _norm_stats(folders: CheckpointFolders, field: str) -> NormStats:
    from vlaslurm.models.prismatic.actions import NormStatsError, load_norm_stats

    try:
        return load_norm_stats(folders.release)
    except NormStatsError as err:
        raise CheckpointError(field, f"the dataset statistics cannot be read: {err}") from None


def resolve_unnorm_key(stats: NormStats, unnorm_key: Optional[str]) -> str:
    """`model.unnorm_key` checked against the statistics (`NormStats.resolve_key`: None needs exactly one dataset),
    as a spec error naming the field, with close names on a typo."""
    from vlaslurm.models.prismatic.actions import UnnormKeyError

    try:
        return stats.resolve_key(unnorm_key)
    except UnnormKeyError:
        keys = list(stats.datasets)
    if unnorm_key is None:
        raise CheckpointError(
            "model.unnorm_key",
            f"is required: {stats.source} holds statistics of {len(keys)} datasets ({', '.join(keys)}); set it to "
            "the dataset whose actions the policy should produce",
        )
    raise CheckpointError(
        "model.unnorm_key",
        f"{unnorm_key!r} is not a dataset of {stats.source}; datasets: {', '.join(keys)}",
        suggestions=close_names(unnorm_key, keys),
    )


def _read_json(path: Path, field: str) -> Dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise CheckpointError(field, f"{path} cannot be read ({err.strerror or err})") from None
    except ValueError as err:
        raise CheckpointError(field, f"{path} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(field, f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


# --- policy space -> environment ------------------------------------------------------------------------------


def identity(actions: np.ndarray) -> np.ndarray:
    return np.asarray(actions, dtype=np.float32)


def env_action_transform(cfg: ModelConfig) -> ActionTransform:
    """policy-space actions float32 [..., A] -> environment actions float32 [..., A]; build it once per process.

    For a released checkpoint: the release's de-normalisation with the statistics of `model.unnorm_key`
    (bounds q01/q99, the mask's dimensions only; eps 0 for openvla, OFT's 1e-8 for openvla-oft). Then, with
    `model.gripper: libero`, the release's LIBERO gripper post-processing (for any VLA, also one randomly
    initialised, whose actions are otherwise passed through as they are).
    """
    if not isinstance(cfg, VLAConfig):
        return identity
    steps: List[ActionTransform] = []
    if cfg.path is not None and is_released_checkpoint(Path(cfg.path).expanduser()):
        steps.append(_unnormalizer(cfg))
    if cfg.gripper == "libero":
        from vlaslurm.models.prismatic.actions import libero_gripper_postprocess

        steps.append(libero_gripper_postprocess)
    if not steps:
        return identity

    def transform(actions: np.ndarray) -> np.ndarray:
        out = np.asarray(actions)
        for step in steps:
            out = step(out)
        return np.asarray(out, dtype=np.float32)

    return transform


def _unnormalizer(cfg: VLAConfig) -> ActionTransform:
    from vlaslurm.models.prismatic.actions import OFT_UNNORM_EPS, OPENVLA_UNNORM_EPS, unnormalize_actions

    folders = checkpoint_folders(cfg)
    stats = _norm_stats(folders, folders.release_field)
    action_stats: ArrayStats = stats.datasets[resolve_unnorm_key(stats, cfg.unnorm_key)].action
    eps = OFT_UNNORM_EPS if isinstance(cfg, OpenVLAOFTConfig) else OPENVLA_UNNORM_EPS

    def unnormalize(actions: np.ndarray) -> np.ndarray:
        return unnormalize_actions(actions, action_stats, "bounds_q99", eps)

    return unnormalize


# --- the public entry for scripts -----------------------------------------------------------------------------


def load_pretrained(
    path: PathLike,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    *,
    chunk: Optional[int] = None,
    action_dim: Optional[int] = None,
    proprio_dim: Optional[int] = None,
) -> Union[ReleasedOpenVLA, ReleasedOpenVLAOFT, PI0Policy]:
    """A released checkpoint folder, loaded strictly and frozen: OpenVLA-OFT when it holds head files (LIBERO's
    chunk 8, action_dim 7, proprio_dim 8 unless `chunk=`, `action_dim=`, `proprio_dim=` say otherwise), else
    OpenVLA. `policy.predict_action(image_or_images, instruction, unnorm_key=None, proprio=None)` gives the
    release's de-normalised actions: [action_dim] for OpenVLA, [chunk, action_dim] for OFT.

    A folder in transformers' PI0 layout gives a `PI0Policy` (its chunk from config.json, `action_dim` by default
    its max_action_dim); `predict_action(images, instruction, state=None, seed=0)` the ODE's chunk
    [chunk, action_dim] in the checkpoint's (normalised) action space."""
    from vlaslurm.models.prismatic import oft, release

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise release.ReleaseError(f"{folder} is not a folder; pass a release folder holding {CONFIG_FILE}")
    if release_model_type(folder) == PI0_MODEL_TYPE:
        return _load_pi0(folder, dtype, device, chunk, action_dim, proprio_dim)
    if is_adapter_folder(folder):
        raise release.ReleaseError(
            f"{folder} is a LoRA adapter folder; load its base release, or use it as model.path with model.base_path"
        )
    given = {"chunk": chunk, "action_dim": action_dim, "proprio_dim": proprio_dim}
    shape = {name: value for name, value in given.items() if value is not None}
    if any(head_files(folder).values()):
        libero = oft.PLATFORMS["libero"]  # no release file stores the chunk: LIBERO's constants by default
        return oft.load_oft(
            folder,
            chunk=libero.chunk if chunk is None else chunk,
            action_dim=libero.action_dim if action_dim is None else action_dim,
            proprio_dim=libero.proprio_dim if proprio_dim is None else proprio_dim,
            dtype=dtype,
            device=device,
        )
    if shape:
        raise TypeError(f"{', '.join(shape)} apply to OpenVLA-OFT folders only; {folder} holds no OFT head files")
    return release.load_pretrained(folder, dtype, device)


def _load_pi0(
    folder: Path,
    dtype: torch.dtype,
    device: Union[str, torch.device],
    chunk: Optional[int],
    action_dim: Optional[int],
    proprio_dim: Optional[int],
) -> PI0Policy:
    from vlaslurm.models.pi0.build import load_pi0

    if proprio_dim is not None:
        raise TypeError(f"proprio_dim applies to OpenVLA-OFT folders; {folder} is a π0 (state: max_state_dim)")
    policy = load_pi0(folder, action_dim=action_dim, dtype=dtype, device=device)
    if chunk is not None and chunk != policy.action_chunk:
        raise ValueError(f"{folder} predicts chunks of {policy.action_chunk} (config.json chunk_size), not {chunk}")
    return policy
