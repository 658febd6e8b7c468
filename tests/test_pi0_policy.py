"""The π0 policy (vlaslurm/models/pi0/) on a tiny configuration of transformers' own PI0 classes: the sampler's
stored path is replayed by `evaluate` to the same log-prob, the ODE is PI0's `sample_actions`, values have their
shapes and gradients, and a sample depends on its seed only. Wall time ~25 s."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from learner_helpers import algo_config, rollout_segments

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.models import trained_state
from vlaslurm.models.base import PolicyInput, PolicyOutput
from vlaslurm.models.pi0.build import tiny_pi0
from vlaslurm.models.pi0.flow import FlowSettings, Method
from vlaslurm.models.pi0.inputs import padded_state, pixel_values, prompt_ids
from vlaslurm.models.pi0.policy import PI0Policy, ValueFrom

CHUNK, ACTION_DIM, STATE_DIM = 3, 2, 2
INSTRUCTIONS = ["pick up the red cube", "open the drawer", "push it left"]
SAMPLERS: List[Tuple[Method, int]] = [("flow_sde", 2), ("flow_noise", 1)]
_POLICIES: Dict[Tuple[str, int, str], PI0Policy] = {}
GEN = torch.Generator().manual_seed(0)
IMAGES = torch.randint(0, 256, (3, 2, 56, 56, 3), dtype=torch.uint8, generator=GEN)
STATE = torch.randn(3, STATE_DIM, generator=GEN)


def policy(method: Method = "flow_sde", sde_steps: int = 1, value_from: ValueFrom = "expert") -> PI0Policy:
    key = (method, sde_steps, value_from)
    if key not in _POLICIES:
        settings = FlowSettings(denoise_steps=4, noise_method=method, sde_steps=sde_steps)
        _POLICIES[key] = tiny_pi0(CHUNK, ACTION_DIM, STATE_DIM, settings, value_from, seed=3)
    return _POLICIES[key]


def observations(seeds=(11, 12, 13)) -> PolicyInput:
    return PolicyInput(IMAGES, STATE, list(INSTRUCTIONS), torch.tensor(seeds))


def replay_of(out: PolicyOutput) -> Dict[str, torch.Tensor]:
    assert out.replay is not None
    return out.replay


def replayed(inp: PolicyInput, out: PolicyOutput) -> PolicyInput:
    """What the trainer hands back: the observations and the stored replay (no seeds)."""
    return PolicyInput(inp.images, inp.state, inp.instructions, replay=replay_of(out))


@pytest.mark.parametrize("method,sde_steps", SAMPLERS)
def test_recomputed_path_logprob_equals_the_sampling_one(method: Method, sde_steps: int) -> None:
    pol, inp = policy(method, sde_steps), observations()
    out = pol.act(inp)
    path, steps = replay_of(out)["path"], replay_of(out)["steps"]
    assert path.shape == (3, 5, CHUNK, ACTION_DIM) and steps.shape == (3, pol.settings.stochastic)
    assert torch.equal(path[:, -1], out.actions)
    evaluated = pol.evaluate(replayed(inp, out), out.actions)
    assert out.logprob.shape == (3, CHUNK) and torch.isfinite(out.logprob).all()
    assert torch.allclose(evaluated.logprob, out.logprob, atol=1e-5, rtol=0)
    assert evaluated.entropy.shape == (3, CHUNK)
    # under other weights the same path has another log-prob (the recomputation reads the weights)
    with torch.no_grad():
        pol.pi0.action_out_proj.bias.add_(0.5)
    try:
        moved = pol.evaluate(replayed(inp, out), out.actions).logprob
    finally:
        with torch.no_grad():
            pol.pi0.action_out_proj.bias.sub_(0.5)
    assert (moved - out.logprob).abs().max() > 1e-2


def test_flow_sde_paths_are_ode_steps_but_at_the_stochastic_ones() -> None:
    """Replaying a Flow-SDE path deterministically: every step that is not stochastic is the ODE's Euler step."""
    pol, inp = policy("flow_sde", 1), observations()
    out = pol.act(inp)
    path, steps = replay_of(out)["path"], replay_of(out)["steps"]
    prefix = pol.encode_prefix(inp)
    with torch.no_grad():
        for k in range(pol.settings.denoise_steps):
            v, _ = pol.expert(prefix, path[:, k], torch.full((3,), 1 - k / 4))
            ode = (path[:, k] + pol.settings.dt * v - path[:, k + 1]).abs().amax((1, 2))
            for b in range(3):
                assert (ode[b] < 1e-5) == (k not in steps[b].tolist()), (b, k)


def test_deterministic_act_is_pi0s_own_ode() -> None:
    """act(deterministic=True) from a path's initial noise equals PI0ForConditionalGeneration.sample_actions."""
    pol, inp = policy(), observations()
    out = pol.act(inp, deterministic=True)
    ids, mask = prompt_ids(pol.layout, pol.text, inp.instructions, 2, pol.device)
    reference = pol.pi0.sample_actions(
        state=padded_state(pol.layout, inp.state, 3, pol.device),
        input_ids=ids,
        pixel_values=pixel_values(pol.layout, IMAGES, torch.float32),
        noise=replay_of(out)["path"][:, 0].clone(),
        attention_mask=mask,
        pixel_attention_mask=torch.ones(3, 2, dtype=torch.bool),
        num_steps=pol.settings.denoise_steps,
    )
    assert torch.allclose(out.actions, reference[..., :ACTION_DIM], atol=1e-5)
    sampled = pol.act(inp).actions
    assert not torch.allclose(sampled, out.actions, atol=1e-3)
    chunk = pol.predict_action(IMAGES[0].numpy(), INSTRUCTIONS[0], STATE[0].numpy(), seed=11)
    assert torch.allclose(torch.from_numpy(chunk), out.actions[0], atol=1e-5)


def test_act_is_deterministic_given_seeds_and_independent_of_the_batch() -> None:
    pol, inp = policy("flow_noise", 1), observations()
    first, again = pol.act(inp), pol.act(inp)
    assert torch.equal(first.actions, again.actions) and torch.equal(first.logprob, again.logprob)
    alone = PolicyInput(IMAGES[1:2], STATE[1:2], INSTRUCTIONS[1:2], torch.tensor([12]))
    assert torch.allclose(pol.act(alone).actions[0], first.actions[1], atol=1e-5)
    other = pol.act(observations(seeds=(21, 22, 23)))
    assert not torch.allclose(other.actions, first.actions, atol=1e-3)


@pytest.mark.parametrize("value_from", ["expert", "prefix"])
def test_values_per_decision_and_slot_have_their_shapes_and_gradients(value_from: ValueFrom) -> None:
    pol, inp = policy(value_from=value_from), observations()
    out = pol.act(inp)
    assert out.value.shape == (3,) and out.slot_value is not None and out.slot_value.shape == (3, CHUNK)
    pol.zero_grad()
    evaluated = pol.evaluate(replayed(inp, out), out.actions)
    assert evaluated.slot_value is not None
    assert torch.allclose(evaluated.value, out.value, atol=1e-5)
    (evaluated.value.sum() + evaluated.slot_value.sum()).backward()
    reads = pol.pi0.model.dit if value_from == "expert" else pol.pi0.model.vlm.language_model
    for module in (pol.value_head, reads.layers[-1].mlp.down_proj):
        assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0
    pol.zero_grad()


def test_evaluate_refuses_samples_without_their_paths() -> None:
    pol, inp = policy(), observations()
    out = pol.act(inp)
    with pytest.raises(ValueError, match="PolicyInput.replay"):
        pol.evaluate(inp, out.actions)
    with pytest.raises(ValueError, match="last step"):
        pol.evaluate(replayed(inp, out), out.actions + 1)


def test_the_stem_reads_the_frames_for_the_instruction_and_its_paths_replay(tmp_path) -> None:
    """vision: stem (the tiny quickstart's): the stem, not the SigLIP tower, makes the image tokens, conditioned on
    the instruction; the stored paths replay to the sampling log-probs; a save keeps the stem and its actions."""
    from vlaslurm.models.pi0.build import load_pi0

    settings = FlowSettings(denoise_steps=4, noise_method="flow_sde", sde_steps=1)
    pol = tiny_pi0(CHUNK, ACTION_DIM, STATE_DIM, settings, seed=3, vision="stem")
    assert pol.stem is not None
    inp = observations()
    out = pol.act(inp)
    assert torch.allclose(pol.evaluate(replayed(inp, out), out.actions).logprob, out.logprob, atol=1e-5, rtol=0)
    mean = pol.act(inp, deterministic=True).actions
    darker = PolicyInput(IMAGES // 2, STATE, list(INSTRUCTIONS), inp.seeds)
    other = PolicyInput(IMAGES, STATE, INSTRUCTIONS[1:] + INSTRUCTIONS[:1], inp.seeds)
    assert not torch.allclose(pol.act(darker, deterministic=True).actions, mean)  # the frames matter
    assert not torch.allclose(pol.act(other, deterministic=True).actions[1], mean[1])  # and the instruction
    pol.pi0.model.vlm.vision_tower = None  # never read with the stem
    assert torch.equal(pol.act(inp, deterministic=True).actions, mean)
    tower_free = tiny_pi0(CHUNK, ACTION_DIM, STATE_DIM, settings, seed=3, vision="stem")
    loaded = load_pi0(tower_free.save_pretrained(tmp_path / "stem"))
    assert loaded.vision == "stem" and torch.equal(loaded.act(inp, deterministic=True).actions, mean)


def test_train_expert_only_freezes_paligemma_and_publishes_the_rest() -> None:
    """model.train_expert_only (πRL's recipes): a PPO update moves the expert and the heads, not PaliGemma, and what
    trains (what a publication or a checkpoint carries) leaves PaliGemma out."""
    settings = FlowSettings(denoise_steps=3, noise_method="flow_sde", sde_steps=1)
    pol = tiny_pi0(CHUNK, ACTION_DIM, STATE_DIM, settings, seed=3)
    pol.freeze_vlm()
    before = {k: v.clone() for k, v in pol.state_dict().items()}
    batch = collate(rollout_segments(pol, num_envs=4, chunks=3))
    make_learner(algo_config("ppo", "action"), pol, DataParallel(None, 0, 1), 7).update(batch, version=1)
    moved = {k for k, v in pol.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and not any(k.startswith("pi0.model.vlm.") for k in moved)
    assert any(k.startswith("pi0.model.dit.") for k in moved) and "value_head.weight" in moved
    published = trained_state(pol)
    assert published and not any(k.startswith("pi0.model.vlm.") for k in published) and moved <= set(published)


def test_lora_adapts_paligemma_trains_the_expert_and_saves_merged(tmp_path) -> None:
    """model.lora: adapters on PaliGemma's language model, its base frozen, the expert trained in full; what trains
    leaves the frozen base out; a saved policy is a plain PI0 folder (adapters merged) acting the same."""
    from vlaslurm.models.pi0.build import load_pi0
    from vlaslurm.models.prismatic.lora import LoraSettings

    settings = FlowSettings(denoise_steps=3, noise_method="flow_sde", sde_steps=1)
    pol = tiny_pi0(CHUNK, ACTION_DIM, STATE_DIM, settings, seed=3)
    pol.add_lora(LoraSettings(rank=4, alpha=8.0, scope=("language_model",)))
    before = {k: v.clone() for k, v in pol.state_dict().items()}
    batch = collate(rollout_segments(pol, num_envs=4, chunks=3))
    make_learner(algo_config("ppo", "action"), pol, DataParallel(None, 0, 1), 7).update(batch, version=1)
    moved = {k for k, v in pol.state_dict().items() if not torch.equal(v, before[k])}
    vlm = {k for k in moved if k.startswith("pi0.model.vlm.")}
    assert vlm and all(".lora_" in k for k in vlm) and any(k.startswith("pi0.model.dit.") for k in moved)
    published = trained_state(pol)
    assert moved <= set(published) and not any(k.startswith("pi0.model.vlm.") and ".lora_" not in k for k in published)
    inp = observations()
    mean = pol.act(inp, deterministic=True).actions
    loaded = load_pi0(pol.save_pretrained(tmp_path / "lora"))
    assert not loaded.lora and torch.allclose(loaded.act(inp, deterministic=True).actions, mean, atol=1e-5, rtol=0)
