"""Collocated layout: a role's tensors leave the shared GPU while another role needs it.

With `resources.layout: collocated` the generator and the trainer take turns on the
same GPUs (sync and pipelined only: the turns are the rollout phases). So that each
has the memory while it works, state moves between the device and host memory
only at the phase boundaries, never per step:

    generator  its model moves off when the rollout phase is over (the trainer has
               taken the phase's batch) and back on when the next version's weights
               are installed
    trainer    its model and its optimizer state move off once the weights are
               published and back on just before the update; its gradients are
               dropped, not moved (every optimizer step computes them afresh)

Each move is an `offload` / `onload` event of the rank's event log (what moved, its
bytes, the seconds it took), so the boundary claim can be checked from a run. The
moves are device-agnostic: on a CPU-only machine the device is the host and a move
costs nothing, but it is still made and recorded.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import torch
from torch import nn

from vlaslurm.runtime.records import EventLog

HOST = torch.device("cpu")
KEEP_ON_HOST = ("step",)  # Adam's step counter: torch keeps it a host scalar unless the optimizer is capturable


def offloads(layout: str) -> bool:
    """Whether a layout makes the generator and the trainer share GPUs between rollout phases."""
    return layout == "collocated"


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def move_module(module: nn.Module, device: torch.device, drop_grads: bool = False) -> int:
    """Move parameters, buffers and gradients (or drop these) to `device`; return the bytes moved.

    Between CPU and CUDA `Module.to` keeps the Parameter objects, so an optimizer keeps pointing at them."""
    if drop_grads:
        for param in module.parameters():
            param.grad = None
    tensors = [*module.parameters(), *module.buffers()]
    size = sum(nbytes(t) for t in tensors) + sum(nbytes(p.grad) for p in module.parameters() if p.grad is not None)
    module.to(device)
    return size


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Move the optimizer's state tensors (Adam's moments, ...) to `device`; return their bytes."""
    size = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key not in KEEP_ON_HOST:
                state[key] = value.to(device)
                size += nbytes(value)
    return size


class Offloader:
    """One rank's model (and optimizer): on its device while it works, in host memory between turns.

    Both moves are idempotent, so a caller may ask at every boundary it sees; only a real move
    is recorded. Disabled (every call returns at once) outside the collocated layout.
    """

    def __init__(self, enabled: bool, device: torch.device, events: EventLog, clock: Callable[[], float],
                 module: Optional[nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 host: torch.device = HOST, drop_grads: bool = False) -> None:
        self.enabled, self.device, self.host = enabled, torch.device(device), torch.device(host)
        self.events, self.clock = events, clock
        self.module, self.optimizer, self.drop_grads = module, optimizer, drop_grads
        self.on_device = True

    def offload(self, version: int) -> None:
        """Move to host memory, and give the freed device memory back (another process needs it)."""
        if self.enabled and self.on_device:
            self._move(self.host, "offload", version)
            self.on_device = False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # else torch's caching allocator keeps the blocks from the other role

    def onload(self, version: int) -> None:
        """Move back to the device."""
        if self.enabled and not self.on_device:
            self._move(self.device, "onload", version)
            self.on_device = True

    def _move(self, target: torch.device, kind: str, version: int) -> None:
        t0, start = self.clock(), time.perf_counter()
        moved: Dict[str, int] = {}
        if self.module is not None:
            moved["model"] = move_module(self.module, target, self.drop_grads)
        if self.optimizer is not None:
            moved["optimizer"] = move_optimizer(self.optimizer, target)
        if "cuda" in (self.device.type, target.type):
            torch.cuda.synchronize(self.device)  # copies are asynchronous: time their end, not their launch
        self.events.add(kind, t0=t0, t1=self.clock(), v=version, what=sorted(moved), bytes=sum(moved.values()),
                        parts=moved, s=time.perf_counter() - start, to=str(target))
        self.events.flush()  # a handful per phase: keep them even if the rank dies
