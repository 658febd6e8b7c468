"""The random-init policies a spec's model section builds (`model.path: null`: tiny configurations of the release's
classes, vla/tiny.py): shapes, log-prob consistency, the saved folder, frozen embeddings, precision, errors."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

import pytest
import torch

from vlaslurm.envs.toy import make as make_toy
from vlaslurm.models import (
    CheckpointError,
    PolicyInput,
    build_policy,
    check_checkpoint,
    load_trained_state,
    trained_state,
)
from vlaslurm.models.vla.oft import OFTChunkPolicy
from vlaslurm.models.vla.openvla import OpenVLATokenPolicy
from vlaslurm.spec.env_types import ToyEnvConfig
from vlaslurm.spec.model_types import LoraSpec, OpenVLAConfig, OpenVLAOFTConfig

torch.set_num_threads(2)
B, CHUNK = 6, 4
TYPES = ["openvla-oft", "openvla"]
EMBEDDINGS = "vla.language_model.model.embed_tokens.weight"
LM_HEAD = "vla.language_model.lm_head.weight"


def model_cfg(kind: str, **fields):
    cls = OpenVLAOFTConfig if kind == "openvla-oft" else OpenVLAConfig
    return cls(type=kind, action_chunk=CHUNK, **fields)


def build(kind: str, action_dim: int = 2, **fields):
    return build_policy(model_cfg(kind, **fields), action_dim=action_dim, state_dim=2, image_size=32, num_cameras=1)


@pytest.fixture(scope="module")
def batch() -> PolicyInput:
    env = make_toy(ToyEnvConfig(type="toy"), num_envs=B, seed=0)
    obs = env.reset(range(B), seeds=range(B))
    return PolicyInput(torch.from_numpy(obs.images), torch.from_numpy(obs.state), obs.instructions)


@pytest.fixture(scope="module", params=TYPES)
def policy(request):
    return build(request.param)


@pytest.mark.parametrize("kind, cls", [("openvla-oft", OFTChunkPolicy), ("openvla", OpenVLATokenPolicy)])
def test_random_init_is_the_release_policy_class(kind, cls):
    policy = build(kind)
    assert type(policy) is cls
    assert {"vision_backbone", "projector", "language_model"} <= {name for name, _ in policy.vla.named_children()}
    assert policy.llm.config.vocab_size == 32064  # the release's vocabulary, whatever the width


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


def test_padding_does_not_change_outputs(policy, batch):
    # Left padding with position ids counted over real tokens: a longer neighbour changes nothing.
    longer = PolicyInput(batch.images[:2], batch.state[:2], [batch.instructions[0], "please " * 6 + "go"])
    alone = PolicyInput(batch.images[:1], batch.state[:1], batch.instructions[:1])
    torch.testing.assert_close(policy.act(longer, True).value[:1], policy.act(alone, True).value, atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip(policy, batch, tmp_path):
    policy.save_pretrained(tmp_path)
    kind = "openvla-oft" if isinstance(policy, OFTChunkPolicy) else "openvla"
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "vlaslurm-tiny-vla" and config["build_tiny"]["kind"] == kind
    loaded = build(kind, path=str(tmp_path))
    assert type(loaded) is type(policy)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    actions = policy.act(batch).actions
    for got, want in zip(
        vars(loaded.evaluate(batch, actions)).values(), vars(policy.evaluate(batch, actions)).values()
    ):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # only summation order may differ
    torch.testing.assert_close(loaded.act(batch, True).actions, policy.act(batch, True).actions, atol=0, rtol=0)


@pytest.mark.parametrize("kind", TYPES)
def test_a_saved_policy_that_does_not_fit_names_the_field(kind, tmp_path):
    build(kind).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="model.action_dim: is 3 but the policy .* saved with 2"):
        check_checkpoint(model_cfg(kind, path=str(tmp_path)), action_dim=3)
    with pytest.raises(CheckpointError, match="model.action_dim: is 3 but the policy .* saved with 2"):
        build(kind, action_dim=3, path=str(tmp_path))  # the runtime's build makes plan's check
    state_mismatch = "env.obs.state: the environment gives 8 state values but the policy .* saved with 2"
    with pytest.raises(CheckpointError, match=state_mismatch):
        check_checkpoint(model_cfg(kind, path=str(tmp_path)), state_dim=8)
    with pytest.raises(CheckpointError, match=state_mismatch):
        build_policy(model_cfg(kind, path=str(tmp_path)), action_dim=2, state_dim=8, image_size=32, num_cameras=1)
    other = "openvla" if kind == "openvla-oft" else "openvla-oft"
    with pytest.raises(CheckpointError, match="model.type: is '.*' but the policy .* saved with"):
        check_checkpoint(model_cfg(other, path=str(tmp_path)))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no weights \(\*.safetensors\)"):
        check_checkpoint(model_cfg(kind, path=str(tmp_path)))


@pytest.mark.parametrize("kind", TYPES)
def test_seeded_init_is_reproducible_and_leaves_global_rng_alone(kind):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build(kind), build(kind), build(kind, init_seed=1)
    assert torch.equal(torch.rand(1), expected_next)
    pa, pb, pc = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_embeddings_stay_frozen_and_out_of_the_trained_state(policy, batch):
    """The random rows tell words apart untrained; the state a checkpoint or publication carries leaves them out
    (and OFT's unread LM head), and a fresh build from the same seed takes that state back."""
    frozen = {EMBEDDINGS, LM_HEAD} if isinstance(policy, OFTChunkPolicy) else {EMBEDDINGS}
    assert policy.frozen == frozen
    state = trained_state(policy)
    assert not frozen & set(state) and set(state) | frozen == set(policy.state_dict())
    policy.zero_grad()
    ev = policy.evaluate(batch, policy.act(batch).actions)
    (ev.logprob.sum() + ev.value.sum()).backward()
    grads = {name: p.grad for name, p in policy.named_parameters()}
    assert all(grads[name] is None for name in frozen)
    stem = "vla.vision_backbone."
    for name in ("conv1.weight", "film1.weight", "film2.weight", "proj.weight"):
        assert grads[stem + name] is not None and grads[stem + name].abs().sum() > 0, name
    policy.zero_grad()
    fresh = build("openvla-oft" if isinstance(policy, OFTChunkPolicy) else "openvla")  # the same seed
    with torch.no_grad():
        for parameter in fresh.parameters():
            if parameter.requires_grad:
                parameter.add_(1.0)  # as if trained elsewhere
    load_trained_state(fresh, {k: t.clone() for k, t in state.items()})
    for name, tensor in policy.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize("kind", TYPES)
def test_bf16_runs_on_cpu(kind, batch):
    policy = build(kind, precision="bf16")
    assert policy.llm.dtype == torch.bfloat16
    out = policy.act(batch)
    ev = policy.evaluate(batch, out.actions)
    assert out.logprob.dtype == ev.logprob.dtype == torch.float32
    assert torch.isfinite(ev.logprob).all() and torch.isfinite(ev.value).all()


def test_scheduled_std_moves_from_init_to_final(batch):
    policy = build("openvla-oft", std="scheduled", init_std=0.5, final_std=0.1)
    torch.testing.assert_close(policy.action_log_std().exp(), torch.full((2,), 0.5))
    policy.set_std_progress(1.0)
    torch.testing.assert_close(policy.action_log_std().exp(), torch.full((2,), 0.1))
    ev = policy.evaluate(batch, torch.zeros(B, CHUNK, 2))
    assert ev.entropy.shape == (B, CHUNK)


def test_openvla_actions_are_the_release_bin_centres(batch):
    """The token policy's actions are centres of the release's 256 bins over [-1, 1] (255 distinct centres)."""
    policy = build("openvla")
    centres = policy.categorical.values(torch.arange(255))
    actions = policy.act(batch).actions.flatten()
    assert torch.isin(actions, centres).all() and centres.min() > -1 and centres.max() < 1


def test_lora_over_a_random_init_trains_adapters_and_saves_merged(batch, tmp_path):
    """`model.lora` on `path: null`: the adapters, the heads and the random vision stem (nothing pretrained to keep)
    train; checkpoints and publications carry exactly those; the saved folder holds the merged weights and loads
    back (without LoRA) to the same actions."""
    policy = build("openvla-oft", lora=LoraSpec(rank=4))
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    stem = {name for name in trained if name.startswith("vla.vision_backbone.")}
    assert stem and policy.full_trained == stem
    assert all(".lora_" in name or not name.startswith("vla.") for name in trained - stem)
    assert any(".lora_" in name for name in trained) and set(trained_state(policy)) >= trained
    assert not any(name.startswith("vla.language_model.") and ".lora_" not in name for name in trained_state(policy))
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, p in policy.named_parameters():
            if ".lora_B" in name:
                p.normal_(std=0.05)
    expected = policy.act(batch, deterministic=True).actions
    loaded = build("openvla-oft", path=str(policy.save_pretrained(tmp_path)))
    assert not loaded.has_adapters()
    torch.testing.assert_close(loaded.act(batch, deterministic=True).actions, expected, atol=1e-5, rtol=1e-5)
