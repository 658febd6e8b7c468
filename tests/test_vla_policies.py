"""RL policies over tiny released-layout checkpoints (vlaslurm/models/vla/): log-probs against reference
computations with the release's own modules, batch independence, LoRA, values per decision and per slot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_checkpoints import write_tiny_adapter, write_tiny_release

from vlaslurm.models.base import PolicyInput
from vlaslurm.models.prismatic.actions import ActionBins
from vlaslurm.models.prismatic.oft import load_oft
from vlaslurm.models.prismatic.release import load_pretrained
from vlaslurm.models.vla.bins import CentreCategorical
from vlaslurm.models.vla.build import build_released
from vlaslurm.spec.model_types import LoraSpec, OpenVLAConfig, OpenVLAOFTConfig

INSTRUCTIONS = ["pick up the black bowl", "open the top drawer and put the bowl in it", "push the plate"]
CHUNK = 2


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("openvla") / "release")


@pytest.fixture(scope="module")
def oft_release(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("oft") / "release", oft=True)


def frames(batch: int, cameras: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, cameras, 224, 224, 3), generator=gen, dtype=torch.uint8)


def inputs(batch: int = 3, cameras: int = 1, state: bool = False, seeds: bool = True) -> PolicyInput:
    gen = torch.Generator().manual_seed(1)
    return PolicyInput(
        images=frames(batch, cameras),
        state=torch.randn(batch, 8, generator=gen) if state else None,
        instructions=INSTRUCTIONS[:batch],
        seeds=torch.arange(batch) + 100 if seeds else None,
    )


def row(inp: PolicyInput, i: int) -> PolicyInput:
    pick = slice(i, i + 1)
    return PolicyInput(
        images=None if inp.images is None else inp.images[pick],
        state=None if inp.state is None else inp.state[pick],
        instructions=inp.instructions[pick],
        seeds=None if inp.seeds is None else inp.seeds[pick],
    )


def openvla(path: Path, **fields) -> torch.nn.Module:
    cfg = OpenVLAConfig(type="openvla", path=str(path), action_chunk=1, **fields)
    return build_released(cfg, action_dim=7, state_dim=0, image_size=224, num_cameras=1).eval()


def oft(path: Path, head: str = "l1", **fields) -> torch.nn.Module:
    cfg = OpenVLAOFTConfig(type="openvla-oft", path=str(path), action_chunk=CHUNK, head=head, **fields)  # type: ignore[arg-type]
    return build_released(cfg, action_dim=7, state_dim=8, image_size=224, num_cameras=2).eval()


# --- the distribution over centres ---------------------------------------------------------------------------


def test_centres_merge_the_two_top_tokens_and_round_trip():
    cat = CentreCategorical(ActionBins(), temperature=0.7)
    logits = torch.randn(4, 256)
    log_probs = cat.log_probs(logits)
    tokens = torch.log_softmax(logits / 0.7, -1)
    assert log_probs.shape == (4, 255)
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(log_probs[:, 254], torch.logaddexp(tokens[:, 0], tokens[:, 1]))
    torch.testing.assert_close(log_probs[:, 0], tokens[:, 255])  # the lowest centre is token 31999
    index = torch.arange(255)
    assert torch.equal(cat.index(cat.values(index)), index)
    # the token fed back decodes to the same centre under the release's rule
    decoded = ActionBins().decode(cat.token_ids(index).numpy())
    np.testing.assert_allclose(decoded, cat.values(index).double().numpy(), atol=1e-7)


# --- OpenVLA: tokens -----------------------------------------------------------------------------------------


def test_openvla_token_log_probs_match_the_release_forward(release):
    policy = openvla(release)
    reference = load_pretrained(release)
    cat = policy.categorical
    index = torch.tensor([[0, 10, 100, 200, 253, 5, 77]])
    actions = cat.values(index).view(1, 1, 7)
    inp = inputs(1, seeds=False)
    out = policy.evaluate(inp, actions)
    image = inp.images[0, 0].numpy()
    ids = reference.input_ids(inp.instructions[0])
    tokens = cat.token_ids(index)
    with torch.no_grad():
        logits = reference.model(reference.pixel_values(image), torch.cat([ids, tokens[:, :-1]], 1))
    expected = torch.log_softmax(logits[0, -7:, 31744:32000].float(), -1).gather(-1, (tokens[0] - 31744)[:, None])
    torch.testing.assert_close(out.token_logprob.view(7), expected[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logprob, out.token_logprob.sum(-1))
    assert out.token_logprob.shape == (1, 1, 7)  # token level really is per token


def test_openvla_act_and_evaluate_agree_and_ignore_the_batch(release):
    policy = openvla(release, temperature=1.5)
    inp = inputs(3)
    sampled = policy.act(inp)
    assert sampled.actions.shape == (3, 1, 7) and sampled.token_logprob.shape == (3, 1, 7)
    again = policy.evaluate(inp, sampled.actions)
    torch.testing.assert_close(again.token_logprob, sampled.token_logprob, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again.value, sampled.value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sampled.slot_value[:, 0], sampled.value)
    alone = policy.act(row(inp, 1))  # left padding and batch-mates change nothing
    torch.testing.assert_close(alone.actions, sampled.actions[1:2])
    torch.testing.assert_close(alone.logprob, sampled.logprob[1:2], atol=1e-4, rtol=1e-4)
    greedy = policy.act(inp, deterministic=True)
    assert torch.equal(greedy.actions, policy.act(inp, deterministic=True).actions)


def test_openvla_chunk_values_per_action_slot(release):
    cfg = OpenVLAConfig(type="openvla", path=str(release), action_chunk=3)
    policy = build_released(cfg, action_dim=7, state_dim=0, image_size=224, num_cameras=1).eval()
    out = policy.act(inputs(2))
    assert out.actions.shape == (2, 3, 7) and out.slot_value.shape == (2, 3)
    again = policy.evaluate(inputs(2), out.actions)
    torch.testing.assert_close(again.slot_value, out.slot_value, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again.logprob, out.logprob, atol=1e-4, rtol=1e-4)


# --- OFT: one parallel pass ----------------------------------------------------------------------------------


def test_oft_l1_mean_is_the_release_chunk(oft_release):
    policy = oft(oft_release)
    reference = load_oft(oft_release, chunk=CHUNK)
    inp = inputs(3, cameras=2, state=True)
    mean = policy.act(inp, deterministic=True).actions
    for i in range(3):
        images = [inp.images[i, c].numpy() for c in range(2)]
        key = "libero_spatial_no_noops"
        hidden = reference.hidden_states(images, inp.instructions[i], key, inp.state[i].double().numpy())
        with torch.no_grad():
            expected = reference.action_head(hidden)[0].float()
        torch.testing.assert_close(mean[i], expected, atol=2e-5, rtol=1e-4)


def test_oft_gaussian_log_probs_and_entropy(oft_release):
    policy = oft(oft_release, init_std=0.3)
    inp = inputs(3, cameras=2, state=True)
    out = policy.act(inp)
    mean = policy.act(inp, deterministic=True).actions
    std = torch.full((7,), 0.3)
    expected = torch.distributions.Normal(mean, std).log_prob(out.actions)
    torch.testing.assert_close(out.token_logprob, expected, atol=1e-4, rtol=1e-4)
    ev = policy.evaluate(inp, out.actions)
    torch.testing.assert_close(ev.logprob, out.logprob, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ev.entropy, torch.distributions.Normal(mean, std).entropy().sum(-1))
    assert ev.slot_value.shape == (3, CHUNK) and ev.value.shape == (3,)
    alone = policy.act(row(inp, 2))
    torch.testing.assert_close(alone.actions, out.actions[2:3], atol=2e-5, rtol=1e-4)


def test_oft_discrete_head_samples_centres_with_exact_log_probs(oft_release):
    policy = oft(oft_release, head="discrete", temperature=2.0)
    inp = inputs(2, cameras=2, state=True)
    out = policy.act(inp)
    cat = policy.categorical
    assert torch.equal(cat.values(cat.index(out.actions)), out.actions)  # every action is a bin centre
    ev = policy.evaluate(inp, out.actions)
    torch.testing.assert_close(ev.token_logprob, out.token_logprob, atol=1e-4, rtol=1e-4)
    assert out.token_logprob.shape == (2, CHUNK, 7)


def test_proprio_is_normalised_and_read(oft_release):
    policy = oft(oft_release)
    inp = inputs(1, cameras=2, state=True)
    moved = PolicyInput(inp.images, inp.state + 5.0, inp.instructions, inp.seeds)
    a, b = policy.act(inp, True).actions, policy.act(moved, True).actions
    assert not torch.allclose(a, b)
    far = PolicyInput(inp.images, inp.state + 1e3, inp.instructions, inp.seeds)
    farther = PolicyInput(inp.images, inp.state + 1e4, inp.instructions, inp.seeds)
    # the release clips normalised proprio to [-1, 1]: beyond the bounds nothing changes
    torch.testing.assert_close(policy.act(far, True).actions, policy.act(farther, True).actions)


# --- LoRA ----------------------------------------------------------------------------------------------------


def trainable(policy: torch.nn.Module) -> set:
    return {n for n, p in policy.named_parameters() if p.requires_grad}


def test_lora_trains_only_adapters_and_heads(oft_release):
    policy = oft(oft_release, lora=LoraSpec(rank=4, alpha=8.0))
    names = trainable(policy)
    assert names and all(".lora_" in n or not n.startswith("vla.") for n in names)
    assert any(n.startswith("action_head.") for n in names) and "value_head.weight" in names
    inp = inputs(2, cameras=2, state=True)
    ev = policy.evaluate(inp, policy.act(inp).actions)
    (ev.logprob.sum() + ev.value.sum()).backward()
    with_grad = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert with_grad <= names and any(".lora_B." in n for n in with_grad)
    merged = policy.merged_state_dict()
    assert set(merged) == set(load_pretrained(oft_release).model.state_dict())


def test_an_adapter_folder_loads_over_its_base(release, tmp_path):
    adapter = write_tiny_adapter(release, tmp_path / "adapter", rank=4)
    base, adapted = openvla(release), openvla(adapter)
    assert adapted.has_adapters() and not base.has_adapters()
    inp = inputs(2, seeds=False)
    actions = base.act(inp, deterministic=True).actions
    assert not torch.allclose(base.evaluate(inp, actions).logprob, adapted.evaluate(inp, actions).logprob)
    merged = adapted.merged_state_dict()
    reference = openvla(release)
    reference.vla.load_state_dict(merged)
    torch.testing.assert_close(
        reference.evaluate(inp, actions).logprob, adapted.evaluate(inp, actions).logprob, atol=1e-4, rtol=1e-4
    )


# --- what is saved -------------------------------------------------------------------------------------------


def perturb(policy: torch.nn.Module) -> None:
    """A training step's worth of change to every trainable tensor (B starts at zero: LoRA would be a no-op)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def test_a_lora_checkpoint_holds_only_what_trains_and_restores_it(oft_release, tmp_path):
    from safetensors.torch import load_file

    from vlaslurm.rundir.layout import CKPT_MODEL
    from vlaslurm.runtime import checkpoint as ckpt

    trained = oft(oft_release, lora=LoraSpec(rank=4, alpha=8.0))
    perturb(trained)
    folder = ckpt.save(tmp_path, ckpt.TrainerState(version=3), trained, None, [], keep=2)
    saved = load_file(str(folder / CKPT_MODEL))
    assert saved and all(".lora_" in k or not k.startswith("vla.") for k in saved)  # no frozen base weights
    fresh = oft(oft_release, lora=LoraSpec(rank=4, alpha=8.0))
    ckpt.load(folder, fresh, None, torch.device("cpu"))
    inp = inputs(2, cameras=2, state=True)
    torch.testing.assert_close(fresh.act(inp, True).actions, trained.act(inp, True).actions)
    with pytest.raises(ckpt.CheckpointError, match="other tensors than the policy trains"):
        ckpt.load(folder, oft(oft_release), None, torch.device("cpu"))  # the same folder, a policy without LoRA


def test_a_merged_publication_serves_the_trained_policy_on_plain_layers(oft_release):
    """`model.lora.publish: merged`: a publication holds each adapted layer's `W + scale B A` and the heads, no
    factor; a generator's copy (built as the trainer's, then `prepare_to_serve`) runs plain linear layers and acts
    as the trained LoRA policy does. The default publishes what trains (the factors and heads)."""
    from peft.tuners.lora import LoraLayer

    from vlaslurm.models import load_trained_state, prepare_to_serve, publication_state, trained_state

    merged = LoraSpec(rank=4, alpha=8.0, publish="merged")
    trained = oft(oft_release, lora=merged)
    perturb(trained)
    sent = publication_state(trained)
    live = trained.state_dict()
    adapted = {n.replace(".base_layer.", ".") for n in live if n.endswith(".base_layer.weight")}
    assert adapted and set(sent) == adapted | {n for n in live if not n.startswith("vla.")}
    served = oft(oft_release, lora=merged)
    prepare_to_serve(served)
    assert not any(isinstance(m, LoraLayer) for m in served.modules())
    load_trained_state(served, sent)  # strict: exactly the tensors a merged publication holds
    inp = inputs(2, cameras=2, state=True)
    acted, reference = served.act(inp, True), trained.act(inp, True)
    torch.testing.assert_close(acted.actions, reference.actions, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acted.value, reference.value, atol=1e-5, rtol=1e-5)
    adapters = oft(oft_release, lora=LoraSpec(rank=4, alpha=8.0))
    assert publication_state(adapters).keys() == trained_state(adapters).keys()
    assert any(".lora_A." in n for n in publication_state(adapters))


def test_save_pretrained_writes_a_release_folder_of_the_trained_policy(oft_release, tmp_path):
    trained = oft(oft_release, lora=LoraSpec(rank=4, alpha=8.0))
    perturb(trained)
    out = trained.save_pretrained(tmp_path / "final")
    again = oft(out)  # a plain release folder now: merged weights, no adapters
    assert not again.has_adapters()
    inp = inputs(2, cameras=2, state=True)
    torch.testing.assert_close(again.act(inp, True).actions, trained.act(inp, True).actions, atol=1e-5, rtol=1e-4)
    reference = load_oft(out, chunk=CHUNK)  # and the release loader reads it as it reads a release
    assert reference.action_head is not None and reference.proprio_projector is not None


# --- the SFT baseline: the runtime's frozen path is the release's predict_action -----------------------------


def test_frozen_oft_actions_in_the_environment_equal_predict_action(oft_release):
    from vlaslurm.models import env_action_transform
    from vlaslurm.models import load_pretrained as load_any

    cfg = OpenVLAOFTConfig(type="openvla-oft", path=str(oft_release), action_chunk=CHUNK, gripper="none")
    policy = build_released(cfg, action_dim=7, state_dim=8, image_size=224, num_cameras=2).eval()
    to_env = env_action_transform(cfg)
    release = load_any(oft_release, chunk=CHUNK)
    inp = inputs(2, cameras=2, state=True)
    env_actions = to_env(policy.act(inp, deterministic=True).actions.numpy())
    for i in range(2):
        images = [inp.images[i, c].numpy() for c in range(2)]
        expected = release.predict_action(images, inp.instructions[i], proprio=inp.state[i].double().numpy())
        np.testing.assert_allclose(env_actions[i], expected, atol=1e-4, rtol=1e-4)


def test_frozen_openvla_actions_in_the_environment_equal_predict_action(release):
    """The release decodes greedily over the whole vocabulary, the policy's mode over the bin centres; a trained
    model's argmax is an action token. A random one prefers word tokens, so both models get an LM head that
    scores only action tokens (the same edit in each), and then the actions must be the release's exactly."""
    from vlaslurm.models import env_action_transform

    cfg = OpenVLAConfig(type="openvla", path=str(release), action_chunk=1)
    policy, reference = openvla(release), load_pretrained(release)
    for head in (policy.vla.language_model.lm_head, reference.model.language_model.lm_head):
        with torch.no_grad():
            head.weight[:31744] = 0.0
            head.weight[32000:] = 0.0  # the padding rows too
    inp = inputs(3, seeds=False)
    env_actions = env_action_transform(cfg)(policy.act(inp, deterministic=True).actions.numpy())
    for i in range(3):
        expected = reference.predict_action(inp.images[i, 0].numpy(), inp.instructions[i])
        np.testing.assert_allclose(env_actions[i, 0], expected, atol=1e-5)


def test_assemble_left_pads_each_row_in_the_release_order():
    from vlaslurm.models.vla.inputs import assemble

    gen = torch.Generator().manual_seed(0)
    text, prefix, tail = (torch.randn(3, n, 4, generator=gen) for n in (6, 2, 3))
    lengths = [6, 2, 4]
    packed = assemble(text, lengths, prefix, tail)
    for b, n in enumerate(lengths):
        row = torch.cat([text[b, :1], prefix[b], text[b, 1:n], tail[b]])
        pad = packed.length - len(row)
        assert torch.equal(packed.embeddings[b, pad:], row) and not packed.embeddings[b, :pad].any()
        assert packed.mask[b].tolist() == [0] * pad + [1] * len(row)
        assert packed.positions[b, pad:].tolist() == list(range(len(row)))
    grads = torch.autograd.grad(assemble(text.requires_grad_(), lengths, prefix).embeddings.sum(), text)[0]
    assert grads[2, :4].eq(1).all() and grads[2, 4:].eq(0).all()  # only a row's real prompt tokens are read
