"""Every combination of the learner's choices that `plan` accepts also trains: algo type x logprob_level x
value_level (PPO) / advantage (GRPO) x offpolicy_correction, the full product (45 specs), with entropy_level
assigned as a Latin square over it (index sum mod 3), so that every entropy_level meets every value of every
other choice (all pairs), and the KL penalty on in half of them; each loaded as `plan` loads it and then updated
once in-process on a real rollout batch. What plan refuses it refuses naming an algo field; no
NotImplementedError or other error may come from a spec it accepts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from learner_helpers import rollout_segments, tiny_policy

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.spec import load_spec
from vlaslurm.spec.errors import SpecError

LEVELS = ("token", "action", "chunk")
CORRECTIONS = ("none", "decoupled", "tis")


def with_pairs(algo: dict, i: int, j: int, k: int) -> dict:
    """`algo` (the (i, j, k)-th of its product) with its entropy_level (Latin square) and kl_coef."""
    return {**algo, "entropy_level": LEVELS[(i + j + k) % 3], "kl_coef": 0.1 if (i + k) % 2 == 0 else 0.0}


CHOICES = [
    *(
        with_pairs({"type": "ppo", "logprob_level": lv, "value_level": vl, "offpolicy_correction": c}, i, j, k)
        for (i, lv), (j, vl), (k, c) in itertools.product(
            enumerate(LEVELS), enumerate(("action", "chunk")), enumerate(CORRECTIONS)
        )
    ),
    *(
        with_pairs(
            {"type": "grpo", "group_size": 2, "logprob_level": lv, "advantage": adv, "offpolicy_correction": c},
            i,
            j,
            k,
        )
        for (i, lv), (j, adv), (k, c) in itertools.product(
            enumerate(LEVELS), enumerate(("chunk", "step", "episode")), enumerate(CORRECTIONS)
        )
    ),
]


def test_entropy_level_meets_every_other_choice():
    for kind in ("ppo", "grpo"):
        rows = [a for a in CHOICES if a["type"] == kind]
        for key in ("logprob_level", "value_level" if kind == "ppo" else "advantage", "offpolicy_correction"):
            values = {a[key] for a in rows}
            pairs = {(a[key], a["entropy_level"]) for a in rows}
            assert pairs == set(itertools.product(values, LEVELS)), (kind, key)
        assert {(a["logprob_level"], a["kl_coef"] > 0) for a in rows} == set(itertools.product(LEVELS, (True, False)))


@pytest.fixture(scope="module")
def batch():
    # two versions, so decoupled and tis corrections see stale samples; groups of two for GRPO
    return collate(rollout_segments(tiny_policy(seed=1), num_envs=4, chunks=4, group_size=2, version_every=2))


def spec_file(tmp_path: Path, algo: dict) -> Path:
    spec = {
        "name": "combo",
        "env": {"type": "toy", "num_envs": 4, "obs": {"image_size": 32, "cameras": ["top"], "state": True}},
        "model": {"type": "openvla-oft", "action_chunk": 4, "action_dim": 2},
        "algo": {"lr": 1e-4, "epochs": 1, "minibatches": 2, "steps_per_update": 32, **algo},
    }
    path = tmp_path / "combo.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_every_accepted_learner_combination_trains(tmp_path, batch):
    refused, trained = [], 0
    for algo in CHOICES:
        try:
            loaded = load_spec(spec_file(tmp_path, algo))
        except SpecError as err:
            assert err.key.startswith("algo."), (algo, str(err))
            refused.append(algo)
            continue
        learner = make_learner(loaded.spec.algo, tiny_policy(seed=3), DataParallel(None, 0, 1), 7, loaded.spec.trainer)
        learner.update(batch, version=2)
        trained += 1
    # what plan refuses is exactly the one combination that cannot work: per-action values with a chunk ratio
    assert all(a["type"] == "ppo" and a["value_level"] == "action" and a["logprob_level"] == "chunk" for a in refused)
    assert len(refused) == len(CORRECTIONS) and trained == len(CHOICES) - len(refused)
