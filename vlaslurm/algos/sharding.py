"""FSDP2 over the trainer ranks: parameters, gradients and optimizer state sharded, one unit per block.

`shard_policy` applies torch's `fully_shard` to every transformer block of the LLM and every ViT block of the
towers, then to the policy itself (heads, embeddings, norms), on the trainers' own group. The learners' losses are
pre-scaled so that the sum over ranks is the minibatch mean (`learners.py`), so the reduce-scatter sums instead of
averaging. Every rank must run the same sequence of forwards and backwards: `ShardedDataParallel` splits each
rank's share into the same number of micro-batches. Not yet reachable from a spec: the runtime's weight publishing
and checkpoints still read a full state dict on trainer rank 0.
"""

from __future__ import annotations

import math
from typing import Dict, List, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vlaslurm.algos.learners import DataParallel

# Class names of the blocks that become their own FSDP unit: transformers' Llama layer, the towers' ViT block, and
# the look-alike policies' Llama layers (the same class).
BLOCK_CLASSES = ("LlamaDecoderLayer", "Block")
# The policy methods the runtime calls in place of forward(): FSDP must gather the root's parameters for them.
POLICY_METHODS = ("act", "evaluate")
MixedPrecision = Literal["fp32", "bf16"]


def shard_policy(
    policy: nn.Module,
    group: dist.ProcessGroup,
    mixed_precision: MixedPrecision = "fp32",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard `policy` in place over `group` and return it; its parameters become DTensors."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    device = next(policy.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    # bf16 compute, float32 gradient reduction and master parameters (the optimizer steps the float32 shards).
    precision = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for module in list(policy.modules()):
        if module is not policy and type(module).__name__ in BLOCK_CLASSES:
            fully_shard(
                module,
                mesh=mesh,
                mp_policy=precision,
                offload_policy=offload,
                reshard_after_forward=reshard_after_forward,
            )
    fully_shard(policy, mesh=mesh, mp_policy=precision, offload_policy=offload)
    for method in POLICY_METHODS:
        if hasattr(policy, method):
            register_fsdp_forward_method(policy, method)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the losses are already shares of the minibatch mean
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return policy


class ShardedDataParallel(DataParallel):
    """A rank of an FSDP trainer: the reduce-scatter sums gradients in backward, so nothing is left to sum; the
    micro-batches of a minibatch number the same on every rank (each backward is a collective)."""

    def sum_grads(self, params: List[nn.Parameter]) -> None:
        return None

    def micro_batches(self, total: int, size: Optional[int]) -> int:
        smallest = total // self.size  # the smallest rank's share of `total` rows (shards differ by at most one)
        if smallest == 0:
            raise ValueError(
                f"a minibatch of {total} decision steps leaves a trainer rank of {self.size} without any: "
                "raise algo.steps_per_update or lower algo.minibatches"
            )
        return 1 if size is None else max(1, math.ceil(smallest / size))


def full_state_dict(policy: nn.Module) -> Dict[str, Tensor]:
    """Every tensor of a sharded policy in full, on every rank (a collective: all ranks call it)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in policy.state_dict().items()
    }


def local_numel(policy: nn.Module) -> int:
    """Parameter elements this rank holds (its shards)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in policy.parameters())
