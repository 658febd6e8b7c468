"""The one interface every simulator adapter implements.

A `VecEnv` holds many environment instances. Instances are addressed by their
local index, so the runtime can step or reset any subset: a finished instance
resets alone (partial reset) and, in async mode, instances step independently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, TypeVar, Union

import numpy as np

T = TypeVar("T")

EnvIds = Union[Sequence[int], np.ndarray]  # local instance indices: a sequence or a 1-d integer array


def tasks_of(tasks: Sequence[T], first_gid: int, num_envs: int, group_size: int = 1) -> List[T]:
    """The task of each instance `first_gid + i`: tasks take turns by GRPO group (`gid // group_size`),
    so the instances of one group, which reset from one seed, also play one task."""
    return [tasks[((first_gid + i) // group_size) % len(tasks)] for i in range(num_envs)]


def listed_seed(seeds: Sequence[int], group: int, episode: int, groups: int) -> int:
    """`env.reset_seeds`' seed of a group's `episode`-th episode: episode i = episode x groups + group resets with
    seeds[i mod len], so the first round of episodes takes the first `groups` seeds, the next the following ones."""
    return int(seeds[(episode * groups + group) % len(seeds)])


@dataclass
class Observation:
    """Observations of `n` instances (the ones that were asked for, in that order)."""

    images: Optional[np.ndarray]  # uint8 [n, cameras, H, W, 3]; None when the spec asks for no images
    state: Optional[np.ndarray]  # float32 [n, state_dim]; None when the spec asks for no state
    instructions: List[str]  # one language instruction per instance

    def __len__(self) -> int:
        return len(self.instructions)


@dataclass
class StepResult:
    """What one step of `n` instances returns.

    For an instance whose episode ended (terminated or truncated), `obs` holds
    its final observation, so that PPO can bootstrap a truncated episode from
    it; the runtime then resets that instance explicitly.
    """

    obs: Observation
    reward: np.ndarray  # float32 [n]
    terminated: np.ndarray  # bool [n]: the task ended (success or failure)
    truncated: np.ndarray  # bool [n]: the time limit cut the episode
    success: np.ndarray  # bool [n]


class VecEnv(Protocol):
    """Many instances of one simulator in one process."""

    num_envs: int
    action_dim: int
    state_dim: int
    tasks: List[str]  # task name of each instance
    thread_safe: bool  # whether disjoint subsets may be stepped from different threads at once
    # whether part of a step runs on one device that concurrent calls queue for (a GPU simulator stepped from
    # threads); the placement profiler then measures that part (contention for CPU cores is not such a part)
    shared_device: bool

    def reset(self, env_ids: EnvIds, seeds: Optional[Sequence[int]] = None) -> Observation:
        """Start new episodes in `env_ids` (seeded when `seeds` is given) and observe them."""

    def step(self, env_ids: EnvIds, actions: np.ndarray) -> StepResult:
        """Apply one action per instance (`actions` is float32 [len(env_ids), action_dim])."""

    def close(self) -> None:
        """Release simulator resources."""
