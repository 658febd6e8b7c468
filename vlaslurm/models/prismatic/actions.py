"""Action tokens and (de-)normalisation exactly as the OpenVLA / OpenVLA-OFT releases do them.

`ActionBins` is the 256-bin tokeniser (training-side encode, `predict_action` decode); `unnormalize_actions`
and `normalize_proprio` apply the dataset statistics (BOUNDS_Q99 or BOUNDS); `libero_gripper_postprocess` is the
LIBERO eval's gripper rule; `NormStats` is a typed `dataset_statistics.json` / `config.json["norm_stats"]`.
Facts: shared/facts/openvla-checkpoints.md, sections 6 and 7.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

N_ACTION_BINS = 256
LLAMA2_VOCAB_SIZE = 32000  # the unpadded Llama-2 vocabulary: action ids are its last 256 ids, 31744..31999
ACTION_TOKEN_BEGIN_IDX = 31743  # OFT's constant: action ids are > 31743
OPENVLA_UNNORM_EPS = 0.0  # OpenVLA's predict_action scales by (high - low)
OFT_UNNORM_EPS = 1e-8  # OFT's _unnormalize_actions scales by (high - low + 1e-8)
PROPRIO_EPS = 1e-8

Normalization = Literal["bounds_q99", "bounds"]
NORMALIZATIONS: Tuple[str, ...] = ("bounds_q99", "bounds")
STAT_FIELDS: Tuple[str, ...] = ("mean", "std", "max", "min", "q01", "q99")
PathLike = Union[str, Path]


class NormStatsError(ValueError):
    """A dataset-statistics file or `norm_stats` entry that does not have the release's structure."""


class UnnormKeyError(ValueError):
    """`unnorm_key` missing where the statistics hold several datasets, or not one of their keys."""


# --- tokens <-> normalised actions --------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionBins:
    """Uniform bins over [low, high] mapped onto the last `n_bins` ids of the *unpadded* vocabulary.

    Encoding (prismatic/vla/action_tokenizer.py): `token = vocab_size - digitize(clip(a), edges)`, with
    `digitize` in 1..n_bins. Decoding (`predict_action`): `centers[clip(vocab_size - token - 1, 0, n_bins - 2)]`.
    There are n_bins edges but only n_bins - 1 centres, so the two top tokens (31744, 31745) share the last
    centre, and ids outside the action range are clipped rather than rejected, as upstream does.
    """

    n_bins: int = N_ACTION_BINS
    vocab_size: int = LLAMA2_VOCAB_SIZE
    low: float = -1.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if self.n_bins < 2:
            raise ValueError(f"n_action_bins must be at least 2, got {self.n_bins}")
        if self.vocab_size <= self.n_bins:
            raise ValueError(f"vocab_size ({self.vocab_size}) must exceed n_action_bins ({self.n_bins})")
        if not self.low < self.high:
            raise ValueError(f"action bin range must have low < high, got [{self.low}, {self.high}]")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ActionBins:
        """From a release config.json: `V = text_config.vocab_size - pad_to_multiple_of` (32064 - 64 = 32000).

        Upstream subtracts `pad_to_multiple_of` itself, not the padding actually added; this keeps that rule.
        """
        text_config = config.get("text_config")
        if not isinstance(text_config, Mapping) or not isinstance(text_config.get("vocab_size"), int):
            raise ValueError(
                "config.json: text_config.vocab_size (an int, 32064 in the release) is required "
                "to locate the action tokens"
            )
        pad = config.get("pad_to_multiple_of", 64)  # OpenVLAConfig's default
        return cls(n_bins=int(config.get("n_action_bins", N_ACTION_BINS)), vocab_size=text_config["vocab_size"] - pad)

    @property
    def edges(self) -> np.ndarray:
        """float64 [n_bins]: `linspace(low, high, n_bins)`."""
        return np.linspace(self.low, self.high, self.n_bins)

    @property
    def centers(self) -> np.ndarray:
        """float64 [n_bins - 1]: midpoints of consecutive edges, c[i] = -1 + (2i + 1) / 255 for the release."""
        edges = self.edges
        return (edges[:-1] + edges[1:]) / 2.0

    @property
    def first_token(self) -> int:
        """The lowest action id (31744): the token of actions at `high`."""
        return self.vocab_size - self.n_bins

    @property
    def last_token(self) -> int:
        """The highest action id (31999): the token of actions at `low`."""
        return self.vocab_size - 1

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """Normalised actions (any shape) -> int64 token ids of the same shape."""
        clipped = np.clip(np.asarray(actions, dtype=np.float64), self.low, self.high)
        return (self.vocab_size - np.digitize(clipped, self.edges)).astype(np.int64)

    def center_index(self, token_ids: np.ndarray) -> np.ndarray:
        """Token ids -> int64 index into `centers`, clipped to [0, n_bins - 2] as upstream does."""
        distance = self.vocab_size - np.asarray(token_ids, dtype=np.int64)
        return np.clip(distance - 1, 0, self.n_bins - 2)

    def decode(self, token_ids: np.ndarray) -> np.ndarray:
        """Token ids (any shape) -> float64 normalised actions in (-1, 1) of the same shape."""
        return self.centers[self.center_index(token_ids)]

    def encode_torch(self, actions: torch.Tensor) -> torch.Tensor:
        """`encode` for tensors: long ids on the actions' device (compared in float64, like numpy)."""
        edges = torch.from_numpy(self.edges).to(actions.device)
        clipped = actions.to(torch.float64).clamp(self.low, self.high)
        # bucketize(right=True) counts edges <= x, which is np.digitize's default (right=False) convention
        return self.vocab_size - torch.bucketize(clipped, edges, right=True)

    def center_index_torch(self, token_ids: torch.Tensor) -> torch.Tensor:
        return (self.vocab_size - token_ids.long() - 1).clamp(0, self.n_bins - 2)

    def decode_torch(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`decode` for tensors: float64 on the ids' device, bit-equal to the numpy path."""
        centers = torch.from_numpy(self.centers).to(token_ids.device)
        return centers[self.center_index_torch(token_ids)]


# --- dataset statistics ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayStats:
    """One `action` or `proprio` entry: float64 [D] statistics and the bool [D] normalisation mask.

    `mask` is true where a dimension is normalised; a missing mask is all-true, as upstream defaults it
    (OXE/LIBERO actions carry `[true] * 6 + [false]`: the gripper is left as it is).
    """

    mean: np.ndarray
    std: np.ndarray
    max: np.ndarray
    min: np.ndarray
    q01: np.ndarray
    q99: np.ndarray
    mask: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.q01.shape[0])

    def bounds(self, normalization: Normalization = "bounds_q99") -> Tuple[np.ndarray, np.ndarray]:
        """(low, high): (q01, q99) for BOUNDS_Q99 (OpenVLA, OFT LIBERO/Bridge), (min, max) for BOUNDS (ALOHA)."""
        if normalization == "bounds_q99":
            return self.q01, self.q99
        if normalization == "bounds":
            return self.min, self.max
        raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}; got {normalization!r}")


@dataclass(frozen=True)
class DatasetStats:
    """The statistics of one training dataset (one `unnorm_key`)."""

    action: ArrayStats
    proprio: Optional[ArrayStats]
    num_transitions: Optional[int]
    num_trajectories: Optional[int]


@dataclass(frozen=True)
class NormStats:
    """All datasets' statistics of a checkpoint, keyed by `unnorm_key`; `source` names the file for errors."""

    datasets: Mapping[str, DatasetStats]
    source: str

    def resolve_key(self, unnorm_key: Optional[str] = None) -> str:
        """The release's `_check_unnorm_key`: None is allowed only when there is exactly one dataset."""
        keys = list(self.datasets)
        if unnorm_key is None:
            if len(keys) == 1:
                return keys[0]
            raise UnnormKeyError(
                f"{self.source} holds statistics for {len(keys)} datasets; pass unnorm_key= one "
                f"of: {', '.join(keys)} (the dataset whose actions this policy should produce)"
            )
        if unnorm_key not in self.datasets:
            close = difflib.get_close_matches(unnorm_key, keys, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnnormKeyError(
                f"unnorm_key {unnorm_key!r} is not in {self.source}.{hint} Valid keys: {', '.join(keys)}"
            )
        return unnorm_key

    def select(self, unnorm_key: Optional[str] = None) -> DatasetStats:
        return self.datasets[self.resolve_key(unnorm_key)]

    def action_dim(self, unnorm_key: Optional[str] = None) -> int:
        """Number of action dimensions (OpenVLA generates this many tokens: len(q01))."""
        return self.select(unnorm_key).action.dim


def libero_unnorm_key(stats: NormStats, suite: str) -> str:
    """The OFT LIBERO eval's key: the suite name, else `{suite}_no_noops` (the released checkpoints' keys)."""
    for key in (suite, f"{suite}_no_noops"):
        if key in stats.datasets:
            return key
    return stats.resolve_key(f"{suite}_no_noops")  # raises, naming the valid keys


def parse_norm_stats(raw: Any, source: str) -> NormStats:
    """`{dataset: {"action": {...}, "proprio": {...}, "num_transitions": N, ...}}` -> `NormStats`."""
    if not isinstance(raw, Mapping) or not raw:
        raise NormStatsError(f"{source}: expected a non-empty object of datasets, got {_kind(raw)}")
    datasets = {str(key): _parse_dataset(entry, f"{source}: {key}") for key, entry in raw.items()}
    return NormStats(datasets=datasets, source=source)


def read_dataset_statistics(path: PathLike) -> NormStats:
    """A `dataset_statistics.json` file."""
    return parse_norm_stats(_read_json(Path(path)), str(path))


def norm_stats_from_config(config: Mapping[str, Any], source: str = "config.json") -> NormStats:
    """The `norm_stats` of a loaded release config.json."""
    if "norm_stats" not in config or config["norm_stats"] is None:
        raise NormStatsError(f"{source} has no norm_stats; pass the checkpoint's dataset_statistics.json instead")
    return parse_norm_stats(config["norm_stats"], f"{source}: norm_stats")


def load_norm_stats(checkpoint_dir: PathLike) -> NormStats:
    """A release folder's statistics: dataset_statistics.json when present (OFT replaces norm_stats with it),
    else config.json's norm_stats (what OpenVLA's predict_action reads; the two are equal in openvla-7b)."""
    folder = Path(checkpoint_dir)
    statistics = folder / "dataset_statistics.json"
    if statistics.is_file():
        return read_dataset_statistics(statistics)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise NormStatsError(f"{folder} has neither dataset_statistics.json nor config.json")
    return norm_stats_from_config(_read_json(config_path), str(config_path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise NormStatsError(f"{path}: not valid JSON ({err})") from err


def _parse_dataset(entry: Any, where: str) -> DatasetStats:
    if not isinstance(entry, Mapping) or "action" not in entry:
        raise NormStatsError(f"{where} must be an object with an 'action' entry, got {_kind(entry)}")
    proprio = entry.get("proprio")
    return DatasetStats(
        action=_parse_array_stats(entry["action"], f"{where}.action"),
        proprio=None if proprio is None else _parse_array_stats(proprio, f"{where}.proprio"),
        num_transitions=_optional_count(entry.get("num_transitions"), f"{where}.num_transitions"),
        num_trajectories=_optional_count(entry.get("num_trajectories"), f"{where}.num_trajectories"),
    )


def _parse_array_stats(entry: Any, where: str) -> ArrayStats:
    if not isinstance(entry, Mapping):
        raise NormStatsError(f"{where} must be an object of statistics, got {_kind(entry)}")
    missing = [name for name in STAT_FIELDS if name not in entry]
    if missing:
        raise NormStatsError(f"{where} lacks {', '.join(missing)} (each of {', '.join(STAT_FIELDS)} is required)")
    arrays = {name: _float_vector(entry[name], f"{where}.{name}") for name in STAT_FIELDS}
    dim = arrays["q01"].shape[0]
    for name, values in arrays.items():
        if values.shape[0] != dim:
            raise NormStatsError(f"{where}.{name} has {values.shape[0]} values but q01 has {dim}")
    mask = _bool_vector(entry.get("mask", [True] * dim), dim, f"{where}.mask")
    return ArrayStats(mask=mask, **arrays)


def _float_vector(values: Any, where: str) -> np.ndarray:
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise NormStatsError(f"{where} must be a non-empty list of numbers, got {_kind(values)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise NormStatsError(f"{where} must hold finite numbers only, got {list(values)!r}")
    return np.asarray(values, dtype=np.float64)


def _bool_vector(values: Any, dim: int, where: str) -> np.ndarray:
    if not isinstance(values, Sequence) or not all(isinstance(v, bool) for v in values):
        raise NormStatsError(f"{where} must be a list of true/false, got {values!r}")
    if len(values) != dim:
        raise NormStatsError(f"{where} has {len(values)} entries but the statistics have {dim} dimensions")
    return np.asarray(values, dtype=bool)


def _optional_count(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise NormStatsError(f"{where} must be a whole number, got {value!r}")
    return int(value)


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


# --- (un)normalisation ----------------------------------------------------------------------------------------


def unnormalize_actions(
    normalized: np.ndarray,
    stats: ArrayStats,
    normalization: Normalization = "bounds_q99",
    eps: float = OPENVLA_UNNORM_EPS,
) -> np.ndarray:
    """`0.5 (a + 1) (high - low + eps) + low` where `mask`, else `a` unchanged; float64 [..., D].

    eps is 0 for OpenVLA's predict_action and `OFT_UNNORM_EPS` (1e-8) for OFT's.
    """
    actions = np.asarray(normalized, dtype=np.float64)
    _check_dim(actions.shape, stats, "actions")
    low, high = stats.bounds(normalization)
    return np.where(stats.mask, 0.5 * (actions + 1.0) * (high - low + eps) + low, actions)


def unnormalize_actions_torch(
    normalized: torch.Tensor,
    stats: ArrayStats,
    normalization: Normalization = "bounds_q99",
    eps: float = OPENVLA_UNNORM_EPS,
) -> torch.Tensor:
    """`unnormalize_actions` for tensors: float64 on the input's device, equal to the numpy path."""
    _check_dim(tuple(normalized.shape), stats, "actions")
    low, high = (torch.from_numpy(b).to(normalized.device) for b in stats.bounds(normalization))
    mask = torch.from_numpy(stats.mask).to(normalized.device)
    actions = normalized.to(torch.float64)
    return torch.where(mask, 0.5 * (actions + 1.0) * (high - low + eps) + low, actions)


def normalize_proprio(
    proprio: np.ndarray, stats: ArrayStats, normalization: Normalization = "bounds_q99"
) -> np.ndarray:
    """OFT's eval-side proprio normalisation, float64 [..., D]:

    `clip(where(mask, 2 (x - low) / (high - low + 1e-8) - 1, x), -1, 1)`, with `stats` the dataset's `proprio`
    entry (LIBERO: BOUNDS_Q99). The clip applies to unmasked dimensions too, as upstream.
    """
    state = np.asarray(proprio, dtype=np.float64)
    _check_dim(state.shape, stats, "proprio")
    low, high = stats.bounds(normalization)
    scaled = np.where(stats.mask, 2.0 * (state - low) / (high - low + PROPRIO_EPS) - 1.0, state)
    return np.clip(scaled, -1.0, 1.0)


def normalize_proprio_torch(
    proprio: torch.Tensor, stats: ArrayStats, normalization: Normalization = "bounds_q99"
) -> torch.Tensor:
    """`normalize_proprio` for a batch of tensors [..., D] (computed in float64 as numpy), returned float32."""
    _check_dim(tuple(proprio.shape), stats, "proprio")
    low, high = (torch.from_numpy(b).to(proprio.device, torch.float64) for b in stats.bounds(normalization))
    mask = torch.from_numpy(stats.mask).to(proprio.device)
    state = proprio.to(torch.float64)
    scaled = torch.where(mask, 2.0 * (state - low) / (high - low + PROPRIO_EPS) - 1.0, state)
    return scaled.clamp(-1.0, 1.0).float()


def _check_dim(shape: Tuple[int, ...], stats: ArrayStats, what: str) -> None:
    if not shape or shape[-1] != stats.dim:
        raise ValueError(
            f"{what} of shape {tuple(shape)} do not match statistics of {stats.dim} dimensions "
            "(check unnorm_key and the action/proprio dimension)"
        )


# --- LIBERO gripper -------------------------------------------------------------------------------------------


def normalize_gripper(actions: np.ndarray, binarize: bool = True) -> np.ndarray:
    """Last dimension from the dataset's [0, 1] to [-1, 1] (`2 g - 1`), then `sign` if `binarize`; a copy."""
    out = np.array(actions, dtype=np.result_type(np.asarray(actions).dtype, np.float32), copy=True)
    out[..., -1] = 2.0 * out[..., -1] - 1.0
    if binarize:
        out[..., -1] = np.sign(out[..., -1])
    return out


def invert_gripper(actions: np.ndarray) -> np.ndarray:
    """Flip the sign of the last dimension; a copy."""
    out = np.array(actions, dtype=np.result_type(np.asarray(actions).dtype, np.float32), copy=True)
    out[..., -1] = -out[..., -1]
    return out


def libero_gripper_postprocess(actions: np.ndarray) -> np.ndarray:
    """The OpenVLA / OFT LIBERO eval's `process_action` (run_libero_eval.py), between policy and environment.

    The gripper value `g` (last dimension, after un-normalisation, which leaves it untouched under the mask) is
    in the RLDS convention 0 = close, 1 = open. The eval sets `g <- -sign(2 g - 1)`: `normalize_gripper_action`
    with binarize=True maps [0, 1] to [-1, 1] and takes the sign, then `invert_gripper_action` flips it (the eval's
    model_family is always "openvla") so the environment gets -1 = open, +1 = close. So g > 0.5 -> -1 (open),
    g < 0.5 -> +1 (close), and g == 0.5 exactly -> 0 (np.sign(0) = 0; upstream keeps that). The other six
    dimensions pass through unchanged. Works on one action [7] or a chunk [T, 7].
    """
    return invert_gripper(normalize_gripper(actions, binarize=True))
