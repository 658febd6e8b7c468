"""Task assignment: tasks take turns by GRPO group, so the instances of a group (which reset from one
seed) also play one task, and every task gets groups; ranks continue where the previous rank ended."""

from __future__ import annotations

from vlaslurm.envs import make_env, tasks_of
from vlaslurm.spec.env_types import SyntheticEnvConfig


def test_tasks_take_turns_by_group():
    assert tasks_of("ab", 0, 8, group_size=4) == list("aaaabbbb")
    assert tasks_of("ab", 8, 4, group_size=2) == list("aabb")  # rank 2 of 4 instances: groups 4 and 5
    assert tasks_of("abc", 0, 4) == list("abca")  # no groups: instance by instance, as before


def test_adapters_give_each_group_one_task():
    # The synthetic env here; the LIBERO and RoboTwin adapters in tests/test_experiments_slurm.py's jobs.
    config = SyntheticEnvConfig(type="synthetic", tasks=["a", "b"])
    ranks = [make_env(config, num_envs=8, rank=r, seed=0, group_size=4) for r in range(2)]
    tasks = [t for env in ranks for t in env.tasks]
    groups = [set(tasks[g : g + 4]) for g in range(0, 16, 4)]
    assert all(len(g) == 1 for g in groups), groups
    assert [g.pop() for g in groups] == config.tasks * 2
