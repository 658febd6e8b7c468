"""FSDP2 over the trainer ranks: parameters, gradients and optimizer state sharded, one unit per block.

`shard_policy` applies torch's `fully_shard` to every transformer block of the LLM and every ViT block of the
towers, then to the policy itself (heads, embeddings, norms), on the trainers' own group: a 1-D mesh, or with
`replicas` a 2-D (replicate, shard) mesh (HSDP); optionally with activation checkpointing per block. The learners'
losses are pre-scaled so that the sum over ranks is the minibatch mean (`learners.py`), so the reductions sum
instead of averaging. Every rank must run the same sequence of forwards and backwards: `ShardedDataParallel` splits
each rank's share into the same number of micro-batches. The trainer role reaches it through runtime/sharded.py.
With bf16 the blocks and the root compute in bf16 and the parts that compute in float32 by design (heads, the
tiny random init's film stem) are float32 units; the master shards, Adam's state and the gradient reduction are float32.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Dict, List, Literal, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vlaslurm.algos.learners import DataParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

# Class names of the blocks that become their own FSDP unit: transformers' Llama layer, the towers' ViT block, and
# π0's Gemma and SigLIP layers. Blocks under the module paths
# a policy lists in `FSDP_GATHERED` stay gathered from forward to backward (`sharded_blocks`): FSDP2 otherwise frees
# a unit after each call and gathers it again when a gradient reaches the call's output, which is too late for a
# block called several times in one forward (π0's action expert, once per denoising step) or one whose outputs also
# leave by a side channel (π0's prefix layers: their keys and values, through the KV cache).
BLOCK_CLASSES = ("LlamaDecoderLayer", "Block", "GemmaDecoderLayer", "SiglipEncoderLayer")
# The policy methods the runtime calls in place of forward(): FSDP must gather the root's parameters for them.
POLICY_METHODS = ("act", "evaluate")
# With bf16, the parts that compute in float32 by design become float32 units, which cast their inputs to float32:
# the value head (a bf16 one rounds returns of ~1e2 to 3 digits), the film stem of a tiny random init (float32
# pixels), the OFT release's heads (kept in float32 in releases), and
# π0's noise head (Flow-Noise's learned std, float32 like its value head).
FLOAT32_ATTRIBUTES = ("value_head", "action_head", "proprio_projector", "noise_head")
FLOAT32_CLASSES = ("VisionStem", "L1RegressionActionHead", "ProprioProjector")
MixedPrecision = Literal["fp32", "bf16"]


def shard_policy(
    policy: nn.Module,
    group: dist.ProcessGroup,
    mixed_precision: MixedPrecision = "fp32",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    device_type: Optional[str] = None,
    activation_checkpointing: bool = False,
    replicas: int = 1,
) -> nn.Module:
    """Shard `policy` in place over `group` and return it; its parameters become DTensors. A policy built on the
    meta device (to be filled with `load_release_slices`) needs the `device_type` its shards will live on.

    `replicas` > 1 is hybrid sharding (HSDP): the group's ranks, in order, form a replicas x shard mesh; each row
    shards the model, the rows hold replicas (a node per row keeps the reduce-scatter inside a node). Every rank of
    `group` must call this in the same order (it makes the mesh's groups). `activation_checkpointing` recomputes
    each block's activations in backward instead of keeping them."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    device = next(policy.parameters()).device
    mesh = trainer_mesh(group, replicas, device_type or ("cpu" if device.type == "meta" else device.type))
    if mixed_precision == "bf16":
        policy.to(torch.float32)  # the master shards are float32, also those of a release loaded in bf16
    shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block, gathered in sharded_blocks(policy):
        if activation_checkpointing:
            checkpoint_block(block)
        reshard = reshard_after_forward and not gathered
        shard(block, mp_policy=_precision(mixed_precision), offload_policy=offload, reshard_after_forward=reshard)
    if mixed_precision == "bf16":
        for island in float32_islands(policy):
            shard(island, mp_policy=MixedPrecisionPolicy(torch.float32, torch.float32), offload_policy=offload)
    # The root does not cast act()'s and evaluate()'s inputs: the stored actions and the state must reach the
    # float32 heads unrounded; each bf16 block casts its own inputs.
    fully_shard(policy, mesh=mesh, mp_policy=_precision(mixed_precision, cast_inputs=False), offload_policy=offload)
    for method in POLICY_METHODS:
        if hasattr(policy, method):
            register_fsdp_forward_method(policy, method)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the losses are already shares of the minibatch mean
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return policy


def sharded_blocks(policy: nn.Module) -> List[Tuple[nn.Module, bool]]:
    """(block, kept gathered from forward to backward) of every block (`BLOCK_CLASSES`) of `policy`; those under its
    `FSDP_GATHERED` paths stay gathered."""
    gathered = tuple(f"{path}." for path in getattr(policy, "FSDP_GATHERED", ()))
    return [
        (m, name.startswith(gathered))
        for name, m in policy.named_modules()
        if m is not policy and type(m).__name__ in BLOCK_CLASSES
    ]


def float32_islands(policy: nn.Module) -> List[nn.Module]:
    """The outermost modules of `policy` that compute in float32 under bf16 (`FLOAT32_ATTRIBUTES`, by attribute
    name, and `FLOAT32_CLASSES`); the policies have none inside a block (it would have to be sharded first)."""
    found: List[str] = []
    for name, module in policy.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in found)
        if module is not policy and not inside and _computes_in_float32(name, module):
            found.append(name)
    return [policy.get_submodule(name) for name in found]


def _computes_in_float32(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] in FLOAT32_ATTRIBUTES or type(module).__name__ in FLOAT32_CLASSES


def _precision(mixed_precision: MixedPrecision, cast_inputs: bool = True) -> MixedPrecisionPolicy:
    """bf16: bf16 compute, float32 gradient reduction and master shards (the optimizer steps the float32 shards);
    fp32: no casts at all (a release loaded in bf16 computes in bf16 as in a replicated trainer)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=cast_inputs)


def checkpoint_block(block: nn.Module) -> None:
    """Activation checkpointing of one block, before it is sharded: torch's composable `checkpoint`.

    Chosen over `checkpoint_wrapper` because it leaves the module tree and the parameter names as they are (the
    wrapper inserts `_checkpoint_wrapped_module.` into every name, which the value head's optimizer group, LoRA's
    names and the release loader would have to undo), and over calling torch.utils.checkpoint in the blocks'
    forward because the models stay unaware of it. It is the same non-reentrant torch.utils.checkpoint under the
    hood, as forward hooks; fully_shard's own hooks run outside it, so the recomputation in backward finds the
    block's parameters already gathered by FSDP's pre-backward all-gather (torch tests this composition:
    test_fully_shard_training.py, test_train_parity_with_activation_checkpointing, checkpoint_impl "composable")."""
    from torch.distributed._composable import checkpoint

    checkpoint(block)


def trainer_mesh(group: dist.ProcessGroup, replicas: int, device_type: str) -> DeviceMesh:
    """The device mesh of the trainer ranks: 1-D over `group`, or 2-D `(replicate, shard)` with `replicas` rows.

    The 2-D mesh is built from groups this call makes, not by DeviceMesh itself, which would make its groups with
    every rank of the job (simulators and generators too). Like the runtime's trainers' group, they are made
    without local synchronisation, so their names come from a counter that only such calls advance; every trainer
    makes all of them in the same order, members or not (non-members get no group)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = sorted(dist.get_process_group_ranks(group))
    if replicas < 1 or len(ranks) % replicas:
        raise ValueError(f"trainer.replicas {replicas} does not divide the {len(ranks)} trainer ranks")
    if replicas == 1:
        return DeviceMesh.from_group(group, device_type)
    grid = torch.tensor(ranks, dtype=torch.int).view(replicas, -1)
    me = dist.get_rank()
    shard = _own_group([row.tolist() for row in grid], me)
    replicate = _own_group([column.tolist() for column in grid.T], me)
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=grid, mesh_dim_names=("replicate", "shard"))


def _own_group(groups: List[List[int]], me: int) -> dist.ProcessGroup:
    """Make every group of `groups` (the same calls on every trainer) and return the one holding rank `me`."""
    made = [dist.new_group(ranks=ranks, use_local_synchronization=False) for ranks in groups]
    return next(group for ranks, group in zip(groups, made) if me in ranks)


class ShardedDataParallel(DataParallel):
    """A rank of an FSDP trainer: the reduce-scatter sums gradients in backward, so nothing is left to sum; every
    rank runs a minibatch in as many micro-batches as the rank with the most of it needs (each backward is a
    collective), empty ones included: a rank with none of the minibatch (an async batch can be a few decision
    steps) runs a zero loss on its spare row (`PolicyStep`)."""

    def sum_grads(self, params: List[nn.Parameter]) -> None:
        return None

    def micro_batches(self, mine: Tensor, shares: List[int], size: Optional[int]) -> List[Tensor]:
        if not sum(shares):
            raise ValueError("an empty minibatch reached a sharded trainer (every rank must run each backward)")
        count = 1 if size is None else max(math.ceil(n / size) for n in shares)
        return list(mine.tensor_split(count))


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
    """Allocate the tensors of a sharded module that are on the meta device (uninitialised local shards, for
    `load_release_slices` to fill), keeping those that were made for real: the rotary frequencies, which no
    checkpoint holds, and a policy's heads built beside a meta VLA."""
    kept = {name: _local(t).detach().clone() for name, t in _named_tensors(module) if not _local(t).is_meta}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, t in _named_tensors(module):
            if name in kept:
                _local(t).copy_(kept[name])


def _named_tensors(module: nn.Module) -> List[tuple]:
    return [*module.named_parameters(), *module.named_buffers()]


def _local(t: Tensor) -> Tensor:
    """A rank's own part of a (sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


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
