"""The connectivity probe: every rank meets, forms one gloo world and all-reduces.

`vlaslurm submit SPEC --probe` runs it instead of training, to prove a cluster,
a layout and a network work before spending GPU hours.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from vlaslurm.log import get_logger
from vlaslurm.rundir import RunDir, write_atomic
from vlaslurm.runtime.context import RankContext, meet

log = get_logger("vlaslurm.probe")


def run(ctx: RankContext) -> int:
    """Meet, all-reduce (global rank + 1), record what this rank saw; 0 on success."""
    meet(ctx, ports={})
    world = ctx.world
    assert world is not None  # meet with roles=None puts every rank in the world
    value = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(value)
    expected = world.world_size * (world.world_size + 1) / 2
    record = {
        "role": ctx.role,
        "rank": ctx.rank,
        "global_rank": world.rank,
        "world_size": world.world_size,
        "node": ctx.node,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "step_gpus": os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS"),
        "het_group": os.environ.get("SLURM_HET_JOB_GROUP") or os.environ.get("SLURM_HET_GROUP"),
        "sum": value.item(),
        "expected": expected,
        "job_key": ctx.job_key,
    }
    out = RunDir(ctx.run_dir).probe_record(ctx.role, ctx.rank)
    out.parent.mkdir(exist_ok=True)
    write_atomic(out, json.dumps(record).encode())
    dist.barrier()
    world.close()
    log.info("probe all_reduce = %s (expected %s)", value.item(), expected)
    return 0 if value.item() == expected else 1
