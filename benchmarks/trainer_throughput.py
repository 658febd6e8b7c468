"""Trainer update throughput and peak memory per rank: `trainer.strategy` replicate vs fsdp, at 1 and 2 ranks.

One PPO update (the learner tests' settings: 2 epochs x 3 minibatches, lr 1e-3) of the tiny random-init openvla-oft
on real runtime segments of the toy task (tests/learner_helpers.py: 8 envs x 9 chunks = 72 decision steps), on
ranks spawned here: gloo on CPU, or `--device cuda` (nccl, one GPU per rank) for the GPU run. `samples_per_s` = the
decision steps of one update / the median update time after a warm-up update. Memory per rank:

- `state_mib`: the bytes of the tensors the rank keeps between updates (its parameters, gradients, Adam state;
  its shards under fsdp), counted from the tensors;
- `peak_mib`: on cuda `torch.cuda.max_memory_allocated` over the timed updates; on CPU the growth of the
  process's peak resident set from before the model was built (coarse: the allocator keeps freed pages).

    python benchmarks/trainer_throughput.py                 # CPU, writes benchmarks/results/trainer_throughput.md
    python benchmarks/trainer_throughput.py --device cuda --updates 5 --out /tmp/gpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the learner tests' real segments and tiny policy

RESULTS = REPO / "benchmarks" / "results"
MiB = 2.0**20


def _bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """This rank's parameters, gradients and optimizer state (local shards of DTensors)."""
    params = sum(_bytes(p) for p in policy.parameters())
    grads = sum(_bytes(p.grad) for p in policy.parameters() if p.grad is not None)
    moments = sum(_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0)
    return params + grads + moments


def _rank(rank: int, world: int, strategy: str, args: argparse.Namespace, tmp: str) -> None:
    from learner_helpers import algo_config, tiny_policy

    from vlaslurm.algos.learners import DataParallel, make_learner
    from vlaslurm.algos.sharding import ShardedDataParallel, shard_policy

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend, device_id = ("nccl", device) if cuda else ("gloo", None)
    dist.init_process_group(
        backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world, device_id=device_id
    )
    try:
        batch = torch.load(f"{tmp}/batch.pt", weights_only=False).to(device)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        policy = tiny_policy(seed=3).to(device)
        group = dist.group.WORLD
        assert group is not None
        if strategy == "fsdp":
            policy = shard_policy(policy, group)
            dp: DataParallel = ShardedDataParallel(group, rank, world)
        else:
            dp = DataParallel(group, rank, world)
        learner = make_learner(algo_config("ppo", "action"), policy, dp, 7)
        learner.update(batch, version=1)  # warm-up: allocations, Adam's state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        seconds: List[float] = []
        for version in range(2, 2 + args.updates):
            dist.barrier()
            began = time.perf_counter()
            learner.update(batch, version=version)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
        peak = (
            torch.cuda.max_memory_allocated(device)
            if cuda
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024  # ru_maxrss: KiB
        )
        figures = {"seconds": seconds, "state_bytes": state_bytes(policy, learner.opt), "peak_bytes": peak}  # type: ignore[attr-defined]
        Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def measure(strategy: str, world: int, args: argparse.Namespace, batch: Any) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(batch, f"{tmp}/batch.pt")
        mp.start_processes(_rank, args=(world, strategy, args, tmp), nprocs=world, start_method="spawn", join=True)
        ranks = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(world)]
    # the update ends when its slowest rank does
    update_s = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(args.updates))
    steps = int(batch.tensors["step_valid"].sum())
    return {
        "strategy": strategy,
        "ranks": world,
        "decision_steps": steps,
        "update_s": update_s,
        "samples_per_s": steps / update_s,
        "state_mib": max(r["state_bytes"] for r in ranks) / MiB,
        "peak_mib": max(r["peak_bytes"] for r in ranks) / MiB,
    }


def make_batch() -> Any:
    from learner_helpers import rollout_segments, tiny_policy

    from vlaslurm.algos.batch import collate

    return collate(rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, group_size=4, version_every=3))


def report(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    load = os.getloadavg()[0]
    head = (
        f"# Trainer update throughput: replicate vs fsdp\n\nGenerated by `benchmarks/trainer_throughput.py` on "
        f"{os.uname().nodename} ({os.cpu_count()} CPUs, load average {load:.1f} at the end), device {args.device}, "
        f"{args.updates} timed updates after one warm-up, {args.threads} torch thread(s) per rank. One PPO update "
        "of the tiny random-init openvla-oft (2 epochs x 3 minibatches) on 72 decision steps of the toy task.\n\n"
        "| strategy | ranks | update s (median) | samples/s | state MiB per rank | peak MiB per rank |\n"
        "|---|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['strategy']} | {r['ranks']} | {r['update_s']:.3f} | {r['samples_per_s']:.1f} | {r['state_mib']:.2f} "
        f"| {r['peak_mib']:.1f} |"
        for r in rows
    ]
    note = (
        "\n\nstate: parameters + gradients + Adam state the rank keeps (its shards under fsdp). peak: "
        + ("torch.cuda.max_memory_allocated." if args.device == "cuda" else "growth of the peak resident set (coarse).")
        + "\n"
    )
    return head + "\n".join(lines) + note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (default 1 2; on cuda those <= the GPUs)")
    parser.add_argument("--strategies", nargs="+", default=["replicate", "fsdp"])
    parser.add_argument("--updates", type=int, default=3, help="timed updates (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=RESULTS / "trainer_throughput.md")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.ranks is None:  # one GPU per rank with nccl: only the counts this machine has
        gpus = torch.cuda.device_count() if args.device == "cuda" else 2
        args.ranks = [n for n in (1, 2) if n <= gpus]
    batch = make_batch()
    rows = [measure(s, w, args, batch) for s in args.strategies for w in args.ranks]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, args))
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
