"""The two ViT towers of the OpenVLA release's fused vision backbone (`dinosiglip-vit-so-224px`) in plain torch.

Parameter names and maths are timm 0.9.10's (`vit_large_patch14_reg4_dinov2.lvd142m` and
`vit_so400m_patch14_siglip_224`, built with `num_classes=0, img_size=224, act_layer=None`) after the release's
renaming, so a release state dict loads as is: `vision_backbone.featurizer.*` (DINOv2) and
`vision_backbone.fused_featurizer.*` (SigLIP). Facts: /work/shared/facts/openvla-checkpoints.md, sections 3, 5, 8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from vlaslurm.spec.errors import close_names

LAYER_NORM_EPS = 1e-6  # timm's ViT default; torch's 1e-5 changes the outputs measurably
# The keys of a `tiny_timm_overrides` entry: timm's own argument names, replacing the model's defaults.
OVERRIDABLE = ("embed_dim", "depth", "num_heads", "mlp_ratio")

ConfigT = TypeVar("ConfigT", bound="ViTConfig")


@dataclass(frozen=True)
class ViTConfig:
    """Shape of one tower; field names follow timm's `VisionTransformer` arguments."""

    embed_dim: int
    """Width of every token."""
    depth: int
    """Number of blocks; the features are the output of block `depth - 2` (0-based)."""
    num_heads: int
    """Attention heads; `embed_dim` must be a multiple of it."""
    mlp_ratio: float
    """MLP hidden size is `int(embed_dim * mlp_ratio)`, timm's rule (4.0 gives 4096, 3.7362 gives 4304)."""
    class_token: bool
    """Whether a `cls_token` is prepended."""
    reg_tokens: int
    """Number of register tokens (`reg_token`) prepended after the class token."""
    layer_scale: bool
    """Whether blocks scale their branches by `ls1/ls2.scale_factor` (timm `init_values` set)."""
    map_head: bool
    """Whether the (unused) `attn_pool` MAP head exists (timm `global_pool='map'`)."""
    image_size: int = 224
    """Side of the square input image in pixels."""
    patch_size: int = 14
    """Side of a patch; `pos_embed` covers the `(image_size // patch_size)**2` patches only."""

    timm_id: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name in ("embed_dim", "depth", "num_heads", "image_size", "patch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self._where()}.{name} must be > 0, got {getattr(self, name)}")
        if self.depth < 2:
            raise ValueError(f"{self._where()}.depth must be >= 2 (features come from block depth-2), got {self.depth}")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"{self._where()}.embed_dim ({self.embed_dim}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{self._where()}.image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})"
            )

    def _where(self) -> str:
        return self.timm_id or type(self).__name__

    @property
    def mlp_hidden(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.reg_tokens

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def feature_block(self) -> int:
        """0-based index of the block whose output is the feature (the release's second-to-last)."""
        return self.depth - 2

    @classmethod
    def with_overrides(
        cls: Type[ConfigT],
        overrides: Optional[Mapping[str, Any]],
        where: str = "tiny_timm_overrides",
        image_size: int = 224,
    ) -> ConfigT:
        """The full-size defaults with `overrides` (timm names, see OVERRIDABLE) replacing some of them."""
        overrides = dict(overrides or {})
        for key, value in overrides.items():
            _check_override(cls, where, key, value)
        values = {f.name: getattr(cls, f.name) for f in dataclasses.fields(cls)}  # the class's full-size defaults
        values.update(overrides, image_size=image_size)
        try:
            return cls(**values)
        except ValueError as err:  # name the config.json entry the bad combination came from
            raise ValueError(f"{where}: {err}") from None


def _check_override(cls: Type[ViTConfig], where: str, key: str, value: Any) -> None:
    if key not in OVERRIDABLE:
        defaults = ", ".join(f"{k} (default {getattr(cls, k)})" for k in OVERRIDABLE)
        hint = close_names(key, OVERRIDABLE)
        did_you_mean = f"; did you mean {', '.join(hint)}?" if hint else ""
        raise ValueError(f"{where}: unknown key {key!r} for {cls.timm_id}; valid keys: {defaults}{did_you_mean}")
    numeric = (int, float) if key == "mlp_ratio" else (int,)
    if isinstance(value, bool) or not isinstance(value, numeric):
        kind = "a number" if key == "mlp_ratio" else "an integer"
        raise ValueError(f"{where}.{key} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class DinoV2Config(ViTConfig):
    """DINOv2 ViT-L/14 with 4 registers (`featurizer`): cls + 4 register tokens, LayerScale, no MAP head."""

    embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    class_token: bool = True
    reg_tokens: int = 4
    layer_scale: bool = True
    map_head: bool = False

    timm_id: ClassVar[str] = "vit_large_patch14_reg4_dinov2.lvd142m"


@dataclass(frozen=True)
class SigLIPConfig(ViTConfig):
    """SigLIP So400m/14 (`fused_featurizer`): no prefix tokens, no LayerScale, an unused MAP head."""

    embed_dim: int = 1152
    depth: int = 27
    num_heads: int = 16
    mlp_ratio: float = 3.7362  # timm's value: int(1152 * 3.7362) = 4304
    class_token: bool = False
    reg_tokens: int = 0
    layer_scale: bool = False
    map_head: bool = True

    timm_id: ClassVar[str] = "vit_so400m_patch14_siglip_224"


def tower_configs(
    timm_model_ids: Sequence[str],
    image_sizes: Sequence[int] = (224, 224),
    tiny_timm_overrides: Optional[Sequence[Mapping[str, Any]]] = None,
) -> Tuple[DinoV2Config, SigLIPConfig]:
    """The two tower configs from config.json's `timm_model_ids`, `image_sizes` and optional `tiny_timm_overrides`."""
    expected = [DinoV2Config.timm_id, SigLIPConfig.timm_id]
    if list(timm_model_ids) != expected:
        raise ValueError(f"timm_model_ids must be {expected} (dinosiglip-vit-so-224px), got {list(timm_model_ids)}")
    if len(image_sizes) != 2:
        raise ValueError(f"image_sizes must hold one size per tower (2), got {list(image_sizes)}")
    overrides: Sequence[Optional[Mapping[str, Any]]] = tiny_timm_overrides or (None, None)
    if len(overrides) != 2:
        raise ValueError(f"tiny_timm_overrides must hold one entry per timm_model_ids entry (2), got {len(overrides)}")
    return (
        DinoV2Config.with_overrides(overrides[0], "tiny_timm_overrides[0]", image_sizes[0]),
        SigLIPConfig.with_overrides(overrides[1], "tiny_timm_overrides[1]", image_sizes[1]),
    )


def layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=LAYER_NORM_EPS)


class PatchEmbed(nn.Module):
    """Conv2d with kernel = stride = patch size (with bias), flattened to [B, patches, D] in row-major order."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.image_size = cfg.image_size
        self.proj = nn.Conv2d(3, cfg.embed_dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or tuple(images.shape[2:]) != (self.image_size,) * 2:
            raise ValueError(
                f"a tower takes images [B, 3, {self.image_size}, {self.image_size}], got {list(images.shape)}"
            )
        return self.proj(images).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention: one fused qkv Linear (with bias), scale head_dim**-0.5, output proj."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        # qkv features are laid out [3, heads, head_dim], the split timm (and so the release's weights) uses.
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # default scale is head_dim**-0.5
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    """fc1, exact (erf) GELU, fc2. The release passes act_layer=None, so SigLIP too gets exact GELU, not tanh."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="none")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch; timm's `gamma`, renamed `scale_factor` by the release."""

    def __init__(self, dim: int, init: float = 1e-5) -> None:
        super().__init__()
        self.scale_factor = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_factor


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x)))."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        dim = cfg.embed_dim
        self.norm1 = layer_norm(dim)
        self.attn = Attention(dim, cfg.num_heads)
        # Without LayerScale the branches are unscaled; Identity has no parameters, so no keys appear.
        self.ls1: nn.Module = LayerScale(dim) if cfg.layer_scale else nn.Identity()
        self.norm2 = layer_norm(dim)
        self.mlp = Mlp(dim, cfg.mlp_hidden)
        self.ls2: nn.Module = LayerScale(dim) if cfg.layer_scale else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPoolHead(nn.Module):
    """SigLIP's MAP head (timm AttentionPoolLatent), weights only: the release keeps it but never runs it."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        dim = cfg.embed_dim
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = layer_norm(dim)
        self.mlp = Mlp(dim, cfg.mlp_hidden)


class VisionTower(nn.Module):
    """One ViT; `forward` gives the patch tokens of block `depth - 2`, prefix tokens dropped, no final norm."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.embed_dim
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, dim)) if cfg.reg_tokens else None
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_patches, dim))  # patches only (timm no_embed_class)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = layer_norm(dim)  # in the release's weights, but the features skip it
        self.attn_pool = AttentionPoolHead(cfg) if cfg.map_head else None
        self._init_tokens()

    def _init_tokens(self) -> None:
        # timm's initialisation, for randomly initialised (test) towers; checkpoints overwrite it.
        if self.pos_embed.is_meta:  # nothing to fill, and normal_ on meta imports torch._refs (seconds)
            return
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)

    def prefix_tokens(self, batch: int) -> List[torch.Tensor]:
        """[cls] then [reg x N], each expanded to the batch (none for SigLIP)."""
        tokens = [t for t in (self.cls_token, self.reg_token) if t is not None]
        return [t.expand(batch, -1, -1) for t in tokens]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, S, S], normalised for this tower -> patch features [B, (S/patch)**2, embed_dim]."""
        x = self.patch_embed(images) + self.pos_embed  # positions go to the patches before the prefix is added
        x = torch.cat([*self.prefix_tokens(x.shape[0]), x], dim=1)
        # timm runs the last block too and discards its output; skipping it gives the same features.
        for block in self.blocks[: self.cfg.feature_block + 1]:
            x = block(x)
        return x[:, self.cfg.num_prefix_tokens :]


class DinoSigLIPBackbone(nn.Module):
    """The fused backbone: `featurizer` (DINOv2) and `fused_featurizer` (SigLIP), features concatenated.

    Input `pixel_values` [B, 6, 224, 224]: channels 0-2 are the image normalised for DINOv2 (ImageNet mean/std),
    channels 3-5 the same image normalised for SigLIP (mean = std = 0.5), as the release's processor stacks them.
    Output [B, 256, 1024 + 1152]: DINOv2 features first, then SigLIP's.
    """

    def __init__(self, dino: Optional[DinoV2Config] = None, siglip: Optional[SigLIPConfig] = None) -> None:
        super().__init__()
        dino, siglip = dino or DinoV2Config(), siglip or SigLIPConfig()
        if dino.num_patches != siglip.num_patches:
            raise ValueError(
                f"the towers must give the same number of patches to be fused, got {dino.num_patches} "
                f"(DINOv2) and {siglip.num_patches} (SigLIP); use equal image_sizes/patch_size"
            )
        self.featurizer = VisionTower(dino)
        self.fused_featurizer = VisionTower(siglip)

    @property
    def embed_dim(self) -> int:
        """Width of a fused patch feature (2176 at full size), the projector's input."""
        return self.featurizer.cfg.embed_dim + self.fused_featurizer.cfg.embed_dim

    @property
    def num_patches(self) -> int:
        return self.featurizer.cfg.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, 6, S, S] (DINOv2 channels, then SigLIP's) -> [B, patches, embed_dim]."""
        if pixel_values.ndim != 4 or pixel_values.shape[1] != 6:
            raise ValueError(
                "pixel_values must be [B, 6, H, W] (channels 0-2 for DINOv2, 3-5 for SigLIP), "
                f"got {list(pixel_values.shape)}"
            )
        dino_images, siglip_images = torch.split(pixel_values, [3, 3], dim=1)
        return torch.cat([self.featurizer(dino_images), self.fused_featurizer(siglip_images)], dim=2)
