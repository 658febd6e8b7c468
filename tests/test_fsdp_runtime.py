"""trainer.strategy fsdp in the runtime: the spec's rules, the bucketed gather that publishes from shards (bit for
bit a replicated trainer's weights in fp32, one bucket of full tensors at a time), rank 0's command, and real local
runs: an interrupted sync run resumed from its sharded checkpoint ends where an uninterrupted one does, an async bf16
run completes (rank 0's command among segments that arrive in any order; that the sharded update learns as a
replicated one does follows from test_fsdp_learner's equality). Real torch.distributed (gloo) in spawned processes
and real runs."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from learner_helpers import algo_config, rollout_segments, tiny_policy
from process_helpers import start_ranks
from runtime_helpers import run_spec
from test_checkpoint_resume import final, run_interrupted, toy_ppo_spec

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.algos.sharding import ShardedDataParallel, shard_policy
from vlaslurm.models import trained_state
from vlaslurm.rundir import read_info
from vlaslurm.runtime import checkpoint as ckpt
from vlaslurm.runtime.local import resume_local
from vlaslurm.runtime.sharded import Command, gather_full_state, receive_command, send_command, send_meta
from vlaslurm.runtime.signals import REQUEUE_EXIT
from vlaslurm.spec import load_spec
from vlaslurm.spec.trainer_types import TrainerSpec, fsdp_problem

WORLD = 2
BUCKET = 64 * 1024  # small enough that the tiny policy takes several buckets
QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml"
FSDP_2 = ["runtime.local_ranks={simulator: 1, generator: 1, trainer: 2}", "trainer.strategy=fsdp"]


# --- the spec's rules ---------------------------------------------------------------------------------------------


def test_fsdp_rules_name_the_field():
    fsdp = TrainerSpec(strategy="fsdp", replicas=2)
    assert fsdp_problem(fsdp, 4, "disaggregated") is None
    field, message = fsdp_problem(fsdp, 3, "disaggregated") or ("", "")
    assert field == "trainer.replicas" and "trainer ranks, 3" in message
    assert "collocated" in (fsdp_problem(fsdp, 4, "collocated") or ("", ""))[1]
    field, message = fsdp_problem(TrainerSpec(mixed_precision="bf16"), 1, "disaggregated") or ("", "")
    assert field == "trainer.mixed_precision" and "strategy: fsdp" in message
    assert fsdp_problem(TrainerSpec(), 3, "collocated") is None  # replicate as before
    bf16 = TrainerSpec(strategy="fsdp", mixed_precision="bf16")  # the float32 heads stay float32 (sharding.py)
    assert fsdp_problem(bf16, 2, "disaggregated") is None


def test_the_spec_takes_the_fsdp_fields():
    overrides = ["trainer.strategy=fsdp", "trainer.mixed_precision=fp32", "trainer.activation_checkpointing=true"]
    spec = load_spec(QUICKSTART, overrides).spec
    assert (spec.trainer.strategy, spec.trainer.mixed_precision, spec.trainer.activation_checkpointing) == (
        "fsdp",
        "fp32",
        True,
    )


def test_the_loader_counts_the_trainer_ranks_the_job_starts(tmp_path: Path):
    """hybrid: one trainer rank per GPU of the rollout roles (the plan's count), whatever resources.trainer says."""
    spec = tmp_path / "hybrid.yaml"
    spec.write_text(
        "name: h\nenv: {type: synthetic, num_envs: 8}\nmodel: {type: synthetic}\nalgo: {type: synthetic}\n"
        "rollout: {mode: sync}\nresources: {layout: hybrid, simulator: {gpus_per_node: 1}, "
        "generator: {gpus_per_node: 1}}\ntrainer: {strategy: fsdp, replicas: 2}\n"
    )
    assert load_spec(spec).spec.trainer.replicas == 2  # 2 trainer ranks: 2 replicas of 1 shard each


# --- gathers and commands on 2 gloo ranks -------------------------------------------------------------------------


def _rank(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        batch = torch.load(f"{tmp}/batch.pt", weights_only=False)
        # Clipping inactive: its norm sums squares in another order over shards than over whole tensors, which
        # moves the last bit of every update (about 3e-8 here); each rank's gradients and their sum are the same.
        cfg = algo_config("ppo", "action")
        cfg.max_grad_norm = 1e9
        replicated = tiny_policy(seed=3)
        make_learner(cfg, replicated, DataParallel(dist.group.WORLD, rank, WORLD), 7).update(batch, version=5)
        world = dist.group.WORLD
        assert world is not None
        sharded = shard_policy(tiny_policy(seed=3), group=world)
        make_learner(cfg, sharded, ShardedDataParallel(world, rank, WORLD), 7).update(batch, version=5)
        seen: list = []
        gathered = gather_full_state(sharded, BUCKET, keep=rank == 0, observe=seen.append)
        shard_bytes = _trained_shard_bytes(sharded)
        if rank == 0:
            send_command(Command(publish=True, checkpoint="/x/.tmp-v1"), dist.group.WORLD, 0)
            send_meta({"version": 1, "keepalive": True}, dist.group.WORLD, 0)
            torch.save({"replicated": trained_state(replicated), "gathered": gathered}, f"{tmp}/weights.pt")
        else:
            command = receive_command(dist.group.WORLD, 0)
            try:
                receive_command(dist.group.WORLD, 0)
                refused = ""
            except RuntimeError as error:
                refused = str(error)
            torch.save({"command": command, "refused": refused, "gathered": gathered}, f"{tmp}/follower.pt")
        torch.save({"buckets": seen, "shard": shard_bytes}, f"{tmp}/sizes-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _trained_shard_bytes(policy: torch.nn.Module) -> int:
    """This rank's part of what trains (what a gather publishes; the frozen embeddings are not gathered)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in trained_state(policy).values()]
    return sum(t.numel() * t.element_size() for t in local)


@pytest.fixture(scope="module")
def ranked(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fsdp-runtime")
    segments = rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, version_every=3)
    torch.save(collate(segments), tmp / "batch.pt")
    start_ranks(_rank, (str(tmp),), WORLD)
    return tmp


def test_gathered_weights_equal_a_replicated_trainer_bit_for_bit(ranked: Path):
    weights = torch.load(ranked / "weights.pt", weights_only=False)
    replicated, gathered = weights["replicated"], weights["gathered"]
    assert list(gathered) == list(replicated)  # the publisher's names and order, as a replicated trainer's
    for name, value in replicated.items():
        assert gathered[name].device.type == "cpu" and gathered[name].dtype == torch.float32
        assert torch.equal(gathered[name], value), name
    assert torch.load(ranked / "follower.pt", weights_only=False)["gathered"] == {}  # only rank 0 keeps them


def test_a_gather_holds_one_bucket_beyond_the_shard(ranked: Path):
    trained = trained_state(tiny_policy(seed=3)).values()
    largest = max(t.numel() * t.element_size() for t in trained)
    total = sum(t.numel() * t.element_size() for t in trained)
    for rank in range(WORLD):
        sizes = torch.load(ranked / f"sizes-{rank}.pt")
        assert len(sizes["buckets"]) > 3 and sum(sizes["buckets"]) == total
        assert max(sizes["buckets"]) <= max(BUCKET, largest)  # the most full tensors alive at once
        assert sizes["shard"] <= 0.55 * total  # and the rank's own part is about half


def test_the_command_reaches_the_followers_and_anything_else_is_refused(ranked: Path):
    follower = torch.load(ranked / "follower.pt", weights_only=False)
    assert follower["command"] == Command(publish=True, checkpoint="/x/.tmp-v1", final=False)
    assert "keepalive" in follower["refused"]


# --- real local runs ----------------------------------------------------------------------------------------------


def test_an_interrupted_fsdp_run_resumes_from_its_sharded_checkpoint_to_the_same_parameters(tmp_path: Path):
    spec = toy_ppo_spec()
    whole = run_spec(tmp_path, spec, FSDP_2, name="whole", timeout_s=180)
    assert whole.rc == 0, whole.log("trainer", 0)[-3000:]
    cut = run_interrupted(tmp_path, spec, FSDP_2, after_version=3, sig=signal.SIGUSR2)
    assert cut.rc == REQUEUE_EXIT, cut.log("trainer", 0)[-3000:]
    saved = ckpt.latest(cut.run_dir)
    assert saved is not None and ckpt.is_sharded(saved)
    assert {"__0_0.distcp", "__1_0.distcp"} <= {e.path for e in ckpt.verify(saved, ckpt.SHARDED_REQUIRED)}
    rc = resume_local(read_info(cut.run_dir), echo=False, timeout_s=180)
    assert rc == 0, cut.log("trainer", 0)[-3000:]
    assert final(cut.run_dir) == final(whole.run_dir)  # same version count, same parameter checksum
    assert f"resumed from checkpoint {saved}" in cut.log("trainer", 1)  # every rank loads its shards
    assert (cut.run_dir / "final_model").is_dir()


def test_vlaslurm_resume_continues_a_sharded_run_on_another_trainer_rank_count_and_longer(tmp_path: Path):
    """A run stopped with 2 fsdp trainer ranks resumes through the command line on 1, told to go on to 8 versions
    instead of 6: the one rank loads both ranks' shards (DCP reshards). A field that shaped the checkpoint and its
    samples is refused, naming it, and changes nothing."""
    from conftest import vlaslurm

    cut = run_interrupted(tmp_path, toy_ppo_spec(), FSDP_2, after_version=3, sig=signal.SIGUSR2)
    assert cut.rc == REQUEUE_EXIT, cut.log("trainer", 0)[-3000:]
    saved = ckpt.latest(cut.run_dir)
    assert saved is not None and ckpt.is_sharded(saved)
    spec_before = (cut.run_dir / "spec.yaml").read_text()

    refused = vlaslurm("resume", str(cut.run_dir), "rollout.seed=5", "--local", runs_root=tmp_path / "runs")
    assert refused.returncode == 2 and "rollout.seed" in refused.stderr and "cannot change" in refused.stderr
    assert (cut.run_dir / "spec.yaml").read_text() == spec_before

    changes = ["runtime.local_ranks.trainer=1", f"rollout.total_env_steps={32 * 8}"]
    resumed = vlaslurm("resume", str(cut.run_dir), *changes, "--local", runs_root=tmp_path / "runs", timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:] + cut.log("trainer", 0)[-3000:]
    assert final(cut.run_dir)["versions"] == 8
    assert f"resumed from checkpoint {saved}" in cut.log("trainer", 0)
    assert cut.log("trainer", 1).count("==== trainer[1]") == 1  # rank 1 ran only in the first attempt
    assert (cut.run_dir / "spec-before-resume-1.yaml").read_text() == spec_before
    resolved = load_spec(cut.run_dir / "spec.yaml").spec
    assert resolved.runtime.local_ranks["trainer"] == 1 and resolved.rollout.total_env_steps == 256
    assert read_info(cut.run_dir).ranks["trainer"] == 1


def test_an_async_bf16_fsdp_run_completes_and_saves_float32_weights(tmp_path: Path):
    from safetensors.torch import load_file

    overrides = [*FSDP_2, "trainer.mixed_precision=bf16", "rollout.mode=async", "rollout.weight_sync=nccl"]
    run = run_spec(tmp_path, toy_ppo_spec(versions=4), overrides, timeout_s=180)
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    assert final(run.run_dir)["versions"] >= 2  # async: how many updates the env steps make depends on arrival
    served = run.ledger["behavior_version"]
    assert served.max() >= 1, "no segment was played by weights the sharded trainer gathered and published"
    saved = load_file(str(run.run_dir / "final_model" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}  # gathered from the float32 master shards
