"""The OpenVLA / OFT release's action tokens, statistics, gripper rule, image preprocessing and prompts.

Expected values are computed by hand from the release's formulas (shared/facts/openvla-checkpoints.md).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

import numpy as np
import pytest
import torch
from PIL import Image

from vlaslurm.models.prismatic.actions import (
    OFT_UNNORM_EPS,
    ActionBins,
    NormStatsError,
    UnnormKeyError,
    libero_gripper_postprocess,
    libero_unnorm_key,
    load_norm_stats,
    norm_stats_from_config,
    normalize_proprio,
    normalize_proprio_torch,
    parse_norm_stats,
    read_dataset_statistics,
    unnormalize_actions,
    unnormalize_actions_torch,
)
from vlaslurm.models.prismatic.preprocess import (
    DINOV2,
    SIGLIP,
    ImageTransform,
    PreprocessorConfigError,
    append_empty_token,
    build_prompt,
    center_crop,
    oft_query_ids,
    prompt_token_ids,
    read_preprocessor_config,
)

BINS = ActionBins()
HALF_BIN = 1.0 / 255  # bins are 2/255 wide


def stats_entry(dim: int = 7, mask: list | None = None, q01: float = -2.0, q99: float = 2.0) -> dict:
    entry = {
        "mean": [0.0] * dim,
        "std": [1.0] * dim,
        "max": [3.0] * dim,
        "min": [-3.0] * dim,
        "q01": [q01] * dim,
        "q99": [q99] * dim,
    }
    if mask is not None:
        entry["mask"] = mask
    return entry


LIBERO_MASK = [True] * 6 + [False]
SPATIAL = {
    "action": stats_entry(mask=LIBERO_MASK),
    "proprio": stats_entry(dim=8, q01=0.0, q99=1.0),
    "num_transitions": 52970,
    "num_trajectories": 432,
}
RAW_STATS = {
    "libero_spatial_no_noops": SPATIAL,
    "libero_object_no_noops": {"action": stats_entry(mask=LIBERO_MASK), "num_transitions": 66984},
}


# --- bins ------------------------------------------------------------------------------------------------------


def test_bin_edges_and_centres():
    edges, centers = BINS.edges, BINS.centers
    assert edges.shape == (256,) and centers.shape == (255,)
    assert edges[0] == -1.0 and edges[-1] == 1.0
    assert edges[1] == pytest.approx(-1 + 2 / 255, abs=1e-15)
    assert centers[0] == pytest.approx(-1 + 1 / 255, abs=1e-15)  # -0.99608
    assert centers[127] == pytest.approx(0.0, abs=1e-15)
    assert centers[254] == pytest.approx(1 - 1 / 255, abs=1e-15)
    assert (BINS.first_token, BINS.last_token) == (31744, 31999)


def test_from_config_uses_the_unpadded_vocabulary():
    config = {"n_action_bins": 256, "pad_to_multiple_of": 64, "text_config": {"vocab_size": 32064}}
    bins = ActionBins.from_config(config)
    assert bins.vocab_size == 32000 and bins.first_token == 31744
    with pytest.raises(ValueError, match="text_config.vocab_size"):
        ActionBins.from_config({"n_action_bins": 256})


def test_encode_hand_values_and_clipping():
    actions = np.array([-1.0, -5.0, 1.0, 7.0, 0.0, -1 + 2 / 255 + 1e-9])
    # digitize: -1 -> 1 (31999); 1 -> 256 (31744); 0 lies in [edges[127], edges[128]) -> 128 (31872)
    assert BINS.encode(actions).tolist() == [31999, 31999, 31744, 31744, 31872, 31998]


def test_decode_token_ids_at_both_ends_and_outside():
    tokens = np.array([31999, 31998, 31745, 31744, 32063, 0])
    expected = [-1 + 1 / 255, -1 + 3 / 255, 1 - 1 / 255, 1 - 1 / 255, -1 + 1 / 255, 1 - 1 / 255]
    np.testing.assert_allclose(BINS.decode(tokens), expected, atol=1e-15)  # out-of-range ids are clipped


def test_round_trip_within_half_a_bin():
    actions = np.concatenate([np.linspace(-1, 1, 1001), [-1.0, 1.0, 0.3333, -0.77]]).reshape(5, -1)
    tokens = BINS.encode(actions)
    assert tokens.min() >= 31744 and tokens.max() <= 31999
    assert np.abs(BINS.decode(tokens) - actions).max() <= HALF_BIN + 1e-12


def test_torch_paths_equal_numpy():
    actions = np.linspace(-1.2, 1.2, 97).reshape(-1, 1)
    tokens = BINS.encode_torch(torch.from_numpy(actions).float())
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, torch.from_numpy(BINS.encode(actions.astype(np.float32))))
    ids = np.arange(31700, 32064)
    assert np.array_equal(BINS.decode_torch(torch.from_numpy(ids)).numpy(), BINS.decode(ids))


# --- statistics and (un)normalisation -------------------------------------------------------------------------


def test_unnormalize_with_mask_leaves_gripper_untouched():
    stats = parse_norm_stats(RAW_STATS, "stats").select("libero_spatial_no_noops").action
    normalized = np.array([-1.0, 1.0, 0.0, 0.5, -0.5, 0.25, 0.8])
    actions = unnormalize_actions(normalized, stats)
    # 0.5 (a + 1) (2 - (-2)) - 2 = 2 a on the six masked dimensions; the gripper stays 0.8
    np.testing.assert_allclose(actions, [-2.0, 2.0, 0.0, 1.0, -1.0, 0.5, 0.8], atol=1e-15)
    oft = unnormalize_actions(normalized, stats, eps=OFT_UNNORM_EPS)
    assert oft[1] == pytest.approx(2.0 + 1e-8, abs=1e-15) and oft[6] == 0.8
    torch_actions = unnormalize_actions_torch(torch.from_numpy(normalized), stats)
    np.testing.assert_array_equal(torch_actions.numpy(), actions)


def test_missing_mask_is_all_true_and_bounds_uses_min_max():
    stats = parse_norm_stats({"only": {"action": stats_entry(dim=2)}}, "s").select().action
    assert stats.mask.tolist() == [True, True]
    assert unnormalize_actions(np.array([1.0, -1.0]), stats).tolist() == [2.0, -2.0]
    assert unnormalize_actions(np.array([1.0, -1.0]), stats, normalization="bounds").tolist() == [3.0, -3.0]
    with pytest.raises(ValueError, match="2 dimensions"):
        unnormalize_actions(np.zeros(7), stats)


def test_unnorm_key_selection_and_errors():
    stats = parse_norm_stats(RAW_STATS, "dataset_statistics.json")
    with pytest.raises(UnnormKeyError, match="holds statistics for 2 datasets.*libero_spatial_no_noops"):
        stats.select(None)
    with pytest.raises(UnnormKeyError, match="Did you mean 'libero_object_no_noops'"):
        stats.select("libero_objct_no_noops")
    assert issubclass(UnnormKeyError, ValueError)
    assert stats.action_dim("libero_object_no_noops") == 7
    assert libero_unnorm_key(stats, "libero_spatial") == "libero_spatial_no_noops"
    with pytest.raises(UnnormKeyError, match="Valid keys"):
        libero_unnorm_key(stats, "libero_goal")
    single = parse_norm_stats({"bridge_orig": {"action": stats_entry()}}, "config.json")
    assert single.resolve_key(None) == "bridge_orig"


def test_proprio_normalisation_is_clipped():
    proprio = parse_norm_stats(RAW_STATS, "s").select("libero_spatial_no_noops").proprio
    assert proprio is not None and proprio.dim == 8
    state = np.array([0.0, 1.0, 0.5, 0.75, -3.0, 4.0, 0.25, 1.0 + 1e-9])
    # 2 (x - 0) / (1 + 1e-8) - 1, then clip to [-1, 1]
    expected = np.clip(2 * state / (1 + 1e-8) - 1, -1, 1)
    np.testing.assert_allclose(normalize_proprio(state, proprio), expected, atol=1e-15)
    assert normalize_proprio(state, proprio)[[4, 5]].tolist() == [-1.0, 1.0]
    # the batched torch path (the RL policies') equals it, in float32
    batched = normalize_proprio_torch(torch.from_numpy(np.stack([state, state])), proprio)
    np.testing.assert_allclose(batched.numpy(), np.stack([expected, expected]), rtol=1e-6, atol=1e-7)


def test_malformed_statistics_name_the_field(tmp_path):
    bad = {"ds": {"action": {**stats_entry(dim=3), "q99": [1.0, 2.0]}}}
    with pytest.raises(NormStatsError, match=r"ds\.action\.q99 has 2 values but q01 has 3"):
        parse_norm_stats(bad, "f.json")
    with pytest.raises(NormStatsError, match=r"ds\.action lacks std"):
        parse_norm_stats({"ds": {"action": {k: v for k, v in stats_entry().items() if k != "std"}}}, "f.json")
    with pytest.raises(NormStatsError, match="mask must be a list of true/false"):
        parse_norm_stats({"ds": {"action": stats_entry(dim=2, mask=[1, 0])}}, "f.json")
    with pytest.raises(NormStatsError, match="has no norm_stats"):
        norm_stats_from_config({"model_type": "openvla"})


def test_readers_prefer_dataset_statistics(tmp_path):
    config = {"norm_stats": {"from_config": {"action": stats_entry()}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert list(load_norm_stats(tmp_path).datasets) == ["from_config"]
    (tmp_path / "dataset_statistics.json").write_text(json.dumps(RAW_STATS))
    loaded = load_norm_stats(tmp_path)
    assert list(loaded.datasets) == list(RAW_STATS)
    spatial = read_dataset_statistics(tmp_path / "dataset_statistics.json").datasets["libero_spatial_no_noops"]
    assert (spatial.num_transitions, spatial.num_trajectories) == (52970, 432)


# --- LIBERO gripper -------------------------------------------------------------------------------------------


def test_libero_gripper_postprocess():
    chunk = np.array(
        [
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9],
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.1],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
        ]
    )
    out = libero_gripper_postprocess(chunk)
    # -sign(2 g - 1): open (g > 0.5) -> -1, close -> +1, exactly 0.5 -> 0
    assert out[:, -1].tolist() == [-1.0, 1.0, -1.0, 0.0]
    np.testing.assert_array_equal(out[:, :6], chunk[:, :6])
    assert chunk[0, -1] == 0.9  # the input is not modified


# --- images ---------------------------------------------------------------------------------------------------


def constant_image(rgb: tuple, width: int = 100, height: int = 60) -> Image.Image:
    return Image.fromarray(np.tile(np.array(rgb, dtype=np.uint8), (height, width, 1)))


def test_constant_colour_image_normalised_per_tower():
    pixels = ImageTransform()(constant_image((255, 0, 128)))
    assert pixels.shape == (6, 224, 224) and pixels.dtype == torch.float32
    # DINOv2: (v / 255 - mean) / std; SigLIP: (v / 255 - 0.5) / 0.5
    expected = [(1 - 0.485) / 0.229, (0 - 0.456) / 0.224, (128 / 255 - 0.406) / 0.225, 1.0, -1.0, 1 / 255]
    for channel, value in enumerate(expected):
        assert torch.all(pixels[channel] == pixels[channel, 0, 0])
        assert pixels[channel, 0, 0].item() == pytest.approx(value, abs=1e-6)


def test_resize_is_naive_pil_bicubic():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (50, 90, 3), dtype=np.uint8))
    expected = np.asarray(image.resize((224, 224), Image.Resampling.BICUBIC), dtype=np.float32) / 255
    siglip = SIGLIP(image).numpy().transpose(1, 2, 0)
    np.testing.assert_allclose(siglip, (expected - 0.5) / 0.5, atol=1e-6)
    assert DINOV2.size == 224


def test_cameras_stack_on_channels():
    transform = ImageTransform()
    third, wrist = constant_image((10, 20, 30)), constant_image((200, 100, 0), 256, 256)
    stacked = transform.cameras([third, wrist])
    assert stacked.shape == (12, 224, 224)
    assert torch.equal(stacked[6:], transform(wrist))
    assert transform.pixel_values([third, wrist]).shape == (2, 6, 224, 224)


def test_center_crop_geometry():
    # column value = column index; kept side sqrt(0.9), corner-aligned: column x samples 5.7218 + 0.94868 x,
    # and uint8 = trunc(v / 255 * 255.5)
    ramp = np.tile(np.arange(224, dtype=np.uint8)[None, :, None], (224, 1, 3))
    cropped = np.asarray(center_crop(Image.fromarray(ramp)))
    assert cropped.shape == (224, 224, 3)
    assert cropped[0, :3, 0].tolist() == [5, 6, 7] and cropped[0, -1, 0] == 217
    assert np.array_equal(cropped[0], cropped[-1])
    flat = np.asarray(center_crop(constant_image((77, 0, 255), 64, 48)))
    assert flat.shape == (224, 224, 3) and np.all(flat == [77, 0, 255])


def test_preprocessor_config(tmp_path):
    raw = {
        "image_resize_strategy": "resize-naive",
        "input_sizes": [[3, 224, 224], [3, 224, 224]],
        "interpolations": ["bicubic", "bicubic"],
        "tvf_resize_params": [{"size": [224, 224], "interpolation": 3, "max_size": None, "antialias": True}] * 2,
        "tvf_normalize_params": [
            {
                "mean": [0.48500001430511475, 0.4560000002384186, 0.4059999883174896],
                "std": [0.2290000021457672, 0.2240000069141388, 0.22499999403953552],
            },
            {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
        ],
    }
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(raw))
    transform = read_preprocessor_config(path)
    image = constant_image((255, 0, 128))
    assert torch.equal(transform(image), ImageTransform()(image))  # float32 means: the same values
    with pytest.raises(PreprocessorConfigError, match="'letterbox'; only resize-naive"):
        ImageTransform.from_preprocessor_config({**raw, "image_resize_strategy": "letterbox"})


# --- prompts --------------------------------------------------------------------------------------------------


def test_prompt_string():
    assert build_prompt("Pick up the black bowl and place it on the plate") == (
        "In: What action should the robot take to pick up the black bowl and place it on the plate?\nOut:"
    )
    assert build_prompt("Open", "openvla-v01").endswith(" USER: What action should the robot take to open? ASSISTANT:")


def tiny_tokenizer(with_bos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "In: What action should the robot take to pick up cup? Out:".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 100 + i for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if with_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def test_prompt_token_ids_append_the_empty_token():
    from transformers import PreTrainedTokenizerFast

    # "In: What action should the robot take to pick up the cup?\nOut:" word by word; "the" is 104 twice
    expected = [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 104, 110, 111, 29871]
    bare, with_bos = tiny_tokenizer(False), tiny_tokenizer(True)
    assert prompt_token_ids(bare, "Pick up the cup") == expected  # <bos> prepended when the tokenizer has none
    assert prompt_token_ids(with_bos, "Pick up the cup") == expected
    assert prompt_token_ids(PreTrainedTokenizerFast(tokenizer_object=with_bos), "PICK UP THE CUP") == expected
    assert append_empty_token([1, 5, 29871]) == [1, 5, 29871]


def test_oft_query_ids():
    ids, num_prompt_tokens = oft_query_ids([1, 10, 11])
    assert ids == [1, 10, 11, 29871] + [1] * 56 + [2]
    assert num_prompt_tokens == 3
