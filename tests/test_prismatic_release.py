"""An OpenVLA release folder loads strictly and predicts actions: full-size names and counts on `meta`, and a tiny
random checkpoint written in the release's layout, loaded back bit for bit.

Expected counts, keys and config.json are the facts sheet's (/work/shared/facts/openvla-checkpoints.md §2, §3),
measured there on the `meta` device from the release's own code (timm 0.9.10, transformers 4.40.1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaslurm.models.prismatic.actions import UnnormKeyError
from vlaslurm.models.prismatic.preprocess import EMPTY_TOKEN_ID
from vlaslurm.models.prismatic.release import (
    ReleaseConfigError,
    ReleasedOpenVLA,
    ReleaseWeightsError,
    build_vla,
    llama_layout_tokenizer,
    load_pretrained,
    parse_release_config,
    read_release_config,
    release_config_for,
    release_config_json,
    save_release_layout,
    tiny_release_config,
)
from vlaslurm.models.prismatic.vla import PrismaticVLA, last_window

torch.set_num_threads(2)


def action_stats(low: float, high: float) -> Dict[str, object]:
    return {
        "mean": [0.0] * 7,
        "std": [1.0] * 7,
        "min": [low - 1.0] * 7,
        "max": [high + 1.0] * 7,
        "q01": [low + 0.1 * i for i in range(7)],
        "q99": [high + 0.2 * i for i in range(7)],
        "mask": [True] * 6 + [False],  # the gripper is not normalised
    }


NORM_STATS = {
    "bridge_orig": {"action": action_stats(-0.5, 0.5), "num_transitions": 100, "num_trajectories": 4},
    "libero_spatial_no_noops": {"action": action_stats(-2.0, 3.0), "num_transitions": 50, "num_trajectories": 2},
}
BRIDGE = "bridge_orig"

# openvla-7b's config.json as the conversion script + save_pretrained write it (facts §2), small norm_stats.
RELEASE_CONFIG = {
    "arch_specifier": "no-align+fused-gelu-mlp",
    "architectures": ["OpenVLAForActionPrediction"],
    "auto_map": {
        "AutoConfig": "configuration_prismatic.OpenVLAConfig",
        "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction",
    },
    "hf_llm_id": "meta-llama/Llama-2-7b-hf",
    "image_resize_strategy": "resize-naive",
    "image_sizes": [224, 224],
    "llm_backbone_id": "llama2-7b-pure",
    "llm_max_length": 2048,
    "model_type": "openvla",
    "n_action_bins": 256,
    "norm_stats": NORM_STATS,
    "output_projector_states": False,
    "pad_to_multiple_of": 64,
    "pad_token_id": 32000,
    "text_config": {"model_type": "llama", "pad_token_id": 32000, "torch_dtype": "bfloat16", "vocab_size": 32064},
    "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "timm_override_act_layers": [None, None],
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_fused_vision_backbone": True,
    "vision_backbone_id": "dinosiglip-vit-so-224px",
}
LM_LAYER_SHAPES = {
    "self_attn.q_proj.weight": (4096, 4096),
    "self_attn.k_proj.weight": (4096, 4096),
    "self_attn.v_proj.weight": (4096, 4096),
    "self_attn.o_proj.weight": (4096, 4096),
    "mlp.gate_proj.weight": (11008, 4096),
    "mlp.up_proj.weight": (11008, 4096),
    "mlp.down_proj.weight": (4096, 11008),
    "input_layernorm.weight": (4096,),
    "post_attention_layernorm.weight": (4096,),
}
COMPONENT_PARAMETERS = {
    "vision_backbone.featurizer.": 303_230_976,
    "vision_backbone.fused_featurizer.": 427_680_704,
    "projector.": 71_385_600,
    "language_model.": 6_738_939_904,
}
RELEASE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "dataset_statistics.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}


# --- full size, on meta ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_size(tmp_path_factory) -> PrismaticVLA:
    path = tmp_path_factory.mktemp("openvla-7b") / "config.json"
    path.write_text(json.dumps(RELEASE_CONFIG))
    return build_vla(read_release_config(path), device="meta", dtype=torch.bfloat16)


def test_full_size_counts_on_meta(full_size):
    state = full_size.state_dict()
    assert len(state) == 982  # no buffers: the rotary frequencies are non-persistent
    assert sum(t.numel() for t in state.values()) == 7_541_237_184
    for prefix, count in COMPONENT_PARAMETERS.items():
        assert sum(t.numel() for k, t in state.items() if k.startswith(prefix)) == count, prefix
    assert all(t.is_meta and t.dtype == torch.bfloat16 for t in state.values())


def test_full_size_language_model_keys(full_size):
    shapes = {k: tuple(t.shape) for k, t in full_size.state_dict().items() if k.startswith("language_model.")}
    expected = {f"language_model.model.layers.{i}.{name}": s for i in range(32) for name, s in LM_LAYER_SHAPES.items()}
    expected.update(
        {
            "language_model.model.embed_tokens.weight": (32064, 4096),
            "language_model.model.norm.weight": (4096,),
            "language_model.lm_head.weight": (32064, 4096),
        }
    )
    assert shapes == expected  # no attention biases, nothing else
    others = {k.split(".")[0] + "." + k.split(".")[1] for k in full_size.state_dict() if k not in expected}
    assert others == {"vision_backbone.featurizer", "vision_backbone.fused_featurizer", "projector.fc1",
                      "projector.fc2", "projector.fc3"}  # fmt: skip
    llm = full_size.language_model
    assert llm.config.rms_norm_eps == 1e-6 and not llm.config.tie_word_embeddings
    assert llm.lm_head.weight is not llm.get_input_embeddings().weight
    assert llm.config._attn_implementation == "sdpa"


def test_config_json_is_the_releases(full_size):
    written = release_config_json(release_config_for(full_size, NORM_STATS), "bfloat16")
    assert {**written, "transformers_version": "4.40.1"} == RELEASE_CONFIG


def test_config_errors_name_the_file_and_field():
    def error(**changes) -> str:
        raw = {**RELEASE_CONFIG, **changes}
        with pytest.raises(ReleaseConfigError) as info:
            parse_release_config({k: v for k, v in raw.items() if v != "DROP"}, "ckpt/config.json")
        return str(info.value)

    assert "ckpt/config.json: text_config is required" in error(text_config="DROP")
    assert "use_fused_vision_backbone is false; only the fused" in error(use_fused_vision_backbone=False)
    assert "arch_specifier is 'no-align+gelu-mlp'; only 'no-align+fused-gelu-mlp'" in error(
        arch_specifier="no-align+gelu-mlp"
    )
    assert "n_action_bins must be an integer, got str '256'" in error(n_action_bins="256")
    assert "model_type is 'prismatic'" in error(model_type="prismatic")
    assert "did you mean hidden_size" in error(text_config={**RELEASE_CONFIG["text_config"], "hiden_size": 64})
    assert "ckpt/config.json: tiny_timm_overrides[1]: unknown key 'dim'" in error(tiny_timm_overrides=[{}, {"dim": 8}])
    assert "timm_model_ids must be" in error(timm_model_ids=["vit_base_patch16_224"])
    assert "timm_override_act_layers is ['gelu_tanh', None]" in error(timm_override_act_layers=["gelu_tanh", None])
    assert "text_config.vocab_size must be an integer" in error(text_config={"model_type": "llama"})


# --- a tiny random checkpoint in the release's layout -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> PrismaticVLA:
    torch.manual_seed(0)
    vla = build_vla(tiny_release_config(NORM_STATS), device="cpu").eval()
    with torch.no_grad():  # only action ids can win the argmax, so decoding visits many bins, not one clipped id
        head = vla.language_model.lm_head.weight
        head[:31744] = 0
        head[32000:] = 0
    return vla


@pytest.fixture(scope="module")
def tokenizer():
    return llama_layout_tokenizer()


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory, tiny, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny release")  # a space on purpose
    return save_release_layout(tiny, folder, tokenizer, NORM_STATS, max_shard_size="6MB")


@pytest.fixture(scope="module")
def loaded(release_dir) -> ReleasedOpenVLA:
    return load_pretrained(release_dir)


def frame(seed: int = 0, height: int = 96, width: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_folder_has_the_release_file_names(release_dir):
    names = {p.name for p in release_dir.iterdir()}
    shards = sorted(names - RELEASE_FILES)
    assert names >= RELEASE_FILES
    assert len(shards) >= 2 and shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, 1 + len(shards))
    ]
    config = json.loads((release_dir / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "architectures", "auto_map")} == {
        k: RELEASE_CONFIG[k] for k in ("model_type", "architectures", "auto_map")
    }
    assert set(config) == set(RELEASE_CONFIG) | {"tiny_timm_overrides"}
    assert config["text_config"]["vocab_size"] == 32064 and config["text_config"]["hidden_size"] == 64
    generation = json.loads((release_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 32000)
    index = json.loads((release_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)


def test_save_then_load_is_bit_identical(tiny, loaded, tokenizer):
    assert loaded.model.state_dict().keys() == tiny.state_dict().keys()
    assert all(torch.equal(t, loaded.model.state_dict()[k]) for k, t in tiny.state_dict().items())
    pixels, ids = loaded.pixel_values(frame()), loaded.input_ids("Pick up the cup")
    with torch.inference_mode():
        assert torch.equal(tiny(pixels, ids), loaded.model(pixels, ids))
    original = ReleasedOpenVLA(tiny, tokenizer, loaded.image_transform, loaded.bins, loaded.norm_stats, loaded.config)
    image = frame(1)
    assert np.array_equal(original.predict_action(image, "put the bowl on the plate", BRIDGE),
                          loaded.predict_action(image, "put the bowl on the plate", BRIDGE))  # fmt: skip


def test_one_shard_is_a_single_model_safetensors(tiny, tokenizer, tmp_path):
    save_release_layout(tiny, tmp_path / "one", tokenizer, NORM_STATS, max_shard_size="2MB")
    folder = save_release_layout(tiny, tmp_path / "one", tokenizer, NORM_STATS, max_shard_size="1GB")  # old shards go
    assert {p.name for p in folder.iterdir()} == RELEASE_FILES - {"model.safetensors.index.json"} | {
        "model.safetensors"
    }
    state = load_pretrained(folder).model.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in tiny.state_dict().items())


def test_a_smaller_input_side_is_saved_in_both_configs_and_loads(tokenizer, tmp_path):
    """Runtime tests use 56 px towers (4x4 patches): the preprocessor config must resize to what config.json says."""
    vla = build_vla(tiny_release_config(NORM_STATS, image_size=56), device="cpu").eval()
    folder = save_release_layout(vla, tmp_path / "56px", tokenizer, NORM_STATS)
    assert json.loads((folder / "config.json").read_text())["image_sizes"] == [56, 56]
    loaded = load_pretrained(folder)
    pixels = loaded.pixel_values(frame(3))
    assert pixels.shape[-2:] == (56, 56)
    with torch.inference_mode():
        assert torch.equal(vla(pixels, loaded.input_ids("lift")), loaded.model(pixels, loaded.input_ids("lift")))


def test_predict_action_deterministic_and_within_bounds(loaded):
    image = frame(2, 240, 320)
    first = loaded.predict_action(image, "open the drawer", BRIDGE)
    assert first.shape == (7,) and first.dtype == np.float64
    assert np.array_equal(first, loaded.predict_action(image, "open the drawer", BRIDGE))
    stats = NORM_STATS[BRIDGE]["action"]
    q01, q99 = np.array(stats["q01"]), np.array(stats["q99"])
    assert np.all((q01[:6] < first[:6]) & (first[:6] < q99[:6]))
    assert -1.0 < first[6] < 1.0  # unmasked: the bin centre itself
    other = loaded.predict_action(image, "open the drawer", "libero_spatial_no_noops")
    assert not np.array_equal(first[:6], other[:6])


def test_unnorm_key_errors(loaded):
    with pytest.raises(UnnormKeyError, match="'bridge' is not in .*Did you mean 'bridge_orig'"):
        loaded.predict_action(frame(), "open the drawer", "bridge")
    with pytest.raises(UnnormKeyError, match="holds statistics for 2 datasets; pass unnorm_key"):
        loaded.predict_action(frame(), "open the drawer")


def test_decoding_matches_uncached_greedy_and_appends_the_empty_token(loaded):
    model, pixels = loaded.model, loaded.pixel_values(frame(3))
    ids = loaded.input_ids("pick up the red block")
    assert int(ids[0, -1]) == EMPTY_TOKEN_ID and int(ids[0, 0]) == 1
    cached = model.generate_action_tokens(pixels, ids, 5)
    reference: List[int] = []
    with torch.inference_mode():
        for _ in range(5):  # the whole sequence again at every step: no KV cache
            sequence = torch.cat([ids, torch.tensor([reference], dtype=torch.long)], dim=1)
            reference.append(int(model(pixels, sequence)[0, -1].argmax()))
    assert cached == reference and len(set(cached)) > 1
    stats = loaded.norm_stats.select(BRIDGE).action
    assert np.array_equal(
        model.predict_action(pixels, ids[:, :-1], stats, loaded.bins),
        model.predict_action(pixels, ids, stats, loaded.bins),
    )
    assert last_window([1, 5, 29871], [31800, 2], 3) == [29871, 31800, 2]  # an early </s> reaches into the prompt


def test_patches_follow_bos_and_padding_is_masked(loaded):
    model, ids = loaded.model, loaded.input_ids("pick up the cup")
    a, b = loaded.pixel_values(frame(4)), loaded.pixel_values(frame(5))
    with torch.inference_mode():
        logits_a, logits_b = model(a, ids), model(b, ids)
        assert logits_a.shape == (1, 256 + ids.shape[1], 32064)
        assert torch.equal(logits_a[:, 0], logits_b[:, 0])  # <bos> comes first and sees no patch
        assert not torch.allclose(logits_a[:, 1], logits_b[:, 1])
        short = ids[:, :5]
        padded = torch.cat([short, torch.full((1, ids.shape[1] - 5), 32000)], dim=1)
        mask = (torch.arange(ids.shape[1]) < 5).long()[None]
        batch = model(torch.cat([a, a]), torch.cat([ids, padded]), torch.cat([torch.ones_like(mask), mask]))
        torch.testing.assert_close(batch[:1], logits_a, atol=1e-5, rtol=1e-5)
        # causal: the first 256 + 5 positions of the unpadded prompt see only what the padded one holds
        torch.testing.assert_close(batch[1:, : 256 + 5], logits_a[:, : 256 + 5], atol=1e-5, rtol=1e-5)


# --- strictness -----------------------------------------------------------------------------------------------


def mutate(release_dir: Path, tmp_path: Path, edit, index_edit=None) -> Path:
    """A copy of the release with the shard holding the embeddings rewritten by `edit` (and the index by
    `index_edit`)."""
    folder = Path(shutil.copytree(release_dir, tmp_path / "copy"))
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"]["language_model.model.norm.weight"]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), {"format": "pt"})
    if index_edit:
        index_edit(index["weight_map"], shard.name)
        index_path.write_text(json.dumps(index))
    return folder


NORM = "language_model.model.norm.weight"
EXTRA = "language_model.model.extra.weight"


def test_a_key_missing_from_its_shard_is_named(release_dir, tmp_path):
    folder = mutate(release_dir, tmp_path, lambda t: t.pop(NORM))
    with pytest.raises(ReleaseWeightsError, match=f"lists tensor.* that their shard does not hold: '{NORM} "):
        load_pretrained(folder)


def test_a_key_missing_everywhere_is_named(release_dir, tmp_path):
    folder = mutate(release_dir, tmp_path, lambda t: t.pop(NORM), lambda index, _: index.pop(NORM))
    with pytest.raises(ReleaseWeightsError, match=f"missing key\\(s\\) '{NORM}'"):
        load_pretrained(folder)


def test_an_extra_key_is_named(release_dir, tmp_path):
    def add(tensors):
        tensors[EXTRA] = torch.zeros(3)

    folder = mutate(release_dir, tmp_path, add, lambda index, shard: index.update({EXTRA: shard}))
    with pytest.raises(ReleaseWeightsError, match=f"unexpected key\\(s\\) '{EXTRA}'"):
        load_pretrained(folder)
    shutil.rmtree(folder)
    folder = mutate(release_dir, tmp_path, add)  # in the shard but not in the index
    with pytest.raises(ReleaseWeightsError, match=f"does not list tensor.* its shards hold: '{EXTRA}'"):
        load_pretrained(folder)


def test_a_wrong_shape_is_named(release_dir, tmp_path):
    folder = mutate(release_dir, tmp_path, lambda t: t.update({NORM: torch.ones(65)}))
    with pytest.raises(ReleaseWeightsError, match=f"wrong shape: '{NORM} \\[65\\] \\(model: \\[64\\]\\)'"):
        load_pretrained(folder)


def test_tokenizer_has_the_llama2_layout(tokenizer, loaded):
    ids = {t: tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<0x0A>", "▁", "<PAD>")}
    assert ids == {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 13, "▁": 29871, "<PAD>": 32000}
    assert tokenizer.get_vocab_size() == 32001
    assert loaded.tokenizer.encode("pick up").ids == tokenizer.encode("pick up").ids
    assert loaded.bins.first_token == 31744 and loaded.bins.last_token == 31999
