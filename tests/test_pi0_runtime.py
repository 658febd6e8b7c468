"""π0 in the runtime: the denoising path a generator's `act` returns (PolicyOutput.replay) travels with the reply
and the segment to the trainer, which evaluates that very path (PolicyInput.replay), so in a sync run the
recomputed log-probs equal the sampling ones (the decoupled correction's behaviour weight is 1). Real local runs
of a tiny random π0 (transformers' PI0ForConditionalGeneration) on the toy task, sync and async; the wire and the
batch round-trips on their own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from runtime_helpers import run_spec

from vlaslurm.algos.batch import collate
from vlaslurm.runtime import messages as msgs
from vlaslurm.spec import load_spec
from vlaslurm.spec.errors import SpecError

CHUNK, DIM, K = 2, 2, 2


def replay(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "path": rng.standard_normal((n, K + 1, CHUNK, 4)).astype(np.float32),
        "steps": rng.integers(0, K, (n, 1)).astype(np.int64),
    }


def segment(steps: int, seed: int) -> msgs.Segment:
    rng = np.random.default_rng(seed)
    return msgs.Segment(
        traj_id=f"0-{seed}-0",
        env_id=seed,
        episode=0,
        index=0,
        task="reach",
        instruction="reach the red cube",
        version=0,
        images=None,
        state=rng.standard_normal((steps + 1, 3)).astype(np.float32),
        actions=rng.standard_normal((steps, CHUNK, DIM)).astype(np.float32),
        logprob=np.zeros((steps, CHUNK), np.float32),
        value=np.zeros(steps, np.float32),
        rewards=np.zeros((steps, CHUNK), np.float32),
        mask=np.ones((steps, CHUNK), bool),
        step_ids=np.arange(steps, dtype=np.int64) * CHUNK,
        versions=np.zeros(steps, np.int64),
        terminated=True,
        truncated=False,
        success=False,
        t_start=0.0,
        t_end=1.0,
        replay=replay(steps, seed),
    )


def test_a_reply_and_a_segment_carry_the_replay_tensors_over_the_wire() -> None:
    reply = msgs.ActReply([3, 4], 0, 1, np.zeros((2, CHUNK, DIM), np.float32), np.zeros((2, CHUNK), np.float32),
                          np.zeros(2, np.float32), replay=replay(2))  # fmt: skip
    back = msgs.decode_act(msgs.encode_act(reply))
    assert back.replay is not None and back.replay.keys() == {"path", "steps"}
    for key, value in reply.replay.items():
        assert np.array_equal(back.replay[key], value) and back.replay[key].dtype == value.dtype
    seg = segment(3, seed=1)
    got = msgs.decode_segment(msgs.encode_segment(seg))
    assert got.replay is not None and all(np.array_equal(got.replay[k], v) for k, v in seg.replay.items())
    plain = msgs.decode_act(msgs.encode_act(msgs.ActReply(**{**reply.__dict__, "replay": None})))
    assert plain.replay is None  # a policy without replay tensors sends none
    short = msgs.encode_act(reply)
    short.arrays["replay.steps"] = short.arrays["replay.steps"][:1]
    with pytest.raises(ValueError, match="replay.steps"):
        msgs.decode_act(short)


def test_the_batch_pads_the_replay_and_hands_each_step_its_own() -> None:
    segments = [segment(3, seed=1), segment(2, seed=2)]
    batch = collate(segments)
    assert batch.tensors["replay.path"].shape == (2, 3, K + 1, CHUNK, 4)
    rows, cols = torch.tensor([0, 1, 1]), torch.tensor([2, 1, 2])  # (1, 2): the bootstrap step past its end
    inp = batch.policy_input(rows, cols)
    assert inp.replay is not None
    assert torch.equal(inp.replay["path"][0], torch.from_numpy(segments[0].replay["path"][2]))
    assert torch.equal(inp.replay["steps"][1], torch.from_numpy(segments[1].replay["steps"][1]))
    assert not inp.replay["path"][2].any()  # padding
    with pytest.raises(ValueError, match="replay"):
        collate([segments[0], msgs.Segment(**{**segments[1].__dict__, "replay": None})])


def spec(mode: str) -> dict:
    return {
        "name": "pi0",
        "env": {"type": "toy", "num_envs": 4, "max_episode_steps": 8, "obs": {"image_size": 56, "cameras": ["top"]}},
        "model": {"type": "pi0", "action_chunk": CHUNK, "denoise_steps": K, "noise_method": "flow_sde"},
        "algo": {"type": "ppo", "lr": 1.0e-4, "steps_per_update": 16, "epochs": 1, "offpolicy_correction": "decoupled"},
        "rollout": {
            "mode": mode,
            "max_staleness": 1,
            "weight_sync": "nccl",
            "total_env_steps": 48,
            "seed": 0,
            "batching": {"max_batch": 8, "max_wait_ms": 5},
        },
        "runtime": {"first_meeting_timeout_s": 120, "timeout_s": 120},
    }


# sync with 2 fsdp trainer ranks: the sharded trainer's recomputed densities must equal the generator's too; async
# with LoRA on PaliGemma: the generator takes the adapters, expert and heads that the trainer publishes
@pytest.mark.parametrize("mode,trainers", [("sync", 2), ("async", 1)])
def test_a_pi0_run_trains_on_the_paths_its_generator_sampled(tmp_path: Path, mode: str, trainers: int) -> None:
    sharded = ["trainer.strategy=fsdp", f"runtime.local_ranks={{simulator: 1, generator: 1, trainer: {trainers}}}"]
    run_spec_ = spec(mode)
    if mode == "async":  # more updates than sync's: arrival order decides when the first new weights serve
        run_spec_["model"]["lora"] = {"rank": 4}
        run_spec_["rollout"]["total_env_steps"] = 96
    run = run_spec(tmp_path, run_spec_, sharded if trainers > 1 else [], name=f"pi0-{mode}", timeout_s=300)
    assert run.rc == 0, run.log("trainer", 0)[-3000:] + run.log("generator", 0)[-2000:]
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    updates = [r for r in rows if "losses/approx_kl" in r]
    assert len(updates) >= 2, rows
    losses = [{k: v for k, v in r.items() if k.startswith("losses/")} for r in updates]
    assert all({"losses/policy_loss", "losses/value_loss"} <= loss.keys() for loss in losses), losses
    assert all(math.isfinite(v) for loss in losses for v in loss.values()), losses  # log-probs, ratios, values
    assert run.ledger["behavior_version"].max() >= 1  # later segments acted by an updated policy
    assert trainers == 1 or "==== trainer[1]" in run.log("trainer", 1)  # the second fsdp rank took part
    if mode == "sync":  # on-policy: the stored paths' density under the weights that sampled them is the sampling one
        weights = [r["losses/is_weight"] for r in updates]  # behaviour vs. recomputed log-prob, exp'd, averaged
        assert all(abs(w - 1.0) < 1e-4 for w in weights) and all(r["losses/is_capfrac"] == 0 for r in updates), weights


@pytest.mark.parametrize(
    "section,key",
    [({"algo": {"type": "ppo", "logprob_level": "token"}}, "algo.logprob_level")],
)  # fmt: skip
def test_plan_refuses_what_a_pi0_trainer_cannot_do(tmp_path: Path, section: dict, key: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**spec("sync"), **section}))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.key == key
