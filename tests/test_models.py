"""The OpenVLA-style policies: shapes, log-prob consistency, checkpoints, size, gradients."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

import pytest
import torch

from vlaslurm.envs.toy import make as make_toy
from vlaslurm.models import PolicyInput, build_policy
from vlaslurm.models.common import HashedWordTokenizer
from vlaslurm.spec.env_types import ToyEnvConfig
from vlaslurm.spec.model_types import OpenVLAConfig, OpenVLAOFTConfig

torch.set_num_threads(2)
B, CHUNK = 6, 4
TYPES = ["openvla-oft", "openvla"]


def model_cfg(kind: str, **fields):
    cls = OpenVLAOFTConfig if kind == "openvla-oft" else OpenVLAConfig
    return cls(type=kind, action_chunk=CHUNK, **fields)


def build(kind: str, **fields):
    return build_policy(model_cfg(kind, **fields), action_dim=2, state_dim=2, image_size=32, num_cameras=1)


@pytest.fixture(scope="module")
def batch() -> PolicyInput:
    env = make_toy(ToyEnvConfig(type="toy"), num_envs=B, seed=0)
    obs = env.reset(range(B), seeds=range(B))
    return PolicyInput(torch.from_numpy(obs.images), torch.from_numpy(obs.state), obs.instructions)


@pytest.fixture(scope="module", params=TYPES)
def policy(request):
    return build(request.param)


def test_act_and_evaluate_shapes(policy, batch):
    out = policy.act(batch)
    assert out.actions.shape == (B, CHUNK, 2) and out.actions.dtype == torch.float32
    assert out.logprob.shape == (B, CHUNK) and out.value.shape == (B,)
    ev = policy.evaluate(batch, out.actions)
    assert ev.logprob.shape == ev.entropy.shape == (B, CHUNK) and ev.value.shape == (B,)
    assert (policy.action_chunk, policy.action_dim) == (CHUNK, 2)


def test_evaluate_reproduces_the_behaviour_logprob(policy, batch):
    torch.manual_seed(0)
    out = policy.act(batch)
    ev = policy.evaluate(batch, out.actions)
    torch.testing.assert_close(ev.logprob, out.logprob, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ev.value, out.value, atol=1e-5, rtol=1e-5)


def test_deterministic_act_is_repeatable(policy, batch):
    a, b = policy.act(batch, deterministic=True), policy.act(batch, deterministic=True)
    torch.testing.assert_close(a.actions, b.actions)


def test_padding_does_not_change_outputs(policy, batch):
    # Left padding with position ids counted over real tokens: a longer neighbour changes nothing.
    longer = PolicyInput(batch.images[:2], batch.state[:2], [batch.instructions[0], "please " * 6 + "go"])
    alone = PolicyInput(batch.images[:1], batch.state[:1], batch.instructions[:1])
    torch.testing.assert_close(policy.act(longer, True).value[:1], policy.act(alone, True).value, atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip(policy, batch, tmp_path):
    policy.save_pretrained(tmp_path)
    kind = "openvla-oft" if policy.config.model_type.endswith("oft") else "openvla"
    loaded = build_policy(model_cfg(kind, path=str(tmp_path)), action_dim=2, state_dim=2, image_size=32, num_cameras=1)
    assert type(loaded) is type(policy)
    actions = policy.act(batch).actions
    for got, want in zip(
        vars(loaded.evaluate(batch, actions)).values(), vars(policy.evaluate(batch, actions)).values()
    ):
        # Same weights bit for bit; only float summation order may differ (seen: 1.5e-8).
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    torch.testing.assert_close(loaded.act(batch, True).actions, policy.act(batch, True).actions, atol=0, rtol=0)


@pytest.mark.parametrize("kind", TYPES)
def test_load_errors_say_what_is_wrong(kind, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        build(kind, path=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build(kind, path=str(tmp_path))
    build(kind).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="action_dim: checkpoint 2, needed 3"):
        build_policy(model_cfg(kind, path=str(tmp_path)), action_dim=3, state_dim=2, image_size=32, num_cameras=1)


@pytest.mark.parametrize("kind", TYPES)
def test_seeded_init_is_reproducible_and_leaves_global_rng_alone(kind):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build(kind), build(kind), build(kind, init_seed=1)
    assert torch.equal(torch.rand(1), expected_next)
    pa, pb, pc = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_size_under_five_million(policy):
    assert sum(p.numel() for p in policy.parameters()) < 5_000_000


def test_film_starts_as_identity_and_gradients_reach_vision(policy, batch):
    vision = policy.encoder.vision
    assert vision.film1.weight.abs().max() == 0 and vision.film2.bias.abs().max() == 0
    policy.zero_grad()
    ev = policy.evaluate(batch, policy.act(batch).actions)
    (ev.logprob.sum() + ev.value.sum()).backward()
    for param in (
        vision.conv1.weight,
        vision.conv2.weight,
        vision.film1.weight,
        vision.film2.weight,
        vision.proj.weight,
    ):
        assert param.grad is not None and param.grad.abs().sum() > 0
    assert policy.encoder.lm.embed_tokens.weight.grad.abs().sum() > 0
    policy.zero_grad()


@pytest.mark.parametrize("kind", TYPES)
def test_bf16_runs_on_cpu(kind, batch):
    policy = build(kind, precision="bf16")
    out = policy.act(batch)
    ev = policy.evaluate(batch, out.actions)
    assert out.logprob.dtype == ev.logprob.dtype == torch.float32
    assert torch.isfinite(ev.logprob).all() and torch.isfinite(ev.value).all()


def test_state_only_policy_without_images():
    policy = build_policy(model_cfg("openvla-oft"), action_dim=2, state_dim=2, image_size=0, num_cameras=0)
    inp = PolicyInput(None, torch.zeros(3, 2), ["a", "b c", ""])
    assert policy.act(inp).actions.shape == (3, CHUNK, 2)


def test_scheduled_std_moves_from_init_to_final(batch):
    policy = build("openvla-oft", std="scheduled", init_std=0.5, final_std=0.1)
    torch.testing.assert_close(policy.action_log_std().exp(), torch.full((2,), 0.5))
    policy.set_std_progress(1.0)
    torch.testing.assert_close(policy.action_log_std().exp(), torch.full((2,), 0.1))
    ev = policy.evaluate(batch, torch.zeros(B, CHUNK, 2))
    assert ev.entropy.shape == (B, CHUNK)


def test_openvla_actions_are_bin_centres_and_round_trip():
    policy = build("openvla", n_bins=16)
    centres = policy.bin_centers()
    assert torch.equal(policy.actions_to_bins(centres), torch.arange(16))
    assert policy.actions_to_bins(torch.tensor([-5.0, 5.0])).tolist() == [0, 15]


def test_tokenizer_keeps_action_bins_free_and_colour_words_apart():
    tok = HashedWordTokenizer(vocab_size=512, max_tokens=16, reserved=256)
    words = "move to the red green blue yellow purple orange square".split()
    ids = [tok.word_id(w) for w in words]
    assert len(set(ids)) == len(ids) and max(ids) < 512 - 256
    ids, mask = tok(["move to the red square", "red"])
    assert ids.shape == mask.shape == (2, 6) and mask[1].tolist() == [0, 0, 0, 0, 1, 1]
