"""The fsdp trainer's runtime (`trainer.strategy: fsdp`): the sharded policy, rank 0's command after each update,
and the bucketed gathers that turn shards into the full weights generators need.

A released checkpoint goes straight into the shards: the VLA is built on the meta device, sharded, and each rank
reads only its own slices of the safetensors (`build_sharded_policy`), so no rank ever holds the whole model.

With sharded state every publication, checkpoint and the final model is a collective, so rank 0 tells the other
trainer ranks after each update (and after the stop) what comes next (`Command`, msgpack over the trainers' group,
no pickling). A gather holds one bucket of full tensors beyond the shards at a time (`gather_full_state`); rank 0
moves each bucket to host memory and hands the whole state dict to the publisher. Details: docs/runtime.md
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor, nn

from vlaslurm.algos.sharding import load_release_slices, materialize_sharded, shard_policy
from vlaslurm.log import get_logger
from vlaslurm.models import build_policy_for_shards, publication_sources, publication_state, trained_state
from vlaslurm.runtime.weights import manifest_of, plan_buckets
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.trainer_types import TrainerSpec

log = get_logger("vlaslurm.trainer")


@dataclass(frozen=True)
class Command:
    """What every trainer rank joins after an update, or after the stop (rank 0 decides, the others follow)."""

    publish: bool = False
    """Gather the full weights for the generators."""
    checkpoint: str = ""
    """The temporary folder of a sharded checkpoint save every rank writes into ("" for none)."""
    final: bool = False
    """Gather the final model (after the stop of a run that finished)."""


def send_meta(meta: dict, group, src: int) -> None:
    """Broadcast a msgpack-able dict from `src` over `group` (its size, then its bytes)."""
    raw = msgpack.packb(meta)
    dist.broadcast(torch.tensor([len(raw)], dtype=torch.int64), src, group=group)
    dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), src, group=group)


def receive_meta(group, src: int) -> dict:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    raw = torch.zeros(int(size.item()), dtype=torch.uint8)
    dist.broadcast(raw, src, group=group)
    return msgpack.unpackb(raw.numpy().tobytes())


def send_command(command: Command, group, src: int) -> None:
    send_meta({"command": asdict(command)}, group, src)


def receive_command(group, src: int) -> Command:
    meta = receive_meta(group, src)
    if "command" not in meta:  # a keep-alive or a batch here means the ranks disagree on the sequence
        raise RuntimeError(f"trainer rank 0 sent {sorted(meta)} where the command after an update belongs")
    body = meta["command"]
    return Command(publish=bool(body["publish"]), checkpoint=str(body["checkpoint"]), final=bool(body["final"]))


def build_sharded_policy(
    model: ModelConfig, dims: Dict[str, int], trainer: TrainerSpec, group, device: torch.device
) -> nn.Module:
    """The trainer's policy sharded over `group`, every rank starting from the same parameters (the caller seeds
    torch alike on every rank). A released checkpoint's VLA is built on the meta device and each rank reads only
    the rows of its own shards (about 1/N of the file); other policies are built whole, then sharded."""
    policy, release = build_policy_for_shards(model, **dims)
    if release is None:
        return shard_trainer_policy(policy.to(device), trainer, group, device)
    shard_trainer_policy(policy, trainer, group, device)  # FSDP moves the real heads to `device`
    offloaded = trainer.cpu_offload and device.type != "cpu"  # FSDP's CPU offload keeps the shards in host memory
    materialize_sharded(policy, torch.device("cpu") if offloaded else device)
    read = load_release_slices(policy, str(release.folder), release.dtype, release.prefix)
    log.info("read %.1f MB of %s into this rank's shards", read / 1e6, release.folder)
    return policy


def shard_trainer_policy(policy: nn.Module, trainer: TrainerSpec, group, device: torch.device) -> nn.Module:
    """`policy`, the same on every rank, sharded over `group` in place: each rank keeps 1/N of every parameter."""
    return shard_policy(
        policy,
        group=group,
        mixed_precision=trainer.mixed_precision,
        # A CPU trainer's shards are in host memory already (and FSDP's offload pins memory: it needs an accelerator).
        cpu_offload=trainer.cpu_offload and device.type != "cpu",
        device_type=device.type,  # a VLA left on the meta device says nothing of where its shards go
        activation_checkpointing=trainer.activation_checkpointing,
        replicas=trainer.replicas,
    )


def gather_full_state(
    policy: nn.Module,
    bucket_bytes: int,
    keep: bool,
    observe: Optional[Callable[[int], None]] = None,
    publication: bool = False,
) -> Dict[str, Tensor]:
    """Every tensor of a sharded policy that trains (`models.trained_state`: with LoRA the adapters and the heads,
    else all) in full, gathered one bucket at a time (a collective: every trainer rank calls it). On the device a
    rank holds its shards plus at most one bucket of full tensors (`bucket_bytes`, or the largest tensor if that is
    larger); with `keep` (rank 0) each bucket moves to host memory and the whole state dict is returned, otherwise
    it is dropped and {} is returned. `observe` gets each bucket's bytes. With `publication`, what a weight
    publication sends instead (`models.publication_state`: with LoRA published merged, the merged weights, folded
    in host memory from the gathered base weights and adapters)."""
    from torch.distributed.tensor import DTensor

    state = publication_sources(policy) if publication else trained_state(policy)
    out: Dict[str, Tensor] = {}
    for bucket in plan_buckets(manifest_of(state), bucket_bytes):  # the weight broadcast's own plan
        full = {}
        for name in bucket.names:
            t = state[name]
            full[name] = t.full_tensor() if isinstance(t, DTensor) else t
        if observe is not None:
            observe(sum(t.numel() * t.element_size() for t in full.values()))
        if keep:
            out.update({name: t.detach().to("cpu", copy=True) for name, t in full.items()})
        del full
    if not keep:
        return {}
    gathered = {name: out[name] for name in state}
    return publication_state(policy, gathered) if publication else gathered
