"""Tiny random-init configurations of the released-VLA policies (vlaslurm/models/vla/tiny.py): shapes, act and
evaluate agreeing, batch independence, seeding, the hashed tokenizer's ids."""

from __future__ import annotations

import zlib

import pytest
import torch

from vlaslurm.models.base import PolicyInput
from vlaslurm.models.prismatic.preprocess import EMPTY_TOKEN_ID, prompt_token_ids
from vlaslurm.models.vla.oft import OFTChunkPolicy
from vlaslurm.models.vla.openvla import OpenVLATokenPolicy
from vlaslurm.models.vla.tiny import (
    FIRST_ACTION_ID,
    FIRST_WORD_ID,
    RESERVED_IDS,
    HashedTextEncoder,
    StemImages,
    StemVLA,
    build_tiny,
    template_skips,
)
from vlaslurm.spec.model_types import BackboneConfig

INSTRUCTIONS = ["move to the red square", "pick up the black bowl and put it in the drawer", "go"]
BACKBONE = BackboneConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
CHUNK, ACTION_DIM, STATE_DIM = 2, 3, 2
CASES = [(kind, vision) for kind in ("openvla", "openvla-oft") for vision in ("film-stem", "dinosiglip")]


def cameras(vision: str) -> int:
    return 2 if vision == "film-stem" else 1  # the towers read 224 px frames: one camera keeps the test fast


def tiny(kind: str, vision: str = "film-stem", seed: int = 0, **kwargs) -> torch.nn.Module:
    return build_tiny(
        kind,  # type: ignore[arg-type]
        BACKBONE,
        action_chunk=CHUNK,
        action_dim=ACTION_DIM,
        state_dim=STATE_DIM if kind == "openvla-oft" else 0,
        image_size=32,
        num_cameras=cameras(vision),
        seed=seed,
        vision=vision,  # type: ignore[arg-type]
        **kwargs,
    ).eval()


def inputs(batch: int = 3, seeds: bool = True, num_cameras: int = 2) -> PolicyInput:
    gen = torch.Generator().manual_seed(0)
    return PolicyInput(
        images=torch.randint(0, 256, (batch, num_cameras, 32, 32, 3), generator=gen, dtype=torch.uint8),
        state=torch.rand(batch, STATE_DIM, generator=gen),
        instructions=INSTRUCTIONS[:batch],
        seeds=torch.arange(batch) + 7 if seeds else None,
    )


def row(inp: PolicyInput, i: int) -> PolicyInput:
    assert inp.images is not None and inp.state is not None and inp.seeds is not None
    pick = slice(i, i + 1)
    return PolicyInput(inp.images[pick], inp.state[pick], inp.instructions[pick], inp.seeds[pick])


def test_hashed_words_avoid_the_layouts_fixed_ids():
    encoder = HashedTextEncoder()
    words = [f"w{i}" for i in range(40_000)] + ["In:", "What", "▁", "<s>", "Out:", "square?"]
    ids = {encoder.word_id(w) for w in words}
    assert min(ids) >= FIRST_WORD_ID == 259  # <unk> 0, <s> 1, </s> 2, bytes 3..258
    assert max(ids) < FIRST_ACTION_ID == 31744  # the action ids 31744..31999, <PAD> 32000 and the padding rows
    assert EMPTY_TOKEN_ID not in ids and not ids & RESERVED_IDS
    assert len(ids) > 22_000  # the whole free range is used: 40k draws of 31484 ids leave ~22.6k distinct
    # stable across processes (crc32, not Python's salted hash), case-insensitive
    assert encoder.word_id("Red") == encoder.word_id("red") == FIRST_WORD_ID + zlib.crc32(b"red") % 31484
    assert encoder.encode("move to the red square") == [1] + [
        encoder.word_id(w) for w in "move to the red square".split()
    ]
    prompt = prompt_token_ids(encoder, "Move to the red square")  # the release's template, '▁' appended
    assert prompt[0] == 1 and prompt[-1] == EMPTY_TOKEN_ID and encoder.word_id("what") in prompt


def test_film_reads_the_instruction_words_of_the_prompt():
    encoder = HashedTextEncoder()
    head, tail = template_skips(encoder)
    assert (head, tail) == (9, 2)  # <bos> In: What action should the robot take to | ... | Out: ▁
    for instruction in ("Move to the red square", "go"):
        ids = prompt_token_ids(encoder, instruction)
        assert ids[head : len(ids) - tail] == encoder.encode(instruction.lower() + "?")[1:]


def test_the_module_tree_and_the_llm_are_the_releases_layout():
    policy = tiny("openvla-oft")
    vla = policy.vla
    assert isinstance(vla, StemVLA) and isinstance(policy, OFTChunkPolicy)
    assert {name for name, _ in vla.named_children()} == {"vision_backbone", "projector", "language_model"}
    config = policy.llm.config
    assert (config.vocab_size, config.pad_token_id, config.hidden_size) == (32064, 32000, 32)
    assert config._attn_implementation == "sdpa"
    assert policy.proprio_projector is not None and policy.proprio_stats is None  # proprio read raw
    assert policy.images == StemImages(9, 2)  # FiLM reads the instruction's words (the default)
    assert isinstance(tiny("openvla"), OpenVLATokenPolicy)


@pytest.mark.parametrize("kind, vision", CASES)
def test_act_and_evaluate_agree_and_rows_ignore_the_batch(kind, vision):
    policy = tiny(kind, vision)
    inp = inputs(num_cameras=cameras(vision))
    out = policy.act(inp)
    assert out.actions.shape == (3, CHUNK, ACTION_DIM) and out.logprob.shape == (3, CHUNK)
    assert out.token_logprob.shape == (3, CHUNK, ACTION_DIM) and out.value.shape == (3,)
    assert out.slot_value.shape == (3, CHUNK)
    again = policy.evaluate(inp, out.actions)
    torch.testing.assert_close(again.logprob, out.logprob, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again.value, out.value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.slot_value, out.slot_value, atol=1e-5, rtol=1e-5)
    assert again.entropy.shape == (3, CHUNK)
    alone = policy.act(row(inp, 1))  # its own seed, no batch-mates, less left padding: the same sample
    torch.testing.assert_close(alone.actions, out.actions[1:2], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(alone.logprob, out.logprob[1:2], atol=1e-4, rtol=1e-4)
    assert torch.equal(policy.act(inp).actions, out.actions)  # seeded rows: reproducible


def test_oft_discrete_head_over_the_tiny_llm():
    policy = tiny("openvla-oft", head="discrete", temperature=1.5)
    inp = inputs()
    out = policy.act(inp)
    cat = policy.categorical
    assert torch.equal(cat.values(cat.index(out.actions)), out.actions)
    torch.testing.assert_close(policy.evaluate(inp, out.actions).logprob, out.logprob, atol=1e-4, rtol=1e-4)


def test_seed_decides_the_weights_and_leaves_the_callers_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = tiny("openvla-oft", seed=5)
    assert torch.equal(torch.rand(3), expected)
    b, c = tiny("openvla-oft", seed=5), tiny("openvla-oft", seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_the_stem_policy_reads_instruction_state_and_trains_end_to_end():
    policy = tiny("openvla-oft")
    inp = inputs(2, seeds=False)
    mean = policy.act(inp, deterministic=True).actions
    assert inp.state is not None
    moved = PolicyInput(inp.images, inp.state + 1.0, inp.instructions)
    assert not torch.allclose(policy.act(moved, deterministic=True).actions, mean)
    swapped = PolicyInput(inp.images, inp.state, inp.instructions[::-1])
    assert not torch.allclose(policy.act(swapped, deterministic=True).actions, mean)
    policy.train()
    ev = policy.evaluate(inp, policy.act(inp).actions)  # sampled: at the mean the log-prob's gradient is 0
    (ev.logprob.sum() + ev.value.sum()).backward()
    stem = policy.vla.vision_backbone
    for grad in (stem.film1.weight.grad, stem.conv1.weight.grad, policy.action_head.model.fc2.weight.grad):
        assert grad is not None and grad.abs().sum() > 0  # FiLM gets language gradients through the prompt summary
    assert policy.llm.get_input_embeddings().weight.grad is None  # frozen unless train_embeddings


def test_bad_arguments_name_the_choice():
    with pytest.raises(ValueError, match="vision"):
        tiny("openvla-oft", vision="resnet")
    with pytest.raises(ValueError, match="image"):
        build_tiny("openvla", BACKBONE, action_chunk=1, action_dim=2, state_dim=0, image_size=0, num_cameras=0, seed=0)
