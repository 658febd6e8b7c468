"""Step 5, trainer: one FSDP update of the ~1B-parameter VLA on one GPU, bf16, activation checkpointing off and on.

The VLA (common.vla_1b_config) is sharded by vlaslurm/algos/sharding.py's `shard_policy` (FSDP2, one unit per
Llama layer and ViT block, bf16 compute, float32 master weights and reduction) over a single-rank process group
(nccl; gloo in `--dry-run`), and its micro-batches planned by `ShardedDataParallel`. One update = forward, the
next-token cross-entropy of the prompt, backward and an AdamW step; `samples_per_s` = batch / the median update
time after one warm-up update, `peak_gib` over the timed updates. Checkpointing wraps every block with
torch.distributed's composable `checkpoint` before sharding. Then, on the GPU and budget permitting, one update with
`cpu_offload` (shards and optimizer on the host). Several GPUs (one rank each) are not run here: the same
measurement over N ranks is `benchmarks/trainer_throughput.py --device cuda` (replicate vs fsdp, one GPU per rank).
"""

from __future__ import annotations

import time
from typing import Any, Dict

import common

TOKENS = 32  # prompt tokens (the 256 patches come on top; 16 in --dry-run)
ITERS = 2
OFFLOAD_NEEDS_S = 25  # the offloaded update's build, warm-up and one timed update (AdamW over 1B on the host)


def update_figures(step: common.Step, device: Any, checkpointing: bool, cpu_offload: bool = False) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._composable import checkpoint

    from vlaslurm.algos.sharding import BLOCK_CLASSES, ShardedDataParallel, local_numel, shard_policy
    from vlaslurm.models.prismatic.release import build_vla

    torch.manual_seed(0)
    began = time.perf_counter()
    vla = build_vla(common.vla_1b_config(step.dry_run), device=device, dtype=torch.float32)
    if checkpointing:
        for module in list(vla.modules()):
            if module is not vla and type(module).__name__ in BLOCK_CLASSES:
                checkpoint(module)
    batch_size = 2 if step.dry_run else 16
    batch = common.vla_batch(vla, batch_size, TOKENS, device)
    patches = vla.vision_backbone.num_patches
    precision = "bf16" if device.type == "cuda" else "fp32"
    vla = shard_policy(vla, dist.group.WORLD, mixed_precision=precision, cpu_offload=cpu_offload)
    opt = torch.optim.AdamW(vla.parameters(), lr=1e-5)
    dp = ShardedDataParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    owner = dp.owners(torch.ones(batch_size, dtype=torch.long))  # this rank's rows, as the learners own them
    parts = dp.micro_batches((owner == dp.rank).nonzero()[:, 0], dp.shares(owner), None)
    micro = len(parts)
    build_s = time.perf_counter() - began

    def update() -> None:
        opt.zero_grad(set_to_none=True)
        for part in parts:
            ids = batch["input_ids"][part]
            logits = vla(pixel_values=batch["pixel_values"][part], input_ids=ids)
            loss = F.cross_entropy(logits[:, patches:-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            (loss * len(part) / batch_size).backward()
        opt.step()

    update()  # warm-up: allocations, AdamW's state
    common.reset_peak(device)
    seconds = common.timed(update, device, iters=1 if step.dry_run or cpu_offload else ITERS, warmup=0)
    return {
        "checkpointing": checkpointing,
        "cpu_offload": cpu_offload,
        "batch": batch_size,
        "seq_len": patches + TOKENS,
        "micro_batches": micro,
        "parameters": local_numel(vla),
        "build_s": build_s,
        "update_s": seconds,
        "samples_per_s": batch_size / seconds,
        "peak_gib": common.peak_gib(device),
    }


def body(step: common.Step, device: Any) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None  # NCCL binds the rank to the GPU at once
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    step.set("group", {"backend": backend, "world_size": 1, "gpus": torch.cuda.device_count()})
    step.set("mixed_precision", "bf16" if device.type == "cuda" else "fp32 (CPU rehearsal)")
    try:
        for checkpointing in (False, True):
            key = "checkpointing_on" if checkpointing else "checkpointing_off"
            with step.part(key) as figures:
                figures.update(update_figures(step, device, checkpointing))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # trainer.cpu_offload (FSDP2's CPUOffloadPolicy: shards and AdamW on the host) needs an accelerator, so the
        # CPU rehearsal cannot run it; on the GPU one timed update when the budget leaves room for it.
        with step.part("cpu_offload") as figures:
            if device.type != "cuda":
                figures["skipped"] = "FSDP2's CPU offload needs a GPU"
            elif step.left_s() < OFFLOAD_NEEDS_S:
                figures["skipped"] = f"{step.left_s():.0f} s of the budget left, < {OFFLOAD_NEEDS_S} s"
            else:
                figures.update(update_figures(step, device, checkpointing=False, cpu_offload=True))
    finally:
        dist.destroy_process_group()
    errors = [k for k in ("checkpointing_off", "checkpointing_on") if "error" in step.data[k]]
    if errors:
        raise RuntimeError(f"failed: {', '.join(errors)} (see their `error`)")


if __name__ == "__main__":
    raise SystemExit(common.main("trainer", 60.0, body))
