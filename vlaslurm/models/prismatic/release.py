"""The OpenVLA release folder (openvla/openvla-7b's layout): read it strictly, or write one.

`load_pretrained(folder)` reads config.json into a typed `ReleaseConfig`, builds the model on `meta`, loads the
(sharded) safetensors so that every key must match, and returns a `ReleasedOpenVLA` that maps an RGB frame and an
instruction to actions. `save_release_layout` writes the same layout (tests make tiny random checkpoints with it).
No remote code, no network. Facts: /work/shared/facts/openvla-checkpoints.md, sections 1, 2, 3 and 6.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from vlaslurm.models.prismatic.actions import LLAMA2_VOCAB_SIZE, ActionBins, NormStats, load_norm_stats
from vlaslurm.models.prismatic.preprocess import (
    BOS_ID,
    EMPTY_TOKEN_ID,
    PIL_RESAMPLING,
    STOP_TOKEN_ID,
    ImageTransform,
    TextEncoder,
    prompt_token_ids,
    read_preprocessor_config,
)
from vlaslurm.models.prismatic.projector import ARCH_SPECIFIER
from vlaslurm.models.prismatic.vit import OVERRIDABLE, DinoV2Config, SigLIPConfig, ViTConfig, tower_configs
from vlaslurm.models.prismatic.vla import LLAMA_DEFAULTS, PrismaticVLA, llama_config

PathLike = Union[str, Path]

# --- the release's file names ---------------------------------------------------------------------------------
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# save_pretrained's own names (the release is a transformers folder): the shard index, and the one file written
# when everything fits in a single shard.
WEIGHTS_INDEX_FILE = SAFE_WEIGHTS_INDEX_NAME
SINGLE_WEIGHTS_FILE = SAFE_WEIGHTS_NAME
PREPROCESSOR_FILE = "preprocessor_config.json"
DATASET_STATISTICS_FILE = "dataset_statistics.json"
TOKENIZER_FILE = "tokenizer.json"
# What processor.save_pretrained leaves besides tokenizer.json (the release also has the sentencepiece
# tokenizer.model, which nothing here reads or writes).
TOKENIZER_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SHARD_PATTERN = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")

FUSED_TIMM_IDS = (DinoV2Config.timm_id, SigLIPConfig.timm_id)
VISION_BACKBONES = {"dinosiglip-vit-so-224px": (FUSED_TIMM_IDS, (224, 224))}  # what vision_backbone_id implies
MODEL_TYPE = "openvla"
PAD_TOKEN_ID = 32000  # '<PAD>', added after the 32000 Llama-2 ids
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers 4.40.1's save_pretrained default (openvla-7b itself used 7GB)
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
# Tiny test checkpoints (the facts sheet's convention): release parameter names at a few MB.
TINY_TIMM_OVERRIDES = ({"embed_dim": 32, "depth": 4, "num_heads": 2}, {"embed_dim": 48, "depth": 4, "num_heads": 3})
TINY_TEXT_CONFIG = {
    "model_type": "llama",
    "pad_token_id": PAD_TOKEN_ID,
    "vocab_size": 32064,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


class ReleaseError(ValueError):
    """A release folder that does not have the layout, fields or tensors this loader requires."""


class ReleaseConfigError(ReleaseError):
    """config.json: a missing, mistyped or unsupported field."""


class ReleaseWeightsError(ReleaseError):
    """The safetensors: missing or unexpected keys, wrong shapes, an inconsistent index."""


# --- config.json ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseConfig:
    """The config.json fields that decide the model, validated once when read."""

    timm_model_ids: Tuple[str, ...]
    """The two vision towers, DINOv2 first (`featurizer`), then SigLIP (`fused_featurizer`)."""
    image_sizes: Tuple[int, ...]
    """Input side per tower (224, 224)."""
    text_config: Mapping[str, Any]
    """The LLM fields that differ from `LlamaConfig()`'s defaults, as stored (vocab_size 32064, pad 32000)."""
    n_action_bins: int = 256
    """Action bins per dimension; the action ids are the last n_action_bins ids of the unpadded vocabulary."""
    pad_to_multiple_of: int = 64
    """Padding rows added to the vocabulary; `text_config.vocab_size - pad_to_multiple_of` is the unpadded size."""
    norm_stats: Optional[Mapping[str, Any]] = None
    """Per-dataset statistics (`unnorm_key` -> action/proprio); dataset_statistics.json takes precedence."""
    use_fused_vision_backbone: bool = True
    """Whether the two towers' features are concatenated; only the fused backbone is implemented."""
    arch_specifier: str = ARCH_SPECIFIER
    """The projector; only `no-align+fused-gelu-mlp` is implemented."""
    tiny_timm_overrides: Optional[Tuple[Mapping[str, Any], ...]] = None
    """Test checkpoints only: timm architecture arguments replacing each tower's defaults."""
    model_type: str = MODEL_TYPE
    """`openvla` (OpenVLAForActionPrediction)."""
    source: str = CONFIG_FILE
    """The file this was read from, for error messages."""

    def towers(self) -> Tuple[DinoV2Config, SigLIPConfig]:
        return tower_configs(self.timm_model_ids, self.image_sizes, self.tiny_timm_overrides)

    def llama(self) -> LlamaConfig:
        """The LLM's `LlamaConfig` (the defaults the release relies on, then `text_config`)."""
        return llama_config(self.text_config, f"{self.source}: text_config")

    def action_bins(self) -> ActionBins:
        fields = {"n_action_bins": self.n_action_bins, "pad_to_multiple_of": self.pad_to_multiple_of}
        return ActionBins.from_config({**fields, "text_config": dict(self.text_config)})


def read_release_config(path: PathLike) -> ReleaseConfig:
    """A release's config.json (or the folder holding it) as a validated `ReleaseConfig`."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    return parse_release_config(_read_json_object(path, ReleaseConfigError), str(path))


def parse_release_config(raw: Mapping[str, Any], source: str = CONFIG_FILE) -> ReleaseConfig:
    """Check types and supported values of config.json's fields; errors name the file and the field."""
    fields = _ConfigFields(raw, source)
    model_type = fields.get("model_type", str, "a string", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ReleaseConfigError(
            f"{source}: model_type is {model_type!r}; only {MODEL_TYPE!r} (OpenVLAForActionPrediction) is "
            "supported. A Prismatic VLM without action tokens has no predict_action."
        )
    timm_ids, sizes = _backbone(fields)
    config = ReleaseConfig(
        timm_model_ids=timm_ids,
        image_sizes=sizes,
        text_config=_text_config(fields),
        n_action_bins=fields.get("n_action_bins", _is_int, "an integer", 256),
        pad_to_multiple_of=fields.get("pad_to_multiple_of", _is_int, "an integer", 64),
        norm_stats=fields.get("norm_stats", _is_mapping, "an object of dataset statistics", None),
        use_fused_vision_backbone=_fused(fields),
        arch_specifier=_arch_specifier(fields),
        tiny_timm_overrides=_tiny_overrides(fields),
        model_type=model_type,
        source=source,
    )
    _check_act_layers(fields)
    _check_buildable(config)
    return config


_REQUIRED: Any = object()  # the default of a field that config.json must hold


class _ConfigFields:
    """Typed access to config.json's top-level fields; a wrong value names the file, the field and the type."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, name: str, check: Union[type, Callable[[Any], bool]], expected: str, default: Any = _REQUIRED) -> Any:
        if name not in self.raw or (self.raw[name] is None and default is not _REQUIRED):
            if default is _REQUIRED:
                raise ReleaseConfigError(f"{self.source}: {name} is required ({expected})")
            return default
        value = self.raw[name]
        ok = isinstance(value, check) if isinstance(check, type) else check(value)
        if not ok:
            raise ReleaseConfigError(f"{self.source}: {name} must be {expected}, got {_describe(value)}")
        return value


def _is_mapping(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_config(fields: _ConfigFields) -> Mapping[str, Any]:
    text_config = fields.get("text_config", _is_mapping, "an object (the LLM's non-default LlamaConfig fields)")
    vocab_size = text_config.get("vocab_size")
    if not _is_int(vocab_size):
        raise ReleaseConfigError(
            f"{fields.source}: text_config.vocab_size must be an integer (32064 in the release: 32000 Llama-2 ids "
            f"+ 64 padding rows), got {_describe(vocab_size)}"
        )
    return text_config


def _backbone(fields: _ConfigFields) -> Tuple[Tuple[str, ...], Tuple[int, ...]]:
    # PrismaticConfig derives the towers from vision_backbone_id when they are not stored explicitly.
    backbone_id = fields.get("vision_backbone_id", str, "a string", None)
    implied = VISION_BACKBONES.get(backbone_id or "")
    default_ids = list(implied[0]) if implied else _REQUIRED
    default_sizes = list(implied[1]) if implied else _REQUIRED
    ids = fields.get("timm_model_ids", _is_str_list, "a list of timm model names", default_ids)
    sizes = fields.get("image_sizes", _is_int_list, "a list of integers (one input side per tower)", default_sizes)
    return tuple(ids), tuple(sizes)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


def _fused(fields: _ConfigFields) -> bool:
    backbone_id = fields.raw.get("vision_backbone_id") or ""
    # PrismaticConfig's default: fused for the dinosiglip / dinoclip backbones.
    default = backbone_id.startswith(("dinosiglip", "dinoclip")) if backbone_id else _REQUIRED
    fused = fields.get("use_fused_vision_backbone", bool, "true or false", default)
    if not fused:
        raise ReleaseConfigError(
            f"{fields.source}: use_fused_vision_backbone is false; only the fused DINOv2 + SigLIP backbone "
            "(dinosiglip-vit-so-224px, use_fused_vision_backbone: true) of the OpenVLA releases is implemented"
        )
    return True


def _arch_specifier(fields: _ConfigFields) -> str:
    arch = fields.get("arch_specifier", str, f"a string ({ARCH_SPECIFIER!r})")
    if arch != ARCH_SPECIFIER:
        raise ReleaseConfigError(
            f"{fields.source}: arch_specifier is {arch!r}; only {ARCH_SPECIFIER!r} (the projector of every "
            "OpenVLA / OFT release) is implemented"
        )
    return arch


def _tiny_overrides(fields: _ConfigFields) -> Optional[Tuple[Mapping[str, Any], ...]]:
    overrides = fields.get(
        "tiny_timm_overrides", _is_mapping_list, "a list of objects, one per timm_model_ids entry", None
    )
    return None if overrides is None else tuple(overrides)


def _is_mapping_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, Mapping) for v in value)


def _check_act_layers(fields: _ConfigFields) -> None:
    # Anything but None would replace the exact GELU the towers (and the release) use.
    layers = fields.get("timm_override_act_layers", list, "a list (one entry per tower)", None)
    if layers is not None and any(layer is not None for layer in layers):
        raise ReleaseConfigError(
            f"{fields.source}: timm_override_act_layers is {layers!r}; only [null, null] (timm's exact GELU, "
            "as in the releases) is implemented"
        )


def _check_buildable(config: ReleaseConfig) -> None:
    """Surface bad tower / LLM / bin fields now, with the file name, rather than when the model is built."""
    checks: Sequence[Callable[[], Any]] = (config.towers, config.llama, config.action_bins)
    for check in checks:
        try:
            check()
        except ValueError as err:
            message = str(err)
            raise ReleaseConfigError(message if config.source in message else f"{config.source}: {message}") from None


def release_config_json(config: ReleaseConfig, torch_dtype: str) -> Dict[str, Any]:
    """The config.json that the release's conversion script + save_pretrained write, for `config`."""
    import transformers

    text_config = {**config.text_config, "torch_dtype": torch_dtype}
    out: Dict[str, Any] = {
        "arch_specifier": config.arch_specifier,
        "architectures": ["OpenVLAForActionPrediction"],
        "auto_map": {
            "AutoConfig": "configuration_prismatic.OpenVLAConfig",
            "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction",
        },
        "hf_llm_id": "meta-llama/Llama-2-7b-hf",
        "image_resize_strategy": "resize-naive",
        "image_sizes": list(config.image_sizes),
        "llm_backbone_id": "llama2-7b-pure",
        "llm_max_length": 2048,
        "model_type": config.model_type,
        "n_action_bins": config.n_action_bins,
        "norm_stats": None if config.norm_stats is None else dict(config.norm_stats),
        "output_projector_states": False,
        "pad_to_multiple_of": config.pad_to_multiple_of,
        "pad_token_id": config.text_config.get("pad_token_id", PAD_TOKEN_ID),
        "text_config": dict(sorted(text_config.items())),
        "timm_model_ids": list(config.timm_model_ids),
        "timm_override_act_layers": [None] * len(config.timm_model_ids),
        "torch_dtype": torch_dtype,
        "transformers_version": transformers.__version__,
        "use_fused_vision_backbone": config.use_fused_vision_backbone,
        "vision_backbone_id": "dinosiglip-vit-so-224px",
    }
    if config.tiny_timm_overrides is not None:
        out["tiny_timm_overrides"] = [dict(o) for o in config.tiny_timm_overrides]
    return out


def release_config_for(
    vla: PrismaticVLA, norm_stats: Optional[Mapping[str, Any]], n_action_bins: int = 256, pad_to_multiple_of: int = 64
) -> ReleaseConfig:
    """The `ReleaseConfig` describing `vla`: only non-default tower and LLM fields are stored, as the release."""
    towers = (vla.vision_backbone.featurizer.cfg, vla.vision_backbone.fused_featurizer.cfg)
    overrides = tuple(_tower_overrides(cfg) for cfg in towers)
    llm = vla.language_model.config
    text_config = {"model_type": "llama", "pad_token_id": llm.pad_token_id, "vocab_size": llm.vocab_size}
    text_config.update({k: getattr(llm, k) for k, v in LLAMA_DEFAULTS.items() if getattr(llm, k) != v})
    return ReleaseConfig(
        timm_model_ids=FUSED_TIMM_IDS,
        image_sizes=tuple(cfg.image_size for cfg in towers),
        text_config=text_config,
        n_action_bins=n_action_bins,
        pad_to_multiple_of=pad_to_multiple_of,
        norm_stats=norm_stats,
        tiny_timm_overrides=overrides if any(overrides) else None,
    )


def _tower_overrides(cfg: ViTConfig) -> Dict[str, Any]:
    # The dataclass's class attributes hold the full-size defaults.
    return {key: getattr(cfg, key) for key in OVERRIDABLE if getattr(cfg, key) != getattr(type(cfg), key)}


def tiny_release_config(norm_stats: Optional[Mapping[str, Any]] = None, image_size: int = 224) -> ReleaseConfig:
    """A few-MB config with the release's parameter names: tiny towers and a 64-wide Llama. At the release's
    224 px the towers see 256 patches; a smaller `image_size` (a multiple of 14) cuts the sequence for runtime
    tests that exercise the release's code path, not its input size."""
    return ReleaseConfig(
        timm_model_ids=FUSED_TIMM_IDS,
        image_sizes=(image_size, image_size),
        text_config=dict(TINY_TEXT_CONFIG),
        norm_stats=norm_stats,
        tiny_timm_overrides=TINY_TIMM_OVERRIDES,
        source="tiny_release_config()",
    )


# --- building -------------------------------------------------------------------------------------------------


def build_vla(
    config: ReleaseConfig, device: Union[str, torch.device] = "meta", dtype: torch.dtype = torch.float32
) -> PrismaticVLA:
    """`PrismaticVLA` for `config`, parameters in `dtype`.

    On `meta` nothing is allocated (parameters have shapes only; load_weights assigns them); the rotary
    frequencies, non-persistent buffers that no checkpoint holds, are still computed for real, in float32.
    Elsewhere the module is randomly initialised on that device.
    """
    placement = _empty_weights() if torch.device(device).type == "meta" else torch.device(device)
    with default_dtype(dtype), placement:
        return PrismaticVLA(*config.towers(), config.llama())


@contextlib.contextmanager
def _empty_weights() -> Iterator[None]:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # As from_pretrained(torch_dtype=...) does: parameters are created in `dtype`, while the rotary frequencies,
    # which transformers computes explicitly in float32, stay float32 (a later .to(dtype) would round them).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# --- weights --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    shape: Tuple[int, ...]


def stored_tensors(folder: PathLike) -> Dict[str, StoredTensor]:
    """Every tensor in the folder's safetensors (via the index when there is one), checked against the index."""
    folder = Path(folder)
    index_path = folder / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / SINGLE_WEIGHTS_FILE).is_file():
        weight_map, files = None, [folder / SINGLE_WEIGHTS_FILE]
    else:
        raise ReleaseWeightsError(f"{folder} has neither {WEIGHTS_INDEX_FILE} nor {SINGLE_WEIGHTS_FILE}")
    stored: Dict[str, StoredTensor] = {}
    for file in files:
        _add_shard(stored, file, index_path)
    if weight_map is not None:
        _check_index(weight_map, stored, index_path)
    return stored


def _read_weight_map(index_path: Path) -> Dict[str, str]:
    index = _read_json_object(index_path, ReleaseWeightsError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ReleaseWeightsError(f"{index_path}: weight_map must be an object of tensor name -> shard file")
    elsewhere = sorted({name for name in weight_map.values() if Path(name).name != name})
    if elsewhere:  # shards live beside the index; anything else would read files outside the folder
        raise ReleaseWeightsError(f"{index_path}: shard names must be plain file names, got {_few(elsewhere)}")
    return dict(weight_map)


def _add_shard(stored: Dict[str, StoredTensor], file: Path, index_path: Path) -> None:
    if not file.is_file():
        raise ReleaseWeightsError(f"{index_path} names the shard {file.name}, which is not in {file.parent}")
    with safe_open(str(file), framework="pt") as shard:
        for key in shard.keys():
            if key in stored:
                raise ReleaseWeightsError(f"{key!r} is stored twice: in {stored[key].file.name} and {file.name}")
            stored[key] = StoredTensor(file, tuple(shard.get_slice(key).get_shape()))


def _check_index(weight_map: Mapping[str, str], stored: Mapping[str, StoredTensor], index_path: Path) -> None:
    absent = [
        f"{key} ({name})" for key, name in weight_map.items() if key not in stored or stored[key].file.name != name
    ]
    if absent:
        raise ReleaseWeightsError(
            f"{index_path} lists tensor(s) that their shard does not hold: {_few(absent)}; the checkpoint is "
            "incomplete or its index is stale"
        )
    unlisted = [key for key in stored if key not in weight_map]
    if unlisted:
        raise ReleaseWeightsError(f"{index_path} does not list tensor(s) its shards hold: {_few(unlisted)}")


def check_tensors(expected: Mapping[str, torch.Size], stored: Mapping[str, StoredTensor], where: str) -> None:
    """Strict: the stored keys must be exactly the model's, with the same shapes."""
    missing = [key for key in expected if key not in stored]
    unexpected = [key for key in stored if key not in expected]
    problems = []
    if missing:
        problems.append(f"missing key(s) {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected key(s) {_few(unexpected)}")
    if problems:
        raise ReleaseWeightsError(f"{where} does not match the model its config.json describes: {'; '.join(problems)}")
    wrong = [
        f"{key} {list(stored[key].shape)} (model: {list(shape)})"
        for key, shape in expected.items()
        if tuple(shape) != stored[key].shape
    ]
    if wrong:
        raise ReleaseWeightsError(f"{where}: tensor(s) of the wrong shape: {_few(wrong)}; check config.json's sizes")


def load_weights(vla: PrismaticVLA, folder: PathLike, dtype: torch.dtype, device: Union[str, torch.device]) -> None:
    """Fill a (meta) `vla` from the folder's safetensors, strictly, one shard at a time, without a second copy."""
    folder = Path(folder)
    stored = stored_tensors(folder)
    expected = {key: tensor.shape for key, tensor in vla.state_dict().items()}
    check_tensors(expected, stored, str(folder))
    for file in sorted({entry.file for entry in stored.values()}):
        with safe_open(str(file), framework="pt", device=str(torch.device(device))) as shard:
            tensors = {key: _cast(shard.get_tensor(key), dtype) for key in shard.keys()}
        # assign=True adopts the loaded tensors instead of copying them into the (meta) parameters.
        vla.load_state_dict(tensors, strict=False, assign=True)
        del tensors
    vla.to(device)  # only the buffers move; the parameters already live there
    _check_materialised(vla, folder)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _check_materialised(vla: PrismaticVLA, folder: Path) -> None:
    left = [name for name, t in [*vla.named_parameters(), *vla.named_buffers()] if t.is_meta]
    if left:
        raise ReleaseWeightsError(f"{folder}: tensor(s) still without values after loading: {_few(left)}")


_PT = {"format": "pt"}  # the metadata transformers writes and checks


def save_weights(state: Mapping[str, torch.Tensor], folder: Path, max_shard_size: Union[int, str]) -> List[str]:
    """save_pretrained's layout: `model-0000K-of-0000N.safetensors` + index, or one model.safetensors if it fits."""
    shards = plan_shards(state, parse_size(max_shard_size))
    _remove_old_weights(folder)
    if len(shards) == 1:
        save_file({key: state[key].contiguous() for key in shards[0]}, str(folder / SINGLE_WEIGHTS_FILE), _PT)
        return [SINGLE_WEIGHTS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({key: state[key].contiguous() for key in keys}, str(folder / name), _PT)
    weight_map = {key: name for name, keys in zip(names, shards) for key in keys}
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in state.values())}, "weight_map": weight_map}
    _write_json(folder / WEIGHTS_INDEX_FILE, index)
    return [*names, WEIGHTS_INDEX_FILE]


def _remove_old_weights(folder: Path) -> None:
    # A previous save with another shard count would leave shards the new index does not list (save_pretrained
    # removes them too), and the loader would then refuse the folder.
    for path in folder.iterdir():
        if SHARD_PATTERN.fullmatch(path.name) or path.name in (SINGLE_WEIGHTS_FILE, WEIGHTS_INDEX_FILE):
            path.unlink()


def plan_shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> List[List[str]]:
    """Keys in order, a new shard whenever the next tensor would overflow `max_bytes` (a larger one goes alone)."""
    shards: List[List[str]] = [[]]
    size = 0
    for key, tensor in state.items():
        nbytes = _nbytes(tensor)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string such as "5GB" (decimal, as transformers) or "64MiB"."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size must be a positive byte count or e.g. '5GB' / '64MiB', got {size!r}")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --- tokenizer ------------------------------------------------------------------------------------------------


def load_tokenizer(folder: PathLike) -> Tokenizer:
    """tokenizer.json as a `tokenizers.Tokenizer` (what LlamaTokenizerFast wraps); checks the Llama-2 ids."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise ReleaseError(f"{path} is missing; the release's processor.save_pretrained writes it")
    tokenizer = Tokenizer.from_file(str(path))
    for token, expected in (("<s>", BOS_ID), ("</s>", STOP_TOKEN_ID), ("▁", EMPTY_TOKEN_ID)):
        found = tokenizer.token_to_id(token)
        if found != expected:
            raise ReleaseError(
                f"{path} maps {token!r} to {found}; the release's prompts and predict_action assume the Llama-2 "
                f"layout (<s> = {BOS_ID}, </s> = {STOP_TOKEN_ID}, '▁' = {EMPTY_TOKEN_ID})"
            )
    return tokenizer


# Words of the prompt and a few instructions, so test prompts are not all <unk>.
TINY_TOKENIZER_WORDS = (
    "In : What action should the robot take to ? Out pick up place put open close push the a it on in into "
    "and of cup bowl plate drawer block black red blue top"
).split()


def llama_layout_tokenizer(words: Sequence[str] = TINY_TOKENIZER_WORDS) -> Tokenizer:
    """A word-level tokenizer with the release's fixed ids: <unk> 0, <s> 1, </s> 2, bytes 3..258, '▁' 29871,
    filler up to 31999 (so the action ids 31744..31999 exist), and '<PAD>' added as 32000. <s> is prepended."""
    vocab = {f"<tok{i}>": i for i in range(LLAMA2_VOCAB_SIZE)}  # filler, overwritten below where ids are fixed
    fixed = {0: "<unk>", BOS_ID: "<s>", STOP_TOKEN_ID: "</s>", EMPTY_TOKEN_ID: "▁"}
    fixed.update({3 + b: f"<0x{b:02X}>" for b in range(256)})
    fixed.update({259 + i: word for i, word in enumerate(dict.fromkeys(words))})
    for token_id, token in fixed.items():
        del vocab[f"<tok{token_id}>"]
        vocab[token] = token_id
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    tokenizer.add_special_tokens([AddedToken("<PAD>", special=True)])  # next free id: 32000
    return tokenizer


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Write the tokenizer with its own save_pretrained (a bare `tokenizers.Tokenizer` is wrapped first)."""
    if not hasattr(tokenizer, "save_pretrained"):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<PAD>",
            model_max_length=2048,
            padding_side="right",
        )
    tokenizer.save_pretrained(str(folder))
    special = folder / "special_tokens_map.json"
    if not special.exists():  # transformers 5 no longer writes it; the release folder has one
        _write_json(special, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<PAD>", "unk_token": "<unk>"})


# --- preprocessor ---------------------------------------------------------------------------------------------


def preprocessor_config_json(transform: ImageTransform) -> Dict[str, Any]:
    """The PrismaticImageProcessor preprocessor_config.json of a `resize-naive` transform."""
    names = {code: name for name, code in PIL_RESAMPLING.items()}
    towers = transform.towers
    return {
        "auto_map": {
            "AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor",
            "AutoProcessor": "processing_prismatic.PrismaticProcessor",
        },
        "image_processor_type": "PrismaticImageProcessor",
        "image_resize_strategy": "resize-naive",
        "input_sizes": [[3, t.size, t.size] for t in towers],
        "interpolations": [names[t.resample] for t in towers],
        "means": [list(t.mean) for t in towers],
        "processor_class": "PrismaticProcessor",
        "stds": [list(t.std) for t in towers],
        "tvf_crop_params": [{"output_size": [t.size, t.size]} for t in towers],
        "tvf_do_letterbox": False,
        "tvf_letterbox_fill": None,
        "tvf_normalize_params": [{"inplace": False, "mean": list(t.mean), "std": list(t.std)} for t in towers],
        "tvf_resize_params": [
            {"antialias": True, "interpolation": t.resample, "max_size": None, "size": [t.size, t.size]} for t in towers
        ],
        "use_fused_vision_backbone": True,
    }


def load_image_transform(folder: Path, config: ReleaseConfig) -> ImageTransform:
    path = folder / PREPROCESSOR_FILE
    if not path.is_file():
        raise ReleaseError(f"{path} is missing; it holds the image resize and per-tower normalisation")
    transform = read_preprocessor_config(path)
    sizes = [tower.size for tower in transform.towers]
    if sizes != list(config.image_sizes):
        raise ReleaseError(f"{path} resizes to {sizes} but {config.source} has image_sizes {list(config.image_sizes)}")
    return transform


# --- the loaded policy ----------------------------------------------------------------------------------------


@dataclass
class ReleasedOpenVLA:
    """A loaded release: RGB frame + instruction -> actions, as OpenVLA's `predict_action` computes them."""

    model: PrismaticVLA
    tokenizer: TextEncoder
    """A `tokenizers.Tokenizer` or transformers tokenizer whose `encode` gives the Llama-2 ids."""
    image_transform: ImageTransform
    bins: ActionBins
    norm_stats: NormStats
    config: ReleaseConfig
    prompt_template: str = "openvla"

    def pixel_values(self, image: np.ndarray) -> torch.Tensor:
        """RGB uint8 [H, W, 3] (any size) -> [1, 6, S, S] on the model's device, in its dtype."""
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            shape = getattr(image, "shape", None)
            dtype = getattr(image, "dtype", type(image).__name__)
            raise ValueError(f"image must be an RGB uint8 array [H, W, 3], got {dtype} of shape {shape}")
        pixels = self.image_transform(Image.fromarray(image))[None]
        return pixels.to(device=self.model.device, dtype=self.model.dtype)

    def input_ids(self, instruction: str) -> torch.Tensor:
        """[1, T]: `<bos> In: What action should the robot take to {instruction}?\\nOut: ▁`."""
        ids = prompt_token_ids(self.tokenizer, instruction, self.prompt_template)
        return torch.tensor([ids], dtype=torch.long, device=self.model.device)

    def action_dim(self, unnorm_key: Optional[str] = None) -> int:
        return self.norm_stats.action_dim(unnorm_key)

    def predict_action(
        self,
        image: Union[np.ndarray, Sequence[np.ndarray]],
        instruction: str,
        unnorm_key: Optional[str] = None,
        proprio: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """float64 [action_dim] un-normalised actions for `unnorm_key`'s dataset (None: the only one), greedy.

        `image`: one RGB uint8 frame [H, W, 3], or a list holding just that frame (the call OFT takes). OpenVLA
        reads neither a wrist camera nor proprio: passing them is an error rather than silently ignored.
        """
        if proprio is not None:
            raise ValueError(
                "OpenVLA takes no proprio (the release conditions on one image and the instruction only); "
                "pass proprio=None, or use an OpenVLA-OFT checkpoint, whose proprio projector reads it"
            )
        if not isinstance(image, np.ndarray):
            frames = list(image)
            if len(frames) != 1:
                raise ValueError(
                    f"OpenVLA reads one camera frame, got {len(frames)}; pass the primary camera's image only "
                    "(OpenVLA-OFT checkpoints take the wrist camera as well)"
                )
            image = frames[0]
        stats = self.norm_stats.select(unnorm_key).action  # raises UnnormKeyError before any compute
        return self.model.predict_action(self.pixel_values(image), self.input_ids(instruction), stats, self.bins)


def load_pretrained(
    path: PathLike, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
) -> ReleasedOpenVLA:
    """A release folder (openvla/openvla-7b's layout) loaded strictly onto `device` in `dtype`."""
    folder = Path(path)
    if not folder.is_dir():
        raise ReleaseError(f"{folder} is not a folder; pass a release folder holding {CONFIG_FILE}")
    config = read_release_config(folder / CONFIG_FILE)
    model = build_vla(config, device="meta", dtype=dtype)
    load_weights(model, folder, dtype, device)
    return ReleasedOpenVLA(
        model=model.eval(),
        tokenizer=load_tokenizer(folder),
        image_transform=load_image_transform(folder, config),
        bins=config.action_bins(),
        norm_stats=load_norm_stats(folder),
        config=config,
    )


def save_release_layout(
    vla: PrismaticVLA,
    path: PathLike,
    tokenizer: Any,
    norm_stats: Mapping[str, Any],
    *,
    n_action_bins: int = 256,
    pad_to_multiple_of: int = 64,
    image_transform: Optional[ImageTransform] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write `vla` as a release folder: config.json, generation_config.json, safetensors (+ index), tokenizer
    files, dataset_statistics.json and preprocessor_config.json. `norm_stats` is the raw statistics dict."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = release_config_for(vla, norm_stats, n_action_bins, pad_to_multiple_of)
    dtype_name = str(vla.dtype).removeprefix("torch.")
    _write_json(folder / CONFIG_FILE, release_config_json(config, dtype_name))
    _write_json(folder / GENERATION_CONFIG_FILE, _generation_config(config))
    save_weights(vla.state_dict(), folder, max_shard_size)
    save_tokenizer(tokenizer, folder)
    _write_json(folder / DATASET_STATISTICS_FILE, dict(norm_stats))
    transform = image_transform or ImageTransform().resized_to(config.image_sizes)
    _write_json(folder / PREPROCESSOR_FILE, preprocessor_config_json(transform))
    return folder


def _generation_config(config: ReleaseConfig) -> Dict[str, Any]:
    import transformers

    return {
        "_from_model_config": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": STOP_TOKEN_ID,
        "pad_token_id": config.text_config.get("pad_token_id", PAD_TOKEN_ID),
        "transformers_version": transformers.__version__,
    }


# --- small helpers --------------------------------------------------------------------------------------------


def _read_json_object(path: Path, error: type) -> Dict[str, Any]:
    if not path.is_file():
        raise error(f"{path} is missing")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {_describe(raw)}")
    return raw


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(name) for name in names[:n])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > n else shown


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]
