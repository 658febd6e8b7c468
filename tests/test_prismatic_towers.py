"""The release's vision towers and projector: names, shapes, counts (meta device) and maths against hand references.

Expected counts and key shapes are the facts sheet's (/work/shared/facts/openvla-checkpoints.md §3), measured there on
the `meta` device from the release's own code (timm 0.9.10, transformers 4.40.1).
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlaslurm.models.prismatic.projector import FusedGeluMLPProjector
from vlaslurm.models.prismatic.vit import (
    Block,
    DinoSigLIPBackbone,
    DinoV2Config,
    SigLIPConfig,
    VisionTower,
    ViTConfig,
    tower_configs,
)

TIMM_IDS = ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"]
TINY_OVERRIDES = [{"embed_dim": 32, "depth": 4, "num_heads": 2}, {"embed_dim": 48, "depth": 4, "num_heads": 3}]
Shapes = Dict[str, Tuple[int, ...]]

# --- the release's names and shapes (facts sheet §3), written out for one block of each tower -------------------
DINO_TOP: Shapes = {
    "cls_token": (1, 1, 1024),
    "reg_token": (1, 4, 1024),
    "pos_embed": (1, 256, 1024),
    "patch_embed.proj.weight": (1024, 3, 14, 14),
    "patch_embed.proj.bias": (1024,),
    "norm.weight": (1024,),
    "norm.bias": (1024,),
}
DINO_BLOCK: Shapes = {
    "norm1.weight": (1024,),
    "norm1.bias": (1024,),
    "attn.qkv.weight": (3072, 1024),
    "attn.qkv.bias": (3072,),
    "attn.proj.weight": (1024, 1024),
    "attn.proj.bias": (1024,),
    "ls1.scale_factor": (1024,),
    "norm2.weight": (1024,),
    "norm2.bias": (1024,),
    "mlp.fc1.weight": (4096, 1024),
    "mlp.fc1.bias": (4096,),
    "mlp.fc2.weight": (1024, 4096),
    "mlp.fc2.bias": (1024,),
    "ls2.scale_factor": (1024,),
}
SIGLIP_TOP: Shapes = {
    "pos_embed": (1, 256, 1152),
    "patch_embed.proj.weight": (1152, 3, 14, 14),
    "patch_embed.proj.bias": (1152,),
    "norm.weight": (1152,),
    "norm.bias": (1152,),
    "attn_pool.latent": (1, 1, 1152),
    "attn_pool.q.weight": (1152, 1152),
    "attn_pool.q.bias": (1152,),
    "attn_pool.kv.weight": (2304, 1152),
    "attn_pool.kv.bias": (2304,),
    "attn_pool.proj.weight": (1152, 1152),
    "attn_pool.proj.bias": (1152,),
    "attn_pool.norm.weight": (1152,),
    "attn_pool.norm.bias": (1152,),
    "attn_pool.mlp.fc1.weight": (4304, 1152),
    "attn_pool.mlp.fc1.bias": (4304,),
    "attn_pool.mlp.fc2.weight": (1152, 4304),
    "attn_pool.mlp.fc2.bias": (1152,),
}
SIGLIP_BLOCK: Shapes = {
    "norm1.weight": (1152,),
    "norm1.bias": (1152,),
    "attn.qkv.weight": (3456, 1152),
    "attn.qkv.bias": (3456,),
    "attn.proj.weight": (1152, 1152),
    "attn.proj.bias": (1152,),
    "norm2.weight": (1152,),
    "norm2.bias": (1152,),
    "mlp.fc1.weight": (4304, 1152),
    "mlp.fc1.bias": (4304,),
    "mlp.fc2.weight": (1152, 4304),
    "mlp.fc2.bias": (1152,),
}
PROJECTOR: Shapes = {
    "fc1.weight": (8704, 2176),
    "fc1.bias": (8704,),
    "fc2.weight": (4096, 8704),
    "fc2.bias": (4096,),
    "fc3.weight": (4096, 4096),
    "fc3.bias": (4096,),
}


def shapes(module: nn.Module) -> Shapes:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def expected_tower(top: Shapes, block: Shapes, depth: int) -> Shapes:
    out = dict(top)
    out.update({f"blocks.{i}.{k}": v for i in range(depth) for k, v in block.items()})
    return out


def names_without_blocks_past(keys: List[str], depth: int) -> set:
    """The key names of a tower cut to its first `depth` blocks."""
    return {k for k in keys if not (m := re.search(r"(?:^|\.)blocks\.(\d+)\.", k)) or int(m.group(1)) < depth}


class Release(nn.Module):
    """The release's parent attribute names, to check the full key prefixes."""

    def __init__(self, backbone: DinoSigLIPBackbone, projector: FusedGeluMLPProjector) -> None:
        super().__init__()
        self.vision_backbone = backbone
        self.projector = projector


@pytest.fixture(scope="module")
def full() -> Release:
    with torch.device("meta"):  # shapes only: nothing is allocated
        return Release(DinoSigLIPBackbone(), FusedGeluMLPProjector())


@pytest.fixture()
def tiny() -> DinoSigLIPBackbone:
    torch.manual_seed(0)
    return DinoSigLIPBackbone(*tower_configs(TIMM_IDS, tiny_timm_overrides=TINY_OVERRIDES))


# --- full size, on meta -------------------------------------------------------------------------------------------
def test_parameter_counts_equal_the_release(full: Release) -> None:
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(full.vision_backbone.featurizer) == 303_230_976
    assert count(full.vision_backbone.fused_featurizer) == 427_680_704
    assert count(full.projector) == 71_385_600
    # 982 tensors in the release, of which 291 are the Llama's (embed, 32 x 9, norm, lm_head): 691 are ours.
    assert len(full.state_dict()) == 982 - (1 + 32 * 9 + 1 + 1)
    assert not list(full.buffers())


def test_state_dict_names_and_shapes_equal_the_release(full: Release) -> None:
    assert shapes(full.vision_backbone.featurizer) == expected_tower(DINO_TOP, DINO_BLOCK, 24)
    assert shapes(full.vision_backbone.fused_featurizer) == expected_tower(SIGLIP_TOP, SIGLIP_BLOCK, 27)
    assert shapes(full.projector) == PROJECTOR
    keys = full.state_dict().keys()
    assert "vision_backbone.featurizer.blocks.23.ls2.scale_factor" in keys
    assert "vision_backbone.fused_featurizer.attn_pool.mlp.fc2.bias" in keys
    assert {k.split(".")[0] for k in keys} == {"vision_backbone", "projector"}


def test_full_size_configs() -> None:
    dino, siglip = tower_configs(TIMM_IDS, (224, 224))
    assert (dino.mlp_hidden, siglip.mlp_hidden) == (4096, 4304)
    assert (dino.head_dim, siglip.head_dim) == (64, 72)
    assert (dino.num_prefix_tokens, siglip.num_prefix_tokens) == (5, 0)
    assert (dino.feature_block, siglip.feature_block) == (22, 25)  # the second-to-last block


def test_every_layer_norm_uses_eps_1e_6(full: Release) -> None:
    norms = [m for m in full.vision_backbone.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 24 + 1 + 2 * 27 + 1 + 1
    assert {m.eps for m in norms} == {1e-6}


# --- tiny overrides -----------------------------------------------------------------------------------------------
def test_tiny_towers_keep_the_release_names(full: Release, tiny: DinoSigLIPBackbone) -> None:
    full_sd = full.vision_backbone.state_dict()
    assert set(tiny.state_dict()) == names_without_blocks_past(list(full_sd), 4)
    assert shapes(tiny.featurizer)["blocks.0.mlp.fc1.weight"] == (128, 32)  # timm's rule: int(32 * 4.0)
    assert shapes(tiny.fused_featurizer)["blocks.0.mlp.fc1.weight"] == (179, 48)  # int(48 * 3.7362)
    assert shapes(tiny.featurizer)["reg_token"] == (1, 4, 32)


def test_tiny_forward_shape_and_channel_split(tiny: DinoSigLIPBackbone) -> None:
    pixels = torch.randn(2, 6, 224, 224)
    with torch.no_grad():
        out = tiny(pixels)
        assert out.shape == (2, 256, 32 + 48) and tiny.embed_dim == 80
        torch.testing.assert_close(out[..., :32], tiny.featurizer(pixels[:, :3]))  # channels 0-2 go to DINOv2
        torch.testing.assert_close(out[..., 32:], tiny.fused_featurizer(pixels[:, 3:]))  # 3-5 to SigLIP


def test_bad_overrides_and_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"tiny_timm_overrides\[1\]: unknown key 'embed_dm'.*did you mean embed_dim"):
        tower_configs(TIMM_IDS, tiny_timm_overrides=[{}, {"embed_dm": 48}])
    with pytest.raises(ValueError, match=r"tiny_timm_overrides\[0\]:.*multiple of num_heads \(5\)"):
        tower_configs(TIMM_IDS, tiny_timm_overrides=[{"num_heads": 5}, {}])
    with pytest.raises(ValueError, match="timm_model_ids must be"):
        tower_configs(TIMM_IDS[::-1])
    tower = DinoSigLIPBackbone(*tower_configs(TIMM_IDS, tiny_timm_overrides=TINY_OVERRIDES))
    with pytest.raises(ValueError, match=r"pixel_values must be \[B, 6, H, W\]"):
        tower(torch.zeros(1, 3, 224, 224))


# --- semantics against hand computations --------------------------------------------------------------------------
def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def ref_layer_norm(x: torch.Tensor, sd: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-6) * sd[f"{name}.weight"] + sd[f"{name}.bias"]


def ref_linear(x: torch.Tensor, sd: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def ref_attention(x: torch.Tensor, sd: Dict[str, torch.Tensor], name: str, heads: int) -> torch.Tensor:
    b, n, c = x.shape
    qkv = ref_linear(x, sd, f"{name}.qkv").split(c, -1)  # features laid out [3, heads, head_dim]
    q, k, v = (t.reshape(b, n, heads, c // heads).transpose(1, 2) for t in qkv)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c // heads), dim=-1)
    return ref_linear((weights @ v).transpose(1, 2).reshape(b, n, c), sd, f"{name}.proj")


def ref_tower(images: torch.Tensor, sd: Dict[str, torch.Tensor], cfg: ViTConfig) -> torch.Tensor:
    """timm 0.9.10's get_intermediate_layers(n={depth-2}) written out: patches, pos, prefix, blocks, drop prefix."""
    weight = sd["patch_embed.proj.weight"]
    cols = F.unfold(images, cfg.patch_size, stride=cfg.patch_size).transpose(1, 2)  # [B, patches, 3*p*p]
    x = cols @ weight.reshape(weight.shape[0], -1).T + sd["patch_embed.proj.bias"] + sd["pos_embed"]
    prefix = [sd[k].expand(x.shape[0], -1, -1) for k in ("cls_token", "reg_token") if k in sd]
    x = torch.cat([*prefix, x], dim=1)
    scale = (lambda t, i, j: t * sd[f"blocks.{i}.ls{j}.scale_factor"]) if cfg.layer_scale else (lambda t, i, j: t)
    for i in range(cfg.depth - 1):  # the last block is not used
        x = x + scale(
            ref_attention(ref_layer_norm(x, sd, f"blocks.{i}.norm1"), sd, f"blocks.{i}.attn", cfg.num_heads), i, 1
        )
        h = erf_gelu(ref_linear(ref_layer_norm(x, sd, f"blocks.{i}.norm2"), sd, f"blocks.{i}.mlp.fc1"))
        x = x + scale(ref_linear(h, sd, f"blocks.{i}.mlp.fc2"), i, 2)
    return x[:, cfg.num_prefix_tokens :]  # no final norm


def block(tower: VisionTower, index: int) -> Block:
    found = tower.blocks[index]
    assert isinstance(found, Block)
    return found


def randomise(module: nn.Module) -> None:
    """Every parameter random (LayerScale and LayerNorm weights too), so each one shows in the output."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith(("norm1.weight", "norm2.weight")) else 0.0))


@pytest.mark.parametrize("tower_name", ["featurizer", "fused_featurizer"])
def test_tower_equals_hand_reference(tiny: DinoSigLIPBackbone, tower_name: str) -> None:
    tower: VisionTower = getattr(tiny, tower_name).double()
    randomise(tower)
    images = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    with torch.no_grad():
        out = tower(images)
        expected = ref_tower(images, tower.state_dict(), tower.cfg)
    assert out.shape == (2, 256, tower.cfg.embed_dim)  # the 5 DINOv2 prefix tokens are dropped
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_the_last_block_is_not_used_and_the_penultimate_is(tiny: DinoSigLIPBackbone) -> None:
    pixels = torch.randn(1, 6, 224, 224)
    with torch.no_grad():
        before = tiny(pixels)
        for tower in (tiny.featurizer, tiny.fused_featurizer):
            for p in tower.blocks[-1].parameters():
                p.fill_(float("nan"))
        torch.testing.assert_close(tiny(pixels), before)
        for tower in (tiny.featurizer, tiny.fused_featurizer):
            block(tower, -2).mlp.fc2.bias.add_(1.0)
        changed = tiny(pixels)
    assert (changed != before).all()  # every feature of both towers moved: block depth-2 feeds them


def test_layer_scale_multiplies_the_branches(tiny: DinoSigLIPBackbone) -> None:
    dino = tiny.featurizer
    images = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        for name, p in dino.named_parameters():
            if name.endswith("scale_factor"):
                p.zero_()  # every block becomes the identity
        out = dino(images)
        patches = dino.patch_embed.proj(images).flatten(2).transpose(1, 2) + dino.pos_embed
    torch.testing.assert_close(out, patches)  # positions on the patches only, prefix tokens gone


def test_siglip_mlp_uses_exact_gelu(tiny: DinoSigLIPBackbone) -> None:
    mlp = block(tiny.fused_featurizer, 0).mlp.double()
    x = torch.randn(4, 48, dtype=torch.float64) * 3
    sd = mlp.state_dict()
    with torch.no_grad():
        out = mlp(x)
        hidden = ref_linear(x, sd, "fc1")
        exact = ref_linear(erf_gelu(hidden), sd, "fc2")
        approx = ref_linear(tanh_gelu(hidden), sd, "fc2")
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)
    assert (out - approx).abs().max() > 1e-6  # the check can tell the tanh variant apart


def test_projector_equals_hand_reference() -> None:
    torch.manual_seed(0)
    projector = FusedGeluMLPProjector(vision_dim=80, llm_dim=64).double()
    assert shapes(projector) == {
        "fc1.weight": (320, 80),
        "fc1.bias": (320,),
        "fc2.weight": (64, 320),
        "fc2.bias": (64,),
        "fc3.weight": (64, 64),
        "fc3.bias": (64,),
    }
    randomise(projector)
    patches = torch.randn(2, 5, 80, dtype=torch.float64)
    sd = projector.state_dict()
    with torch.no_grad():
        out = projector(patches)
    hidden = erf_gelu(ref_linear(erf_gelu(ref_linear(patches, sd, "fc1")), sd, "fc2"))
    torch.testing.assert_close(out, ref_linear(hidden, sd, "fc3"), rtol=1e-12, atol=1e-12)


def test_configs_are_per_tower_dataclasses() -> None:
    assert DinoV2Config().timm_id == TIMM_IDS[0] and SigLIPConfig().timm_id == TIMM_IDS[1]
    assert DinoV2Config.with_overrides({"depth": 3}) == DinoV2Config(depth=3)
