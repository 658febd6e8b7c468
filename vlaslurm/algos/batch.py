"""Segments from the runtime, padded into the tensors an update reads.

Every tensor is [N, ...] over segments; time is padded to the longest segment
(`step_valid` says which decision steps are real). Observations have T+1 rows:
row `length` bootstraps the value unless the segment's episode terminated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from vlaslurm.models.base import PolicyInput


@dataclass
class TrainBatch:
    """The padded tensors of N segments and their instructions.

    A data-parallel trainer rank holds the observations (`is_observation`: images, state, replay tensors), by far
    the largest part, only of the rows it owns (`held`, ascending global row numbers; None: every row); every
    other tensor is whole, indexed by global row."""

    tensors: Dict[str, Tensor]
    instructions: List[str]
    held: Optional[Tensor] = None

    @property
    def size(self) -> int:
        return len(self.instructions)

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch({k: v.to(device) for k, v in self.tensors.items()}, self.instructions, self.held)

    def holding(self, rows: Tensor) -> TrainBatch:
        """This batch with the observations of `rows` (global row numbers) only."""
        rows = torch.unique(rows.cpu())  # sorted, as `_local` needs
        local = self._local(rows)
        tensors = {k: v[local.to(v.device)] if is_observation(k) else v for k, v in self.tensors.items()}
        return TrainBatch(tensors, self.instructions, rows)

    def _local(self, rows: Tensor) -> Tensor:
        """Where global `rows` sit in the observation tensors; a row not held is an error (a sharding bug)."""
        if self.held is None:
            return rows
        held = self.held.to(rows.device)
        at = torch.searchsorted(held, rows).clamp(max=max(len(held) - 1, 0))
        if len(rows) and (not len(held) or bool((held[at] != rows).any())):
            raise ValueError(f"observations of rows {sorted(set(rows.tolist()) - set(held.tolist()))} not held here")
        return at

    def policy_input(self, rows: Tensor, cols: Tensor) -> PolicyInput:
        """Observations at (segment rows[i], step cols[i]); rows are global row numbers."""
        t = self.tensors
        local = self._local(rows)
        images = t["images"][local, cols] if "images" in t else None
        state = t["state"][local, cols] if "state" in t else None
        # T rows, like the actions (the bootstrap observation at T has none: it is evaluated for its value only)
        replay = {
            k[len(REPLAY) :]: v[local, cols.clamp(max=v.shape[1] - 1)] for k, v in t.items() if k.startswith(REPLAY)
        }
        return PolicyInput(images, state, [self.instructions[r] for r in rows.tolist()], replay=replay or None)


REPLAY = "replay."  # the prefix of a replay tensor in TrainBatch.tensors ([N, T, ...], as the segments carried it)
OBSERVATIONS = ("images", "state")


def is_observation(key: str) -> bool:
    """A tensor only the rank that owns a row needs (the policy's input), not one every rank reads whole."""
    return key in OBSERVATIONS or key.startswith(REPLAY)


def collate_replay(segments: Sequence, T: int) -> Dict[str, Tensor]:
    """The segments' replay tensors (`Segment.replay`, what the policy needs to evaluate the actions again: pi0's
    denoising path), padded to T steps: every segment has them or none does (one policy made them all)."""
    found: List[Optional[Dict[str, np.ndarray]]] = [getattr(s, "replay", None) for s in segments]
    if all(r is None for r in found):
        return {}
    carried = [r for r in found if r is not None]
    if len(carried) < len(found):
        raise ValueError("some segments carry replay tensors and others not: one policy acts for a whole run")
    out = {}
    for key, first in carried[0].items():
        padded = np.zeros((len(segments), T, *first.shape[1:]), first.dtype)
        for i, r in enumerate(carried):
            padded[i, : len(r[key])] = r[key]
        out[REPLAY + key] = torch.from_numpy(padded)
    return out


def collate(segments: Sequence) -> TrainBatch:
    """Pad the runtime's `Segment`s into a TrainBatch (on the CPU)."""
    n = len(segments)
    T = max(s.length for s in segments)
    C, A = segments[0].actions.shape[1:]

    def pad(name: str, shape: tuple, dtype, extra: int = 0) -> Optional[np.ndarray]:
        if getattr(segments[0], name) is None:
            return None
        out = np.zeros((n, T + extra, *shape), dtype)
        for i, s in enumerate(segments):
            value = getattr(s, name)
            out[i, : len(value)] = value
        return out

    first = segments[0]
    # per-token behaviour log-probs only if every segment has them (a policy either gives them or not)
    tokens = all(getattr(s, "token_logprob", None) is not None for s in segments)
    arrays = {
        "images": pad("images", first.images.shape[1:], np.uint8, 1) if first.images is not None else None,
        "state": pad("state", first.state.shape[1:], np.float32, 1) if first.state is not None else None,
        "actions": pad("actions", (C, A), np.float32),
        "logprob": pad("logprob", (C,), np.float32),
        "token_logprob": pad("token_logprob", (C, A), np.float32) if tokens else None,
        "value": pad("value", (), np.float32),
        "rewards": pad("rewards", (C,), np.float32),
        "mask": pad("mask", (C,), bool),
        "step_ids": pad("step_ids", (), np.int64),
        "length": np.asarray([s.length for s in segments], np.int64),
        "terminated": np.asarray([s.terminated for s in segments], bool),
        "truncated": np.asarray([s.truncated for s in segments], bool),
        "group": np.asarray([s.meta.get("group", i) for i, s in enumerate(segments)], np.int64),
        "env_id": np.asarray([s.env_id for s in segments], np.int64),
        "episode": np.asarray([s.episode for s in segments], np.int64),
        "success": np.asarray([s.success for s in segments], bool),
    }
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items() if v is not None}
    tensors.update(collate_replay(segments, T))
    tensors["step_valid"] = torch.arange(T)[None, :] < tensors["length"][:, None]
    return TrainBatch(tensors, [s.instruction for s in segments])


@dataclass
class EpisodeLayout:
    """Where each decision step of a batch sits in its episode, and the episodes' groups.

    Episodes are keyed by (env_id, episode); a group is the episodes of environments
    `env_id // group_size` with the same episode number (GRPO: the simulator resets them from one seed).
    """

    episode: Tensor  # long [N]: each segment's episode, 0..E-1
    chunk: Tensor  # long [N, T]: index of each decision step within its episode
    group: Tensor  # long [E]: each episode's group, 0..G-1
    success: Tensor  # bool [E]
    usable: Tensor  # bool [E]: the episode is complete and so is its group (group_size complete episodes)
    max_chunks: int

    @property
    def num_episodes(self) -> int:
        return len(self.group)


def episode_layout(batch: TrainBatch, group_size: int) -> EpisodeLayout:
    """Assemble a batch's segments into episodes (segments of one episode may come in pieces, cut when
    the behaviour version changed or at the length cap, in any order)."""
    t = batch.tensors
    # Env steps per decision: the chunk, or the first `model.execute_actions` of it. Every decision of an episode
    # but its last runs them all, and a GRPO batch holds whole episodes, so the longest decision here has it.
    chunk_size = max(int(t["mask"].sum(-1).max()), 1) if t["mask"].numel() else t["actions"].shape[2]
    keys, episode = torch.unique(torch.stack([t["env_id"], t["episode"]], 1), dim=0, return_inverse=True)
    E = len(keys)
    chunk = torch.div(t["step_ids"], chunk_size, rounding_mode="floor")
    last = torch.where(t["step_valid"], chunk, torch.full_like(chunk, -1)).amax(-1)  # [N]
    ends = torch.zeros(E, dtype=torch.long, device=episode.device).scatter_reduce_(
        0, episode, last, "amax", include_self=False
    )
    covered = torch.zeros(E, dtype=torch.long, device=episode.device).index_add_(0, episode, t["length"])
    ended = (t["terminated"] | t["truncated"]).long()
    done = torch.zeros(E, dtype=torch.long, device=episode.device).index_add_(0, episode, ended) > 0
    success = torch.zeros(E, dtype=torch.long, device=episode.device).index_add_(0, episode, t["success"].long()) > 0
    complete = done & (covered == ends + 1)
    _, group = torch.unique(
        torch.stack([torch.div(keys[:, 0], group_size, rounding_mode="floor"), keys[:, 1]], 1),
        dim=0,
        return_inverse=True,
    )
    groups = int(group.max()) + 1 if E else 0
    members = torch.zeros(groups, dtype=torch.long, device=episode.device).index_add_(0, group, complete.long())
    usable = complete & (members[group] == group_size)
    return EpisodeLayout(episode, chunk, group, success, usable, int(ends.max()) + 1 if E else 0)


def encode_strings(strings: List[str]) -> Tensor:
    """UTF-8 strings as a padded uint8 tensor (for broadcasting to data-parallel ranks)."""
    raw = [s.encode() for s in strings]
    out = torch.zeros(len(raw), max((len(r) for r in raw), default=0) + 1, dtype=torch.uint8)
    for i, r in enumerate(raw):
        out[i, : len(r)] = torch.frombuffer(bytearray(r), dtype=torch.uint8) if r else out[i, :0]
    return out


def decode_strings(tensor: Tensor) -> List[str]:
    return [bytes(row[row != 0].tolist()).decode() for row in tensor]
