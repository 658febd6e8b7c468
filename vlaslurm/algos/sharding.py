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
    device_type: Optional[str] = None,
) -> nn.Module:
    """Shard `policy` in place over `group` and return it; its parameters become DTensors. A policy built on the
    meta device (to be filled with `load_release_slices`) needs the `device_type` its shards will live on."""
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
    mesh = DeviceMesh.from_group(group, device_type or ("cpu" if device.type == "meta" else device.type))
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


def materialize_sharded(module: nn.Module, device: torch.device) -> None:
    """Allocate a sharded module built on the meta device, keeping the buffers that were computed for real
    (the rotary frequencies, which no checkpoint holds); its parameters are then uninitialised local shards."""
    kept = {name: b.detach().clone() for name, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])


def load_release_slices(module: nn.Module, folder: str, dtype: torch.dtype, prefix: str = "") -> int:
    """Fill `module`'s tensors named `prefix + <release name>` from a release folder's safetensors, strictly, each
    rank reading only the rows of its own shards (safetensors slices a tensor without reading the rest of the
    file). Returns the bytes this rank read: about 1/N of the weights on each of N ranks, never a full copy."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from vlaslurm.models.prismatic.release import check_tensors, stored_tensors

    stored = stored_tensors(folder)
    targets = {name[len(prefix) :]: t for name, t in module.state_dict().items() if name.startswith(prefix)}
    check_tensors({key: t.shape for key, t in targets.items()}, stored, folder)
    read = 0
    for file in sorted({entry.file for entry in stored.values()}):
        with safe_open(str(file), framework="pt") as shard, torch.no_grad():
            for key in shard.keys():
                target = targets[key]
                if isinstance(target, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(
                        target.shape, target.device_mesh, target.placements
                    )
                    local = target.to_local()
                    if local.numel() == 0:
                        continue
                    rows = [slice(o, o + s) for o, s in zip(offset, shape)]
                    part = shard.get_slice(key)[tuple(rows)]
                else:
                    local, part = target, shard.get_tensor(key)
                local.copy_(part.to(dtype))
                read += part.numel() * part.element_size()
    return read
