"""OpenVLA-OFT: the heads' names and full-size counts on `meta`, a tiny OFT release folder that loads strictly and
decodes a chunk in one bidirectional pass, and the head files' errors.

Expected counts, keys and the sequence layout are the facts sheet's (/work/shared/facts/openvla-checkpoints.md §1,
§3 OFT, §7), measured there on `meta` from moojink/openvla-oft's own code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlaslurm.models.prismatic.actions import ActionBins
from vlaslurm.models.prismatic.oft import (
    L1RegressionActionHead,
    OFTHeadError,
    OFTShape,
    ProprioProjector,
    ReleasedOpenVLAOFT,
    action_token_log_prob,
    bidirectional_hidden_states,
    head_file_name,
    load_oft,
    oft_embeddings,
    read_component_state,
    sample_action_tokens,
    save_oft_heads,
)
from vlaslurm.models.prismatic.release import (
    build_vla,
    llama_layout_tokenizer,
    save_release_layout,
    tiny_release_config,
)
from vlaslurm.models.prismatic.vla import PrismaticVLA

torch.set_num_threads(2)

LIBERO = "libero_spatial_no_noops"


def stats(dim: int, low: float, high: float, gripper_masked: bool) -> Dict[str, object]:
    return {
        "mean": [0.0] * dim,
        "std": [1.0] * dim,
        "min": [low - 1.0] * dim,
        "max": [high + 1.0] * dim,
        "q01": [low + 0.1 * i for i in range(dim)],
        "q99": [high + 0.2 * i for i in range(dim)],
        "mask": [True] * (dim - 1) + [not gripper_masked],
    }


NORM_STATS = {
    LIBERO: {
        "action": stats(7, -0.5, 0.5, gripper_masked=True),
        "proprio": stats(8, -1.0, 2.0, gripper_masked=False),
        "num_transitions": 100,
        "num_trajectories": 4,
    }
}
L1_KEYS = {
    "model.layer_norm1.weight": (7 * 4096,),
    "model.layer_norm1.bias": (7 * 4096,),
    "model.fc1.weight": (4096, 7 * 4096),
    "model.fc1.bias": (4096,),
    **{f"model.mlp_resnet_blocks.{i}.ffn.0.{p}": (4096,) for i in (0, 1) for p in ("weight", "bias")},
    **{f"model.mlp_resnet_blocks.{i}.ffn.1.weight": (4096, 4096) for i in (0, 1)},
    **{f"model.mlp_resnet_blocks.{i}.ffn.1.bias": (4096,) for i in (0, 1)},
    "model.layer_norm2.weight": (4096,),
    "model.layer_norm2.bias": (4096,),
    "model.fc2.weight": (7, 4096),
    "model.fc2.bias": (7,),
}
PROPRIO_KEYS = {"fc1.weight": (4096, 8), "fc1.bias": (4096,), "fc2.weight": (4096, 4096), "fc2.bias": (4096,)}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- full size, on meta ---------------------------------------------------------------------------------------


def test_full_size_counts_and_keys_on_meta():
    with torch.device("meta"):
        libero_head, aloha_head = L1RegressionActionHead(4096, 7), L1RegressionActionHead(4096, 14)
        libero, aloha, bridge = ProprioProjector(4096, 8), ProprioProjector(4096, 14), ProprioProjector(4096, 7)
    assert count(libero_head) == 151_117_831 and count(aloha_head) == 268_644_366
    assert (count(libero), count(aloha), count(bridge)) == (16_818_176, 16_842_752, 16_814_080)
    assert {k: tuple(t.shape) for k, t in libero_head.state_dict().items()} == L1_KEYS
    assert {k: tuple(t.shape) for k, t in libero.state_dict().items()} == PROPRIO_KEYS


# --- the heads against hand-written maths ---------------------------------------------------------------------


def randomise(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # LayerNorms too, so a wrong weight/bias order would show
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
    return module


def test_l1_head_matches_a_reference_computation():
    torch.manual_seed(0)
    width, action_dim, chunk = 16, 3, 4
    head = randomise(L1RegressionActionHead(width, action_dim))
    hidden = torch.randn(2, chunk * action_dim, width)
    p = head.state_dict()

    def layer_norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"], eps=1e-5)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    # action t reads slots t * action_dim .. t * action_dim + action_dim - 1, concatenated in order
    x = torch.stack(
        [torch.cat([hidden[:, t * action_dim + d] for d in range(action_dim)], -1) for t in range(chunk)], 1
    )
    x = torch.relu(linear(layer_norm(x, "model.layer_norm1"), "model.fc1"))
    for i in (0, 1):
        x = x + torch.relu(
            linear(layer_norm(x, f"model.mlp_resnet_blocks.{i}.ffn.0"), f"model.mlp_resnet_blocks.{i}.ffn.1")
        )
    expected = linear(layer_norm(x, "model.layer_norm2"), "model.fc2")
    torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5)
    assert head.model.layer_norm1.eps == 1e-5  # torch's default; the facts sheet lists 1e-6 as a trap

    projector = randomise(ProprioProjector(width, 8))
    state = torch.randn(2, 8)
    q = projector.state_dict()
    reference = F.gelu(state @ q["fc1.weight"].T + q["fc1.bias"], approximate="none") @ q["fc2.weight"].T
    torch.testing.assert_close(projector(state), (reference + q["fc2.bias"])[:, None], rtol=1e-5, atol=1e-5)


# --- a tiny OFT release folder --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> PrismaticVLA:
    torch.manual_seed(0)
    vla = build_vla(tiny_release_config(NORM_STATS), device="cpu").eval()
    with torch.no_grad():  # only action ids can win the argmax, so the discrete decode visits many bins
        head = vla.language_model.lm_head.weight
        head[:31744] = 0
        head[32000:] = 0
    return vla


@pytest.fixture(scope="module")
def heads(tiny):
    torch.manual_seed(1)
    width = tiny.language_model.config.hidden_size
    return randomise(L1RegressionActionHead(width, 7)).eval(), randomise(ProprioProjector(width, 8)).eval()


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory, tiny, heads) -> Path:
    folder = tmp_path_factory.mktemp("tiny oft release")  # a space on purpose
    save_release_layout(tiny, folder, llama_layout_tokenizer(), NORM_STATS)
    save_oft_heads(folder, *heads)
    return folder


@pytest.fixture(scope="module")
def loaded(release_dir) -> ReleasedOpenVLAOFT:
    return load_oft(release_dir)


def frames(seed: int = 0) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8), rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)]


PROPRIO = np.array([0.1, -0.2, 0.3, 0.0, 1.5, -0.7, 0.02, -0.02])


def test_head_files_are_stored_as_the_release(release_dir, heads):
    names = {p.name for p in release_dir.iterdir() if "checkpoint" in p.name}
    assert names == {"action_head--latest_checkpoint.pt", "proprio_projector--latest_checkpoint.pt"}
    assert head_file_name("action_head", 150000) == "action_head--150000_checkpoint.pt"
    raw = torch.load(release_dir / "action_head--latest_checkpoint.pt", weights_only=True)
    assert set(raw) == {"module." + k for k in L1_KEYS} and all(t.dtype == torch.bfloat16 for t in raw.values())
    raw = torch.load(release_dir / "proprio_projector--latest_checkpoint.pt", weights_only=True)
    assert set(raw) == {"module." + k for k in PROPRIO_KEYS} and all(t.dtype == torch.float32 for t in raw.values())
    assert set(read_component_state(release_dir / "proprio_projector--latest_checkpoint.pt")) == set(PROPRIO_KEYS)


def test_loads_strictly(loaded, tiny, heads):
    state = loaded.model.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in tiny.state_dict().items())
    head, projector = heads
    assert loaded.action_head is not None and loaded.proprio_projector is not None
    for key, tensor in head.state_dict().items():  # stored in bf16, loaded back in the model's float32
        assert torch.equal(loaded.action_head.state_dict()[key], tensor.to(torch.bfloat16).float()), key
    assert all(torch.equal(loaded.proprio_projector.state_dict()[k], t) for k, t in projector.state_dict().items())
    assert loaded.shape == OFTShape(8, 7, 8)


def test_loads_in_bfloat16(release_dir):
    policy = load_oft(release_dir, dtype=torch.bfloat16)
    assert policy.model.dtype == torch.bfloat16 and policy.action_head.model.fc1.weight.dtype == torch.bfloat16
    assert policy.proprio_projector.fc1.weight.dtype == torch.bfloat16  # stored fp32, run in the model's dtype
    chunk = policy.predict_action(frames(), "open the drawer", proprio=PROPRIO)
    assert chunk.shape == (8, 7) and np.isfinite(chunk).all()


@pytest.mark.parametrize("head", ["l1", "discrete"])
def test_predict_action_is_a_deterministic_chunk(loaded, head):
    images = frames()
    first = loaded.predict_action(images, "put the bowl on the plate", proprio=PROPRIO, head=head)
    assert first.shape == (8, 7) and first.dtype == np.float64
    assert np.array_equal(first, loaded.predict_action(images, "put the bowl on the plate", proprio=PROPRIO, head=head))


def test_the_l1_chunk_reads_proprio_and_the_wrist_camera(loaded):
    # (A random tiny LLM gives the zeroed slots nearly equal states, so the discrete argmax rarely moves; the L1
    # head, whose first action also reads the last prompt token's state, shows the inputs are used.)
    images, instruction = frames(), "put the bowl on the plate"
    first = loaded.predict_action(images, instruction, proprio=PROPRIO)
    assert len(np.unique(first[:, 0])) > 1
    assert not np.array_equal(first, loaded.predict_action(images, instruction, proprio=PROPRIO + 0.5))
    assert not np.array_equal(first, loaded.predict_action(images[:1] + frames(1)[1:], instruction, proprio=PROPRIO))
    assert not np.array_equal(first, loaded.predict_action(images, instruction))  # no proprio token at all


def test_l1_actions_are_the_head_on_the_shifted_slots_unnormalised(loaded):
    images, instruction = frames(2), "open the drawer"
    hidden = loaded.hidden_states(images, instruction, LIBERO, PROPRIO)
    assert hidden.shape == (1, 56, 64)
    with torch.inference_mode():
        normed = loaded.action_head(hidden)[0].numpy().astype(np.float64)
    action = NORM_STATS[LIBERO]["action"]
    low, high = np.array(action["q01"]), np.array(action["q99"])
    expected = np.where(action["mask"], 0.5 * (normed + 1) * (high - low + 1e-8) + low, normed)
    np.testing.assert_array_equal(loaded.predict_action(images, instruction, LIBERO, PROPRIO), expected)


def test_sequence_layout_and_zeroed_placeholders(loaded):
    ids, num_prompt_tokens = loaded.query_ids("pick up the cup")
    pixels, features = loaded.pixel_values(frames()), loaded.proprio_features(PROPRIO, LIBERO)
    assert pixels.shape == (1, 12, 224, 224) and features.shape == (1, 1, 64)
    assert ids[0, num_prompt_tokens] == 29871 and ids[0, -1] == 2 and ids.shape[1] == num_prompt_tokens + 1 + 56 + 1
    with torch.inference_mode():
        embeddings, num_patches = oft_embeddings(loaded.model, pixels, ids, 56, features)
        embed = loaded.model.language_model.get_input_embeddings()
        assert num_patches == 2 * 256 + 1 and embeddings.shape[1] == 1 + num_patches + ids.shape[1] - 1
        assert torch.equal(embeddings[0, 0], embed.weight[1])  # <bos> first, then the patches
        assert torch.equal(embeddings[0, num_patches], features[0, 0])  # the proprio token closes the prefix
        start = num_patches + num_prompt_tokens
        assert torch.equal(embeddings[0, start], embed.weight[29871])  # the first sliced state: the last prompt id
        assert torch.count_nonzero(embeddings[0, start + 1 : start + 57]) == 0  # the 56 placeholders
        assert torch.equal(embeddings[0, -1], embed.weight[2])  # </s> keeps its embedding


def test_attention_is_bidirectional_with_only_pad_keys_masked(loaded):
    model = loaded.model
    ids, _ = loaded.query_ids("pick up the cup")
    with torch.inference_mode():
        embeddings, _ = oft_embeddings(model, loaded.pixel_values(frames()), ids, 56)
        later = embeddings.clone()
        later[0, -1] += 1.0  # only the last token changes
        hidden, changed = bidirectional_hidden_states(model, embeddings), bidirectional_hidden_states(model, later)
        assert not torch.allclose(hidden[0, 0], changed[0, 0])  # causal attention would forbid this
        causal = [
            model.language_model.model(inputs_embeds=e, use_cache=False).last_hidden_state for e in (embeddings, later)
        ]
        assert torch.equal(causal[0][0, 0], causal[1][0, 0])  # the stock model is causal
        padded = torch.cat([embeddings, torch.randn(1, 5, embeddings.shape[2])], dim=1)
        keys = torch.cat([torch.ones(1, embeddings.shape[1]), torch.zeros(1, 5)], dim=1).long()
        both = bidirectional_hidden_states(model, torch.cat([padded, padded]), torch.cat([torch.ones_like(keys), keys]))
        torch.testing.assert_close(both[1, : embeddings.shape[1]], hidden[0], rtol=1e-5, atol=1e-5)  # pads unseen
        assert not torch.allclose(both[0, : embeddings.shape[1]], hidden[0])  # unmasked, the pads would be seen


def test_discrete_sampling_has_the_stated_log_prob(loaded):
    bins = ActionBins()
    logits = torch.randn(3, 32064)
    generator = torch.Generator().manual_seed(0)
    tokens, log_prob = sample_action_tokens(logits, bins, 0.7, generator)
    assert bool(((tokens >= 31744) & (tokens <= 31999)).all())
    expected = torch.log_softmax(logits[:, 31744:32000] / 0.7, dim=-1)[torch.arange(3), tokens - 31744]
    torch.testing.assert_close(log_prob, expected)
    torch.testing.assert_close(action_token_log_prob(logits, tokens, bins, 0.7), expected)
    again = sample_action_tokens(logits, bins, 0.7, torch.Generator().manual_seed(0))[0]
    assert torch.equal(tokens, again)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample_action_tokens(logits, bins, 0.0)

    images, instruction = frames(3), "push the red block"
    greedy = loaded.decode_discrete(images, instruction, proprio=PROPRIO)
    assert greedy.log_prob is None and greedy.token_ids.shape == (8, 7)
    with torch.inference_mode():  # the argmax of lm_head at the 56 slots, in slot order, de-tokenised
        logits = loaded.model.language_model.lm_head(loaded.hidden_states(images, instruction, LIBERO, PROPRIO))
    assert torch.equal(greedy.token_ids.reshape(-1), logits[0].argmax(-1))
    action = NORM_STATS[LIBERO]["action"]
    low, high = np.array(action["q01"]), np.array(action["q99"])
    normed = bins.decode(greedy.token_ids.numpy())
    expected = np.where(action["mask"], 0.5 * (normed + 1) * (high - low + 1e-8) + low, normed)
    np.testing.assert_array_equal(greedy.actions, expected)
    np.testing.assert_array_equal(
        greedy.actions, loaded.predict_action(images, instruction, proprio=PROPRIO, head="discrete")
    )
    seeded = {"proprio": PROPRIO, "generator": torch.Generator().manual_seed(1)}
    sampled = loaded.decode_discrete(images, instruction, temperature=1.0, **seeded)
    assert sampled.log_prob is not None and sampled.log_prob.shape == (8, 7) and bool((sampled.log_prob < 0).all())
    cold = loaded.decode_discrete(images, instruction, proprio=PROPRIO, temperature=1e-4)
    assert torch.equal(cold.token_ids, greedy.token_ids)  # T -> 0 is the argmax (only action ids can win here)


# --- errors ---------------------------------------------------------------------------------------------------


@pytest.fixture
def config_only(release_dir, tmp_path) -> Path:
    """A folder with the release's config.json and no weights: head errors come before the VLA is loaded."""
    folder = tmp_path / "heads only"
    folder.mkdir()
    (folder / "config.json").write_text((release_dir / "config.json").read_text())
    return folder


def test_a_shape_mismatch_names_the_argument_to_set(release_dir, config_only, heads):
    expected = r"has action_dim 7 but load_oft got action_dim=14; pass action_dim=7 \(libero's constants: chunk=8"
    with pytest.raises(OFTHeadError, match=expected):
        load_oft(release_dir, chunk=25, action_dim=14, proprio_dim=14)
    with pytest.raises(OFTHeadError, match="has proprio_dim 8 but load_oft got proprio_dim=7; pass proprio_dim=8"):
        load_oft(release_dir, proprio_dim=7)
    with pytest.raises(ValueError, match="chunk must be a positive integer, got 0"):
        load_oft(release_dir, chunk=0)
    save_oft_heads(config_only, L1RegressionActionHead(32, 7))
    with pytest.raises(OFTHeadError, match="trained on a 32-wide LLM but the release's text_config has hidden_size 64"):
        load_oft(config_only)


def test_head_file_errors(config_only, heads):
    with pytest.raises(OFTHeadError, match="plain OpenVLA release; load it with release.load_pretrained"):
        load_oft(config_only)
    save_oft_heads(config_only, heads[0], step=100)
    save_oft_heads(config_only, heads[0], step="latest")
    both = "action_head--100_checkpoint.pt, action_head--latest_checkpoint.pt"
    with pytest.raises(OFTHeadError, match=f"holds 2 action_head checkpoints \\({both}\\); keep exactly one"):
        load_oft(config_only)
    (config_only / "action_head--100_checkpoint.pt").unlink()
    path = config_only / "action_head--latest_checkpoint.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "module.model.extra": torch.zeros(1)}, path)
    with pytest.raises(OFTHeadError, match=r"unexpected \['model.extra'\]"):
        load_oft(config_only)
    torch.save({"weights": Opaque()}, path)  # an arbitrary object: torch.load(weights_only=True) refuses it
    with pytest.raises(OFTHeadError, match="not a state dict of tensors"):
        load_oft(config_only)
    path.unlink()
    torch.save({}, config_only / "noisy_action_projector--latest_checkpoint.pt")
    with pytest.raises(OFTHeadError, match="uses a diffusion action head, which load_oft does not implement"):
        load_oft(config_only)


class Opaque:
    """Not a tensor: a pickle holding it must not be unpickled."""


def test_predict_action_errors(loaded):
    with pytest.raises(ValueError, match="head must be one of l1, discrete"):
        loaded.predict_action(frames(), "open the drawer", head="diffusion")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="proprio must have proprio_dim=8 values, got 7"):
        loaded.predict_action(frames(), "open the drawer", proprio=PROPRIO[:7])
    with pytest.raises(ValueError, match="images must be a non-empty list"):
        loaded.predict_action([], "open the drawer")
    # one frame alone is the primary camera, as a list of one
    one = loaded.predict_action(frames()[0], "open the drawer", proprio=PROPRIO)
    np.testing.assert_array_equal(one, loaded.predict_action(frames()[:1], "open the drawer", proprio=PROPRIO))
