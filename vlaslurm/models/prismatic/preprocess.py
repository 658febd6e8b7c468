"""Image preprocessing and prompts of the OpenVLA / OpenVLA-OFT releases, with PIL, numpy and torch only.

`ImageTransform` is PrismaticImageProcessor under `resize-naive`: PIL bicubic resize to 224, to_tensor, then each
tower's normalisation (DINOv2 first, SigLIP second) stacked on channels. `center_crop` is the eval scripts'
TF crop (90% of the area, bilinear back to 224) in numpy; `prompt_token_ids` builds the prompt and appends the
empty token 29871 as `predict_action` does. Facts: shared/facts/openvla-checkpoints.md, sections 4, 6 and 7.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image

IMAGE_SIZE = 224
BICUBIC = int(Image.Resampling.BICUBIC)  # 3: the release's `interpolation`, PIL's bicubic
PIL_RESAMPLING: Dict[str, int] = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
SUPPORTED_STRATEGIES: Tuple[str, ...] = ("resize-naive",)
CENTER_CROP_SCALE = 0.9  # fraction of the *area* kept: each side is scaled by sqrt(0.9)

BOS_ID = 1
STOP_TOKEN_ID = 2  # '</s>': OFT appends it after the action placeholders
EMPTY_TOKEN_ID = 29871  # '▁': the token after "Out:" at training time, which predict_action appends
OFT_PLACEHOLDER_ID = 1  # OFT's action-slot ids (torch.ones); their embeddings are zeroed before the LLM

OPENVLA_PROMPT = "In: What action should the robot take to {instruction}?\nOut:"
OPENVLA_V01_SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
PROMPT_TEMPLATES: Dict[str, str] = {
    "openvla": OPENVLA_PROMPT,  # openvla-7b and every OFT checkpoint
    "openvla-v01": OPENVLA_V01_SYSTEM_PROMPT + " USER: What action should the robot take to {instruction}? ASSISTANT:",
}
PathLike = Union[str, Path]
RGB = Tuple[float, float, float]


class PreprocessorConfigError(ValueError):
    """A preprocessor_config.json whose values this reimplementation cannot reproduce."""


# --- images ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TowerTransform:
    """One vision tower's resize and normalisation: `(resize(img) / 255 - mean) / std`, float32 [3, size, size]."""

    mean: RGB
    std: RGB
    size: int = IMAGE_SIZE
    resample: int = BICUBIC

    def __call__(self, image: Image.Image) -> torch.Tensor:
        # resize-naive: straight to (size, size), aspect ignored. PIL returns an equal-size image unchanged, and
        # the center crop to `size` that follows upstream is then a no-op, so it is left out.
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        resized = rgb.resize((self.size, self.size), resample=self.resample)
        pixels = torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1)
        # torchvision's to_tensor and normalize, step by step in float32, so the values are bit-equal
        scaled = pixels.to(torch.float32).div(255)
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return scaled.sub(mean).div(std)


DINOV2 = TowerTransform(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))  # tower 0, `featurizer`
SIGLIP = TowerTransform(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # tower 1, `fused_featurizer`


@dataclass(frozen=True)
class ImageTransform:
    """The fused (DINOv2 + SigLIP) processor: one PIL image -> float32 [3 * towers, size, size], tower 0 first."""

    towers: Tuple[TowerTransform, ...] = (DINOV2, SIGLIP)

    @property
    def channels(self) -> int:
        return 3 * len(self.towers)

    def resized_to(self, sizes: Sequence[int]) -> ImageTransform:
        """The same normalisations at other input sides, one per tower (a config's `image_sizes`)."""
        if len(sizes) != len(self.towers):
            raise ValueError(f"{len(self.towers)} towers but image sizes {list(sizes)}")
        return ImageTransform(tuple(replace(tower, size=size) for tower, size in zip(self.towers, sizes)))

    def __call__(self, image: Image.Image) -> torch.Tensor:
        rgb = image.convert("RGB")
        return torch.cat([tower(rgb) for tower in self.towers], dim=0)

    def pixel_values(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """A batch, one image per sample (what the HF processor returns): float32 [B, 3 * towers, size, size]."""
        return torch.stack([self(image) for image in images])

    def cameras(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """OFT multi-image input of one sample: float32 [3 * towers * N, size, size].

        Each image is processed alone and the results are concatenated on channels in the given order
        (`[img0_dino, img0_siglip, img1_dino, ...]`; LIBERO: third-person then wrist).
        """
        if not images:
            raise ValueError("cameras() needs at least one image")
        return torch.cat([self(image) for image in images], dim=0)

    @classmethod
    def from_preprocessor_config(
        cls, raw: Mapping[str, Any], source: str = "preprocessor_config.json"
    ) -> ImageTransform:
        """From a saved PrismaticImageProcessor: `tvf_resize_params` / `tvf_normalize_params` (the values the
        processor applies) where present, else `input_sizes` / `interpolations` / `means` / `stds`."""
        strategy = raw.get("image_resize_strategy", "letterbox")  # PrismaticImageProcessor's own default
        if strategy not in SUPPORTED_STRATEGIES:
            raise PreprocessorConfigError(
                f"{source}: image_resize_strategy is {strategy!r}; only {', '.join(SUPPORTED_STRATEGIES)} "
                "(what every OpenVLA / OFT release uses) is implemented"
            )
        count = _tower_count(raw, source)
        towers = tuple(_tower_from_config(raw, index, source) for index in range(count))
        if len({tower.size for tower in towers}) != 1:
            raise PreprocessorConfigError(
                f"{source}: towers have different sizes {[t.size for t in towers]}; "
                "they are stacked on channels, so they must agree"
            )
        return cls(towers=towers)


def read_preprocessor_config(path: PathLike) -> ImageTransform:
    """The `ImageTransform` of a release's preprocessor_config.json."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise PreprocessorConfigError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(raw, Mapping):
        raise PreprocessorConfigError(f"{path}: expected a JSON object")
    return ImageTransform.from_preprocessor_config(raw, str(path))


def _tower_count(raw: Mapping[str, Any], source: str) -> int:
    for key in ("tvf_normalize_params", "means"):
        values = raw.get(key)
        if isinstance(values, list) and values:
            return len(values)
    raise PreprocessorConfigError(f"{source}: needs tvf_normalize_params or means (one entry per vision tower)")


def _tower_from_config(raw: Mapping[str, Any], index: int, source: str) -> TowerTransform:
    where = f"{source}: tower {index}"
    normalize = _entry(raw, "tvf_normalize_params", index)
    mean = normalize.get("mean") if normalize else _entry_value(raw, "means", index)
    std = normalize.get("std") if normalize else _entry_value(raw, "stds", index)
    resize = _entry(raw, "tvf_resize_params", index)
    size = _size(resize.get("size") if resize else _entry_value(raw, "input_sizes", index), where)
    interpolation = resize.get("interpolation") if resize else _entry_value(raw, "interpolations", index)
    return TowerTransform(
        mean=_rgb(mean, f"{where} mean"),
        std=_rgb(std, f"{where} std", positive=True),
        size=size,
        resample=_resample(interpolation, where),
    )


def _entry(raw: Mapping[str, Any], key: str, index: int) -> Optional[Mapping[str, Any]]:
    values = raw.get(key)
    if isinstance(values, list) and index < len(values) and isinstance(values[index], Mapping):
        return values[index]
    return None


def _entry_value(raw: Mapping[str, Any], key: str, index: int) -> Any:
    values = raw.get(key)
    return values[index] if isinstance(values, list) and index < len(values) else None


def _rgb(values: Any, where: str, positive: bool = False) -> RGB:
    numbers = isinstance(values, (list, tuple)) and all(isinstance(v, (int, float)) for v in values)
    if not numbers or len(values) != 3:
        raise PreprocessorConfigError(f"{where} must be 3 numbers, got {values!r}")
    if positive and not all(v > 0 for v in values):
        raise PreprocessorConfigError(f"{where} must be positive, got {values!r}")
    return (float(values[0]), float(values[1]), float(values[2]))


def _size(value: Any, where: str) -> int:
    if value is None:
        return IMAGE_SIZE
    dims = list(value[-2:]) if isinstance(value, (list, tuple)) else [value, value]  # [H, W] or [3, H, W]
    if len(dims) != 2 or dims[0] != dims[1] or not isinstance(dims[0], int) or dims[0] <= 0:
        raise PreprocessorConfigError(f"{where}: size must be a positive square size, got {value!r}")
    return dims[0]


def _resample(value: Any, where: str) -> int:
    if value is None:
        return BICUBIC
    if isinstance(value, str) and value in PIL_RESAMPLING:
        return PIL_RESAMPLING[value]
    if isinstance(value, int) and value in PIL_RESAMPLING.values():
        return value
    raise PreprocessorConfigError(
        f"{where}: interpolation {value!r} is not one of {', '.join(PIL_RESAMPLING)} "
        f"or their PIL codes {sorted(PIL_RESAMPLING.values())}"
    )


def center_crop(image: Image.Image, crop_scale: float = CENTER_CROP_SCALE, size: int = IMAGE_SIZE) -> Image.Image:
    """The eval scripts' `center_crop_image` (models trained with random-crop augmentation, e.g. all OFT LIBERO).

    Upstream: uint8 -> float32 / 255 (tf.image.convert_image_dtype), `tf.image.crop_and_resize` with the centred
    box of side sqrt(crop_scale) (normalised coordinates, corner-aligned bilinear, sample i of n at
    `y1 (H - 1) + i (y2 - y1) (H - 1) / (n - 1)`) to `size`, clip to [0, 1], back to uint8 as
    `saturate(x * 255.5)` truncated. Mirrored here in float32 (bit-equal to TF 2.21 on random 224 and 256 frames);
    it is applied before the processor.
    """
    if not 0.0 < crop_scale <= 1.0:
        raise ValueError(f"crop_scale is the kept fraction of the area, in (0, 1]; got {crop_scale}")
    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    unit = pixels.astype(np.float32) * np.float32(1.0 / 255)
    side = np.float32(np.sqrt(np.float32(crop_scale)))
    start = (np.float32(1.0) - side) / np.float32(2.0)
    rows = _tf_sample_positions(start, start + side, pixels.shape[0], size)
    cols = _tf_sample_positions(start, start + side, pixels.shape[1], size)
    cropped = np.clip(_bilinear(unit, rows, cols), 0.0, 1.0)
    # convert_image_dtype(float -> uint8, saturate=True): scale by 255.5, clamp, then cast (truncation)
    return Image.fromarray(np.clip(cropped * np.float32(255.5), 0, 255).astype(np.uint8))


def _tf_sample_positions(lo: np.float32, hi: np.float32, in_size: int, out_size: int) -> np.ndarray:
    """float32 [out_size] source coordinates of crop_and_resize along one axis (box [lo, hi] normalised)."""
    extent = np.float32(in_size - 1)
    if out_size == 1:
        return np.array([np.float32(0.5) * (lo + hi) * extent], dtype=np.float32)
    step = (hi - lo) * extent / np.float32(out_size - 1)
    return lo * extent + np.arange(out_size, dtype=np.float32) * step


def _bilinear(image: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """TF's bilinear gather (x lerp on top and bottom rows, then y lerp), float32 [len(rows), len(cols), C]."""
    top, left = np.floor(rows).astype(np.int64), np.floor(cols).astype(np.int64)
    bottom = np.minimum(np.ceil(rows).astype(np.int64), image.shape[0] - 1)
    right = np.minimum(np.ceil(cols).astype(np.int64), image.shape[1] - 1)
    y_lerp = (rows - top.astype(np.float32))[:, None, None]
    x_lerp = (cols - left.astype(np.float32))[None, :, None]
    top_row = image[top][:, left] + (image[top][:, right] - image[top][:, left]) * x_lerp
    bottom_row = image[bottom][:, left] + (image[bottom][:, right] - image[bottom][:, left]) * x_lerp
    return (top_row + (bottom_row - top_row) * y_lerp).astype(np.float32)


def resize_like_rlds_approx(image: Image.Image, size: int = IMAGE_SIZE) -> Image.Image:
    """APPROXIMATE stand-in for OFT's `resize_image_for_policy` on frames that are not size x size.

    Upstream encodes a JPEG (tf.image.encode_jpeg: quality 95, 4:2:0) and decodes it, then resizes with TF's
    lanczos3 + antialias and rounds. PIL's JPEG decoder and Lanczos filter are close but not bit-equal: against
    TF 2.21 on 256 -> 224 frames, mean |diff| ~1 level, max 5 (TF's decode alone differs from PIL's by up to 4).
    Rendering at `size` avoids the step, as upstream skips it for frames already that size.
    """
    rgb = image.convert("RGB")
    if rgb.size == (size, size):
        return rgb
    buffer = io.BytesIO()
    rgb.save(buffer, format="JPEG", quality=95, subsampling=2)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB").resize((size, size), resample=Image.Resampling.LANCZOS)


# --- prompts --------------------------------------------------------------------------------------------------


class TextEncoder(Protocol):
    """A `tokenizers.Tokenizer` (encode -> Encoding with `.ids`) or a transformers tokenizer (encode -> ids)."""

    def encode(self, text: str, /) -> Any: ...


def build_prompt(instruction: str, template: str = "openvla") -> str:
    """The eval scripts' prompt: the instruction lower-cased (nothing else is changed) into the template."""
    if template not in PROMPT_TEMPLATES:
        raise ValueError(f"prompt template must be one of {', '.join(PROMPT_TEMPLATES)}; got {template!r}")
    return PROMPT_TEMPLATES[template].format(instruction=instruction.lower())


def encode_text(tokenizer: TextEncoder, text: str, bos_id: int = BOS_ID) -> List[int]:
    """Token ids starting with <bos>, which the release tokenizer adds (add_bos); prepended if it did not."""
    encoded = tokenizer.encode(text)
    ids = [int(i) for i in getattr(encoded, "ids", encoded)]
    return ids if ids and ids[0] == bos_id else [bos_id] + ids


def append_empty_token(ids: Sequence[int]) -> List[int]:
    """`predict_action`'s rule: append 29871 unless the ids already end with it (OpenVLA and OFT alike).

    Upstream does not extend the attention mask for it (harmless under SDPA with an all-ones mask).
    """
    ids = list(ids)
    return ids if ids and ids[-1] == EMPTY_TOKEN_ID else ids + [EMPTY_TOKEN_ID]


def prompt_token_ids(tokenizer: TextEncoder, instruction: str, template: str = "openvla") -> List[int]:
    """The ids OpenVLA's LLM reads after the image: `<bos> prompt... 29871` (then it generates 7 action ids)."""
    return append_empty_token(encode_text(tokenizer, build_prompt(instruction, template)))


def oft_query_ids(prompt_ids: Sequence[int], action_dim: int = 7, chunk: int = 8) -> Tuple[List[int], int]:
    """OFT's `predict_action` input ids and its NUM_PROMPT_TOKENS.

    `prompt_ids (+ 29871) + [1] * (action_dim * chunk) + [2]`: the placeholders (LIBERO: 56) are embedded and
    then zeroed, the stop token keeps its embedding. NUM_PROMPT_TOKENS = len(prompt + 29871) - 1 (without <bos>);
    the action hidden states start at NUM_PATCHES + NUM_PROMPT_TOKENS.
    """
    ids = append_empty_token(prompt_ids)
    return ids + [OFT_PLACEHOLDER_ID] * (action_dim * chunk) + [STOP_TOKEN_ID], len(ids) - 1
