"""LoRA for `PrismaticVLA` through peft, as OpenVLA's and RLinf's fine-tuning recipes use it (rank 32).

`apply_lora` injects peft's LoRA layers into the live module in place (`inject_adapter_in_model`, not
`get_peft_model`): the VLA keeps its class, its methods and its release parameter names, changed only where a layer
is adapted. `merged_state_dict` folds `W + scale·B@A` back under the release's names (a release folder or a weight
update for the generators); `save_adapter` / `load_adapter` use peft's folder format, so peft itself reads the folder.

Key names, for an adapted layer P (e.g. `language_model.model.layers.0.self_attn.q_proj`):
    live module          P.base_layer.weight, P.lora_A.default.weight [r, in], P.lora_B.default.weight [out, r]
    adapter_state_dict   P.lora_A.weight, P.lora_B.weight            (peft's saved names: no adapter name)
    adapter folder       base_model.model.P.lora_A.weight, ...       (PeftModel.save_pretrained's names)
    merged_state_dict    P.weight                                    (the release's own name)
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Set, Tuple, TypeVar, Union, cast

import torch
from peft import LoraConfig, PeftType, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners import lora
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file, save_file
from torch import nn

from vlaslurm.spec.errors import close_names
from vlaslurm.spec.model_types import LoraSpec

PathLike = Union[str, Path]
Model = TypeVar("Model", bound=nn.Module)  # the adapters go in place: the caller gets its own type back

ADAPTER = "default"  # peft's adapter name; it appears in the live module's keys only, never in saved ones
# The prefix PeftModel.save_pretrained writes for a model wrapped whole with get_peft_model, as openvla's
# finetune.py and RLinf do it: with it, their adapter folders and ours name the same tensors the same way.
PEFT_PREFIX = "base_model.model."
ADAPTER_FILES = (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)  # adapter_config.json, adapter_model.safetensors
ALL_LINEAR = "all-linear"
COMPONENTS = ("vision_backbone", "projector", "language_model")  # PrismaticVLA's children, in forward order
OUTPUT_HEAD = "language_model.lm_head"
# Upstream initialisation: A ~ N(0, 1/r) ("gaussian", openvla and RLinf) or peft's kaiming-uniform A; B = 0 in both.
INITS = {"gaussian": "gaussian", "kaiming": True}
LoraInit = Literal["gaussian", "kaiming"]


class LoraSettingsError(ValueError):
    """LoRA settings that cannot work; the message names the field (`lora.<field>`) and how to fix it."""


class AdapterError(ValueError):
    """An adapter folder, or an adapter and a model, that do not fit together; names the file, key or field."""


# The defaults are openvla's `vla-scripts/finetune.py`: LoraConfig(r=32, lora_alpha=min(32, 16), lora_dropout=0.0,
# target_modules="all-linear", init_lora_weights="gaussian") on the whole VLA through get_peft_model. RLinf's
# `rlinf/models/__init__.py` (is_lora) differs in alpha = rank, an explicit target list that adds lm_head, and a
# trainable value_head; its OpenVLA configs set `lora_rank: 32`. Here the scope is the language model unless
# `scope` widens it, so the vision towers and projector stay exactly the release's.
@dataclass(frozen=True)
class LoraSettings:
    """Which layers of the VLA get LoRA adapters, and how large (the field docstrings give upstream's values)."""

    rank: int = 32
    """r, the adapters' inner size (openvla `lora_rank` 32; RLinf's OpenVLA configs `lora_rank: 32`)."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank. openvla uses `min(rank, 16)`; RLinf sets alpha = rank (scale 1)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0.0 in both recipes)."""
    target_modules: Union[str, Tuple[str, ...]] = ALL_LINEAR
    """Either "all-linear": every nn.Linear in `scope` except the output head `language_model.lm_head`, which is what
    peft's shorthand gives openvla's finetune.py (it drops the model's output embedding). Or module-name suffixes,
    e.g. RLinf's list ("q_proj", ..., "down_proj", "lm_head" for the LLM; "qkv", "proj", "fc1", "fc2" for the
    towers). Only nn.Linear layers are adapted: a name that also matches a convolution (timm's patch_embed.proj)
    adapts the linear layers only."""
    scope: Tuple[str, ...] = ("language_model",)
    """The VLA's children whose layers may be adapted. Both upstream recipes wrap the whole model; pass
    `COMPONENTS` to adapt the vision towers and the projector as they do."""
    init: LoraInit = "gaussian"
    """How A starts (B starts at zero, so a fresh adapter leaves the model unchanged)."""
    trainable_extra: Tuple[str, ...] = ()
    """Module paths trained in full besides the adapters (e.g. a value head, as RLinf keeps `value_head`); their
    tensors keep the base names, so they travel in `merged_state_dict`, not in the adapter folder."""

    def __post_init__(self) -> None:
        # Lists from YAML or JSON become tuples, so the frozen settings stay hashable.
        for name in ("target_modules", "scope", "trainable_extra"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        _check_positive_int("rank", self.rank)
        _check_number("alpha", self.alpha, lambda v: v > 0, "a positive number")
        _check_number("dropout", self.dropout, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
        _check_targets(self.target_modules)
        _check_names("scope", self.scope, COMPONENTS)
        if self.init not in INITS:
            raise LoraSettingsError(_choice_message("init", self.init, tuple(INITS)))
        _check_names("trainable_extra", self.trainable_extra, None)

    @property
    def scale(self) -> float:
        """The factor of B@A in the merged weight: alpha / rank."""
        return self.alpha / self.rank

    @classmethod
    def of(cls, spec: LoraSpec) -> LoraSettings:
        """The settings of a spec's `model.lora` (the language model's linear layers, upstream's init)."""
        targets = spec.target_modules if isinstance(spec.target_modules, str) else tuple(spec.target_modules)
        return cls(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=targets)


# --- settings checks ------------------------------------------------------------------------------------------


def _check_positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LoraSettingsError(f"lora.{field} must be a positive integer, got {_describe(value)}")


def _check_number(field: str, value: object, ok: Callable[[float], bool], expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise LoraSettingsError(f"lora.{field} must be {expected}, got {_describe(value)}")


def _check_targets(value: object) -> None:
    if isinstance(value, str):
        if value != ALL_LINEAR:
            raise LoraSettingsError(
                f"lora.target_modules is {value!r}; give {ALL_LINEAR!r} or a list of module names such as "
                f"['q_proj', 'v_proj']"
            )
        return
    _check_names("target_modules", value, None)
    if not value:
        raise LoraSettingsError(f"lora.target_modules is empty; give {ALL_LINEAR!r} or at least one module name")


def _check_names(field: str, value: object, valid: Optional[Sequence[str]]) -> None:
    if not isinstance(value, tuple):
        raise LoraSettingsError(f"lora.{field} must be a list of names, got {_describe(value)}")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not name:
            raise LoraSettingsError(f"lora.{field}[{i}] must be a non-empty string, got {_describe(name)}")
        if valid is not None and name not in valid:
            raise LoraSettingsError(_choice_message(f"{field}[{i}]", name, valid))
    if valid is not None and not value:
        raise LoraSettingsError(f"lora.{field} is empty; valid names: {', '.join(valid)}")


def _choice_message(field: str, value: object, valid: Sequence[str]) -> str:
    hint = close_names(str(value), valid)
    did_you_mean = f" (did you mean {', '.join(hint)}?)" if hint else ""
    return f"lora.{field} is {value!r}{did_you_mean}; valid values: {', '.join(valid)}"


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


# --- injecting ------------------------------------------------------------------------------------------------


def target_module_names(vla: nn.Module, settings: LoraSettings) -> List[str]:
    """The full paths of the nn.Linear layers `settings` adapts, in module order; an unmatched name is an error."""
    linears = [
        name
        for name, module in vla.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[0] in settings.scope
    ]
    if settings.target_modules == ALL_LINEAR:
        chosen = [name for name in linears if name != OUTPUT_HEAD]
    else:
        chosen = [name for name in linears if any(_matches(name, t) for t in settings.target_modules)]
        _check_every_target_matches(settings, linears)
    if not chosen:
        raise LoraSettingsError(f"lora.target_modules matches no linear layer in {', '.join(settings.scope)}")
    return chosen


def _matches(name: str, target: str) -> bool:
    # peft's own rule for a list of names: the whole path, or a suffix at a dot.
    return name == target or name.endswith("." + target)


def _check_every_target_matches(settings: LoraSettings, linears: Sequence[str]) -> None:
    # peft ignores a list entry that matches nothing, so a typo would silently train fewer layers.
    leaves = sorted({name.rsplit(".", 1)[-1] for name in linears})
    for i, target in enumerate(settings.target_modules):
        if not any(_matches(name, target) for name in linears):
            hint = close_names(target.rsplit(".", 1)[-1], leaves)
            did_you_mean = f" (did you mean {', '.join(hint)}?)" if hint else ""
            raise LoraSettingsError(
                f"lora.target_modules[{i}] is {target!r}, which names no linear layer in "
                f"{', '.join(settings.scope)}{did_you_mean}; linear layer names there: {', '.join(leaves)}"
            )


def lora_config(vla: nn.Module, settings: LoraSettings) -> LoraConfig:
    """peft's config for `settings` on `vla`, with the target layers spelled out in full."""
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft annotates int; it only divides by r
        lora_dropout=settings.dropout,
        target_modules=target_module_names(vla, settings),
        init_lora_weights=INITS[settings.init],  # type: ignore[arg-type]  # True or "gaussian", both peft values
        bias="none",  # no adapter biases, so merging is exactly W + scale·B@A
    )


def apply_lora(vla: Model, settings: LoraSettings) -> Model:
    """Inject LoRA adapters into `vla` in place and return it; afterwards only the adapters (and the modules
    in `settings.trainable_extra`) require grad. The VLA keeps its class and methods."""
    if lora_layers(vla):
        raise AdapterError("the model already has LoRA adapters; apply_lora takes a model without them")
    _check_extra_modules(vla, settings.trainable_extra)  # before the model is changed
    inject_adapter_in_model(lora_config(vla, settings), vla, adapter_name=ADAPTER)
    freeze_all_but_adapters(vla, settings.trainable_extra)
    return vla


def _check_extra_modules(vla: nn.Module, paths: Sequence[str]) -> None:
    names = [name for name, _ in vla.named_modules() if name]
    for i, path in enumerate(paths):
        if path not in names:
            hint = close_names(path, names)
            did_you_mean = f" (did you mean {', '.join(hint)}?)" if hint else ""
            raise LoraSettingsError(f"lora.trainable_extra[{i}] is {path!r}, not a module of the model{did_you_mean}")


def freeze_all_but_adapters(vla: nn.Module, trainable_extra: Sequence[str] = ()) -> None:
    """requires_grad only for the LoRA tensors and the parameters under `trainable_extra`'s module paths."""
    prefixes = tuple(f"{path}." for path in trainable_extra)
    for name, parameter in vla.named_parameters():
        parameter.requires_grad_(_is_adapter_key(name) or name.startswith(prefixes))


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def lora_layers(vla: nn.Module) -> Dict[str, lora.LoraLayer]:
    """{module path: peft LoRA layer} of `vla`, in module order."""
    return {name: module for name, module in vla.named_modules() if isinstance(module, lora.LoraLayer)}


# --- state dicts ----------------------------------------------------------------------------------------------


def adapter_state_dict(vla: nn.Module) -> Dict[str, torch.Tensor]:
    """The LoRA tensors only, under peft's saved names (`P.lora_A.weight`, `P.lora_B.weight`), detached."""
    _require_adapters(vla)
    # save_embedding_layers=False: with "lm_head" among a folder's targets, peft's "auto" would add whole base
    # embedding matrices to the adapter.
    state = get_peft_model_state_dict(vla, adapter_name=ADAPTER, save_embedding_layers=False)
    return {key: tensor.detach() for key, tensor in state.items()}


@torch.no_grad()
def merged_tensors(vla: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(release name, tensor) in the release's order, with `W + scale·B@A` for every adapted weight; one merged
    tensor at a time, so a publisher can stream a 7B model without a second full copy."""
    layers = _linear_lora_layers(vla)
    for key, tensor in vla.state_dict().items():
        if _is_adapter_key(key):
            continue
        path, _, leaf = key.rpartition(".base_layer.")
        if path in layers and leaf == "weight":
            yield f"{path}.weight", _merged_weight(layers[path], tensor)
        else:
            yield key.replace(".base_layer.", "."), tensor.detach()


def merged_state_dict(vla: nn.Module) -> Dict[str, torch.Tensor]:
    """The base state dict with the adapters folded in, under exactly the release's keys; `vla` is unchanged."""
    return dict(merged_tensors(vla))


def _merged_weight(layer: lora.Linear, weight: torch.Tensor) -> torch.Tensor:
    a, b = _factor(layer.lora_A[ADAPTER]), _factor(layer.lora_B[ADAPTER])
    return _fold(weight, a, b, layer.scaling[ADAPTER])


def _fold(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    # Summed in float32 and rounded once: a bf16 B@A added in bf16 would round twice.
    return (weight.float() + (b.float() @ a.float()) * scale).to(weight.dtype)


# --- merged weight publications (`model.lora.publish: merged`) -------------------------------------------------
# The trainer keeps training the adapters; each publication sends, for every adapted layer P, the merged `P.weight`
# (from the full `P.base_layer.weight` and factors, also when they were gathered from shards), and the generators
# serve a VLA whose adapted layers were unwrapped back to plain linear layers (`unwrap_adapters`).


def fold_sources(vla: nn.Module, prefix: str = "") -> List[str]:
    """The names (under `prefix`) of the tensors a merged publication is folded from: every adapted layer's base
    weight and its two factors, as the live module names them."""
    return [name for path in _linear_lora_layers(vla) for name in _fold_names(prefix + path)]


def _fold_names(path: str) -> Tuple[str, str, str]:
    return f"{path}.base_layer.weight", f"{path}.lora_A.{ADAPTER}.weight", f"{path}.lora_B.{ADAPTER}.weight"


@torch.no_grad()
def fold_publication(vla: nn.Module, tensors: Dict[str, torch.Tensor], prefix: str = "") -> Dict[str, torch.Tensor]:
    """`tensors` (full ones, holding `fold_sources`) with each adapted layer's three tensors replaced by its merged
    `P.weight` (`W + scale·B@A`, as `merged_state_dict` folds it); the other tensors pass unchanged, in order."""
    out: Dict[str, torch.Tensor] = {}
    folded: Set[str] = set()
    for path, layer in _linear_lora_layers(vla).items():
        names = _fold_names(prefix + path)
        base, a, b = (tensors[name] for name in names)
        out[f"{prefix}{path}.weight"] = _fold(base, a, b, layer.scaling[ADAPTER])
        folded.update(names)
    return {**out, **{name: t for name, t in tensors.items() if name not in folded}}


@torch.no_grad()
def unwrap_adapters(vla: Model) -> Tuple[Model, List[str]]:
    """Fold every adapter into its base layer and put the plain base layer back in its place (what a generator
    serving merged publications runs: no adapter cost per forward); returns `vla` and the merged weights' names."""
    names = []
    for path, layer in _linear_lora_layers(vla).items():
        base = layer.get_base_layer()
        weight = _factor(base)  # the base of a LoRA linear layer is an nn.Linear
        weight.copy_(_merged_weight(layer, weight))
        parent, _, child = path.rpartition(".")
        setattr(vla.get_submodule(parent) if parent else vla, child, base)
        names.append(f"{path}.weight")
    return vla, names


def _factor(module: nn.Module) -> torch.Tensor:
    if not isinstance(module, nn.Linear):  # peft's lora_A / lora_B of a linear layer are nn.Linear
        raise AdapterError(f"expected an nn.Linear LoRA factor, found {type(module).__name__}")
    return module.weight


def _linear_lora_layers(vla: nn.Module) -> Dict[str, lora.Linear]:
    _require_adapters(vla)
    layers = lora_layers(vla)
    others = [f"{path} ({type(m).__name__})" for path, m in layers.items() if not isinstance(m, lora.Linear)]
    if others:
        raise AdapterError(f"only LoRA on linear layers can be merged, found {_few(others)}")
    return {path: layer for path, layer in layers.items() if isinstance(layer, lora.Linear)}


def _require_adapters(vla: nn.Module) -> None:
    if not lora_layers(vla):
        raise AdapterError("the model has no LoRA adapters; call apply_lora or load_adapter first")


# --- adapter folders ------------------------------------------------------------------------------------------


def is_adapter_folder(path: PathLike) -> bool:
    """Whether `path` is a folder holding peft's adapter_config.json and adapter_model.safetensors."""
    folder = Path(path)
    return folder.is_dir() and all((folder / name).is_file() for name in ADAPTER_FILES)


def save_adapter(vla: nn.Module, folder: PathLike, base_path: PathLike) -> Path:
    """Write the adapter in peft's folder format; `base_path`, the release it adapts (the spec's
    `model.base_path`), is recorded as adapter_config.json's `base_model_name_or_path`."""
    _require_adapters(vla)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.copy(_live_config(vla))
    config.base_model_name_or_path = str(base_path)
    config.inference_mode = True  # what PeftModel.save_pretrained records; load_adapter trains it again
    config.save_pretrained(str(out))
    tensors = {PEFT_PREFIX + key: tensor.contiguous() for key, tensor in adapter_state_dict(vla).items()}
    save_file(tensors, str(out / SAFETENSORS_WEIGHTS_NAME), {"format": "pt"})
    return out


def adapter_base_path(folder: PathLike) -> Optional[str]:
    """The base checkpoint an adapter folder records (`base_model_name_or_path`), or None."""
    raw = json.loads((Path(folder) / CONFIG_NAME).read_text())
    base = raw.get("base_model_name_or_path") if isinstance(raw, dict) else None
    return base if isinstance(base, str) else None


def load_adapter(vla: Model, folder: PathLike) -> Model:
    """Load an adapter folder into `vla` strictly (every key and shape must match) and return it.

    A model without adapters gets them from the folder's adapter_config.json first, and then only the adapters
    require grad; a model with adapters must have the same rank, alpha and target layers, and keeps its flags.
    """
    path = Path(folder)
    _check_folder(path)
    config = _read_config(path)
    if lora_layers(vla):
        _check_same_adapter(_live_config(vla), config, path)
    else:
        config.inference_mode = False
        inject_adapter_in_model(config, vla, adapter_name=ADAPTER)
        freeze_all_but_adapters(vla)
    stored = _read_adapter_tensors(path)
    _check_tensors(adapter_state_dict(vla), stored, path / SAFETENSORS_WEIGHTS_NAME)
    result = cast(Any, set_peft_model_state_dict(vla, stored, adapter_name=ADAPTER))  # peft types it `namedtuple`
    if result.unexpected_keys:  # _check_tensors makes this unreachable unless peft renames keys differently
        raise AdapterError(f"{path}: peft did not place tensor(s) {_few(result.unexpected_keys)}")
    return vla


def _check_folder(path: Path) -> None:
    if not path.is_dir():
        raise AdapterError(f"{path} is not a folder; pass a folder written by save_adapter or peft's save_pretrained")
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise AdapterError(f"{path} is not an adapter folder: {', '.join(missing)} missing")


def _read_config(path: Path) -> LoraConfig:
    try:
        config = LoraConfig.from_pretrained(str(path))
    except (ValueError, TypeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{path / CONFIG_NAME}: not a LoRA adapter config ({err})") from None
    if config.peft_type != PeftType.LORA:
        raise AdapterError(f"{path / CONFIG_NAME}: peft_type is {config.peft_type}; only LORA is implemented")
    # These change what merging means (W + scale·B@A); refuse them rather than merge wrongly.
    unsupported = {"use_dora": config.use_dora, "bias": config.bias != "none", "lora_bias": config.lora_bias}
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise AdapterError(f"{path / CONFIG_NAME}: {', '.join(named)} is not supported (plain LoRA only)")
    return config


def _live_config(vla: nn.Module) -> LoraConfig:
    configs = getattr(vla, "peft_config", {})
    config = configs.get(ADAPTER) if isinstance(configs, dict) else None
    if not isinstance(config, LoraConfig):
        raise AdapterError("the model's LoRA layers have no peft config; add adapters with apply_lora or load_adapter")
    return config


def _check_same_adapter(live: LoraConfig, stored: LoraConfig, path: Path) -> None:
    pairs = {
        "r": (live.r, stored.r),
        "lora_alpha": (live.lora_alpha, stored.lora_alpha),
        "target_modules": (_as_set(live.target_modules), _as_set(stored.target_modules)),
    }
    wrong = [f"{name} {theirs!r} (model: {ours!r})" for name, (ours, theirs) in pairs.items() if ours != theirs]
    if wrong:
        raise AdapterError(f"{path / CONFIG_NAME} describes another adapter than the model's: {'; '.join(wrong)}")


def _as_set(targets: object) -> object:
    return set(targets) if isinstance(targets, (list, set, tuple)) else targets


def _read_adapter_tensors(path: Path) -> Dict[str, torch.Tensor]:
    tensors = load_file(str(path / SAFETENSORS_WEIGHTS_NAME))
    return {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in tensors.items()}


def _check_tensors(expected: Dict[str, torch.Tensor], stored: Dict[str, torch.Tensor], where: Path) -> None:
    missing = [key for key in expected if key not in stored]
    unexpected = [key for key in stored if key not in expected]
    wrong = [
        f"{key} {list(stored[key].shape)} (model: {list(tensor.shape)})"
        for key, tensor in expected.items()
        if key in stored and stored[key].shape != tensor.shape
    ]
    problems = [
        f"{label}: {_few(keys)}"
        for label, keys in (("missing key(s)", missing), ("unexpected key(s)", unexpected), ("wrong shape", wrong))
        if keys
    ]
    if problems:
        raise AdapterError(f"{where} does not fit the model's adapters: {'; '.join(problems)}")


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(name) for name in names[:n])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > n else shown
