"""The tiny openvla-oft policy learns the toy task through the real runtime (`run_local`: every role its own
process), with a fixed seed, in sync and in async mode:

- PPO's success rises above 0.5 (going to the nearest object while ignoring the instruction gives 31-33%);
- GRPO's rises to at least 3x the random policy's success, measured here on the same env settings.

The bars are the issue's. The budgets (env steps) come from the spread over seeds in benchmarks/learning_curves.py,
whose settings these are: first with the look-alike policies (results/learning_curves.md: PPO sync 0.59-0.94 by 40k,
async 0.86-0.92 by 45k, GRPO sync 0.17-0.53 and async 0.26-0.68 by 50k, seeds 0-4), then with the tiny
configuration of the release's classes that replaced them (results/learning_curves_tiny/, seeds 0-1: PPO sync 0.95 /
0.61 by 40k, async 0.86 / 0.60 by 45k, GRPO sync 0.28 / 0.13 and async 0.37 / 0.21 by 50k; the GRPO bar is ~0.14).
PPO learns with a value per executed action (`algo.value_level: action`, RLinf-VLA's finding): it reaches the bar
at ~2/3 of the env steps a value per chunk needs.
GRPO and LoRA run a narrower language model (`NARROW`: width 64, MLP 128; an update ~half the cost) that learned
as the default width does there (these tests' settings, seeds 0 / 1: GRPO sync 0.28 / 0.13, async 0.43 / 0.42 by
50k; LoRA 0.81 / 0.88 by 30k). PPO keeps the quickstart's width: narrow, it reached 0.69 / 0.60 sync and 0.56 /
0.67 async, too close to its bar; it takes 2 epochs of 8 minibatches instead (`HALF_EPOCHS`: as many optimizer
steps of half the size, so an update costs about half): seeds 0 / 1 reached 0.93 / 0.57 sync and 0.77 / 0.67 async by
50k (with 4 epochs of 4: 0.95 / 0.61 by 40k and 0.86 / 0.60 by 45k), a run ~20% shorter (sync alone: 74 s against
94 s); 2 epochs of 4 learned far less (0.52 sync by 60k). Sync runs repeat under a seed; async runs are not reproducible
(arrival order sets batches and versions), so a fixed seed does not fix their outcome.
Success is the best success rate over the episodes of 3 consecutive progress reports (each over the episodes since
the one before; ~6k env steps): the success a run sustained. Not the last 3: async PPO can collapse late in one update
after learning (a known defect, docs/algorithms.md: 3 of 6 async runs beside other load, e.g. 0.77 then 0.33 in four
updates, after the approx_kl of one update spiked past 100), which the bar on learning would then report as not
learning. Each run ends once it sustains its bar (`rollout.stop_at_success` over the same 3 reports, a little above
the bar): the budget is the most a run may take, and a run that learns is not run on to it (the suite's heaviest
tests, ~1/3 shorter).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
from runtime_helpers import run_spec

from vlaslurm.envs.toy import baseline_success

pytestmark = pytest.mark.slow

WINDOW = 3  # progress reports (`sustained_success`)
# Async PPO's budget is 60k: one run of the suite (2026-12-08, quiet machine) sustained 0.49 by 50k, where two
# runs of the same code after it reached the stop (0.55) in about half the steps; a run that learns stops early,
# so the larger budget costs time only in a slow run.
PPO_STEPS = {"sync": 50_000, "async": 60_000}
GRPO_STEPS = {"sync": 50_000, "async": 50_000}
LORA_STEPS = 30_000
PPO_STOP = 0.55  # the runs' early end: past the bar of 0.5


NARROW = ["model.backbone.hidden_size=64", "model.backbone.intermediate_size=128"]  # the GRPO and LoRA runs
HALF_EPOCHS = ["algo.epochs=2", "algo.minibatches=8"]  # the PPO runs: as many optimizer steps, half the samples


def toy_spec(algo: dict, mode: str, total_env_steps: int) -> dict:
    return {
        "name": "learn",
        "env": {
            "type": "toy",
            "num_envs": 64,
            "max_episode_steps": 24,
            "obs": {"image_size": 32, "cameras": ["top"], "state": True},
        },
        "model": {"type": "openvla-oft", "action_chunk": 4, "action_dim": 2},
        "algo": {
            "lr": 3.0e-4,
            "steps_per_update": 2048,
            "epochs": 4,
            "minibatches": 4,
            "logprob_level": "action",
            **algo,
        },
        "rollout": {
            "mode": mode,
            "max_staleness": 1,
            "stale_policy": "hold",
            "weight_sync": "nccl",
            "total_env_steps": total_env_steps,
            "seed": 0,
            "batching": {"max_batch": 64, "max_wait_ms": 5},
        },
        "resources": {
            "layout": "disaggregated",
            "simulator": {"nodes": 1},
            "generator": {"nodes": 1},
            "trainer": {"nodes": 1},
        },
        "runtime": {"first_meeting_timeout_s": 120, "timeout_s": 120},
    }


PPO = {"type": "ppo", "gamma": 0.99, "gae_lambda": 0.8, "value_level": "action"}
# The benchmark's GRPO settings (its clip too). 16 distinct starts per update learned ~2x faster than 8
# groups of 8. The toy reward is shaped: dense chunk credit and every group kept (the defaults before issue 17);
# the paper's outcome advantage reached 0.10 by 60k env steps in sync mode (filter off; 0.07 with its
# [0.1, 0.9] filter, which drops the early all-fail groups' shaped signal).
GRPO = {"type": "grpo", "group_size": 4, "advantage": "chunk", "success_filter": [0.0, 1.0], "clip": [0.2, 0.2]}


def sustained_success(run_dir: Path) -> float:
    """The best success rate over the episodes of WINDOW consecutive progress reports (that saw any)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seen = [(r["rollout/success_rate"] * r["rollout/episodes"], r["rollout/episodes"]) for r in rows]
    wins, episodes = np.asarray([pair for pair in seen if pair[1] > 0]).reshape(-1, 2).T
    assert len(wins) >= WINDOW, f"the run reported finished episodes {len(wins)} times"
    spans = range(len(wins) - WINDOW + 1)
    return max(float(wins[i : i + WINDOW].sum() / episodes[i : i + WINDOW].sum()) for i in spans)


@pytest.fixture(scope="module")
def random_rate() -> float:
    return baseline_success("random", episodes=2048, seed=0)[0]


def run_toy(
    tmp_path: Path, algo: dict, mode: str, total_env_steps: int, stop_at: float, overrides: Sequence[str] = ()
) -> float:
    """The run's sustained success; it ends sooner once it sustains `stop_at`."""
    spec = toy_spec(algo, mode, total_env_steps)
    stop = [f"rollout.stop_at_success={stop_at}", f"rollout.stop_window={WINDOW}"]
    run = run_spec(tmp_path, spec, [*overrides, *stop], name=f"{algo['type']}-{mode}", timeout_s=900)
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    return sustained_success(run.run_dir)


# One replicated trainer rank in both modes, as in the benchmark whose spread sets the budgets: a sharded trainer's
# update equals a replicated one's (test_fsdp_learner) and an async fsdp run completes (test_fsdp_runtime), so
# learning on 2 fsdp ranks (0.78 at 70k when this test ran it) is not run again here.
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ppo_learns_to_use_the_instruction(tmp_path: Path, mode: str):
    success = run_toy(tmp_path, PPO, mode, PPO_STEPS[mode], PPO_STOP, overrides=HALF_EPOCHS)
    assert success > 0.5, f"PPO ({mode}) success {success:.2f} after {PPO_STEPS[mode]} env steps"


def test_ppo_with_lora_learns_to_use_the_instruction(tmp_path: Path):
    """`model.lora` over the random init (the adapters, the heads and the random vision stem train) at lr 1e-3:
    the test's measure then (the mean of the last 3 reports) by 30k was 0.92 (seed 0) and 0.81 (seed 1; 0.43 by
    26k) at the default width, 0.81 / 0.88 narrow (`NARROW`, as run here); with the stem frozen at random, LoRA
    stayed at 0.11-0.16 by 60k."""
    overrides = ["model.lora.rank=16", "model.lora.alpha=16", "algo.lr=1e-3", *NARROW]
    success = run_toy(tmp_path, PPO, "sync", LORA_STEPS, PPO_STOP, overrides=overrides)
    assert success > 0.5, f"PPO with LoRA success {success:.2f} after {LORA_STEPS} env steps"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_beats_random_threefold(tmp_path: Path, mode: str, random_rate: float):
    success = run_toy(tmp_path, GRPO, mode, GRPO_STEPS[mode], math.ceil(3 * random_rate * 1000) / 1000, NARROW)
    assert success >= 3 * random_rate, f"GRPO ({mode}) success {success:.2f}, random {random_rate:.3f}"


def test_random_rate_is_low(random_rate: float):
    assert random_rate <= 0.2  # the bar on the task itself
