"""The one interface every policy implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol

import torch


@dataclass
class PolicyInput:
    """A batch of observations, as tensors."""

    images: Optional[torch.Tensor]  # uint8 [B, cameras, H, W, 3]
    state: Optional[torch.Tensor]  # float32 [B, state_dim]
    instructions: List[str]  # B language instructions
    # int64 [B]: per-item sampling seeds, so a sample does not depend on which batch it was served in
    seeds: Optional[torch.Tensor] = None
    # Per-sample tensors [B, ...] that a policy's `act` put in `PolicyOutput.replay`, handed back to `evaluate`
    # (the trainer sets them from the stored sample); None for policies whose `evaluate` needs only the actions
    replay: Optional[Dict[str, torch.Tensor]] = None


@dataclass
class PolicyOutput:
    """Sampled actions with what the trainer needs to learn from them."""

    # float32 [B, action_chunk, action_dim]: in the policy's action space, what `evaluate` takes back (a
    # checkpoint's normalised actions; vlaslurm.models.env_action_transform maps them to the environment's)
    actions: torch.Tensor
    logprob: torch.Tensor  # float32 [B, action_chunk]: behaviour log-prob of each action of the chunk
    value: torch.Tensor  # float32 [B]: value estimate of the observation
    # float32 [B, action_chunk, action_dim]: log-prob of each action token (one per action dimension), where the
    # policy's distribution factorises that way; None otherwise
    token_logprob: Optional[torch.Tensor] = None
    # float32 [B, action_chunk]: a value per action slot of the chunk, for value_level: action; None if not given
    slot_value: Optional[torch.Tensor] = None
    # Per-sample tensors [B, ...] that `evaluate` needs besides the actions, which the runtime must store with the
    # sample and hand back as `PolicyInput.replay` (pi0: the denoising path and its stochastic steps, since seeds
    # cannot rebuild a path under newer weights); None for every policy whose actions suffice
    replay: Optional[Dict[str, torch.Tensor]] = None


@dataclass
class PolicyEval:
    """Stored actions re-evaluated under the current parameters."""

    logprob: torch.Tensor  # float32 [B, action_chunk]
    entropy: torch.Tensor  # float32 [B, action_chunk]
    value: torch.Tensor  # float32 [B]
    token_logprob: Optional[torch.Tensor] = None  # float32 [B, action_chunk, action_dim], as in PolicyOutput
    slot_value: Optional[torch.Tensor] = None  # float32 [B, action_chunk], as in PolicyOutput


class Policy(Protocol):
    """A VLA policy with a value head on its shared backbone (a torch.nn.Module)."""

    action_chunk: int
    action_dim: int

    def act(self, inp: PolicyInput, deterministic: bool = False) -> PolicyOutput:
        """Sample (or take the mode of) an action chunk per observation; no gradients."""

    def evaluate(self, inp: PolicyInput, actions: torch.Tensor) -> PolicyEval:
        """Log-probs, entropy and value of stored `actions` [B, action_chunk, action_dim] (and of `inp.replay`,
        for a policy whose `act` returned one)."""

    # What the runtime calls of torch.nn.Module on a built policy; both return the module itself, typed Any
    # because a Protocol cannot say "and a torch.nn.Module".
    def eval(self) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...


def trained_state(policy: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """What training changes of `policy`, which is what a checkpoint saves and a weight publication sends: a policy
    whose frozen part comes from `model.path` (LoRA over a release) says so (`trained_state_dict`: the adapters and
    the heads); any other policy, its whole state dict."""
    trained = getattr(policy, "trained_state_dict", None)
    return trained() if trained is not None else policy.state_dict()


def publication_sources(policy: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The live tensors (a sharded trainer's DTensors included) a weight publication is made of: what trains, and
    what the policy needs beside it to make its publication (`model.lora.publish: merged`: the base weights)."""
    sources = getattr(policy, "publication_sources", None)
    return sources() if sources is not None else trained_state(policy)


def publication_state(
    policy: torch.nn.Module, full: Optional[Dict[str, torch.Tensor]] = None
) -> Dict[str, torch.Tensor]:
    """What a weight publication sends the generators, made from `full`: the `publication_sources` as full tensors
    (gathered from shards; by default the policy's own). With LoRA published merged, the merged weights."""
    full = publication_sources(policy) if full is None else full
    fold = getattr(policy, "fold_publication", None)
    return fold(full) if fold is not None else full


def prepare_to_serve(policy: torch.nn.Module) -> int:
    """Make a generator's policy take what `publication_state` sends (LoRA published merged: plain layers); returns
    how many adapted layers now run as plain ones (0: the policy serves as built)."""
    serve = getattr(policy, "serve_merged", None)
    return serve() if serve is not None else 0


def load_trained_state(policy: torch.nn.Module, weights: Dict[str, torch.Tensor]) -> None:
    """Load what `trained_state` gave, strictly: exactly the tensors `policy` trains (the rest is `model.path`'s)."""
    expected = set(trained_state(policy))
    if set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(
            f"holds other tensors than the policy trains (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    policy.load_state_dict(weights, strict=False)
