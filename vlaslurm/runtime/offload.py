"""Collocated layout: a role's tensors leave the shared GPU while another role needs it.

With `resources.layout: collocated` the generator and the trainer take turns on the same GPUs;
their state moves between device and host only at phase boundaries, and a move onto the device
waits (with the running deadline) for the other role's `offloaded` reports. Each move is an
`offload` / `onload` event of the rank's event log.
Details (who waits for whom, the transient overlaps): docs/runtime.md
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from vlaslurm.rundir import EventLog
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime.transport import Push

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

    def __init__(
        self,
        enabled: bool,
        device: torch.device,
        events: EventLog,
        clock: Callable[[], float],
        module: Optional[nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        host: torch.device = HOST,
        drop_grads: bool = False,
        on_device: bool = True,
        report: Optional[OffloadReporter] = None,
    ) -> None:
        self.enabled, self.device, self.host = enabled, torch.device(device), torch.device(host)
        self.events, self.clock = events, clock
        self.module, self.optimizer, self.drop_grads = module, optimizer, drop_grads
        self.on_device = on_device  # False: the caller built the module in host memory
        self.report = report  # told of every move off, once it has ended

    def offload(self, version: int) -> None:
        """Move to host memory, and give the freed device memory back (another process needs it)."""
        if self.enabled and self.on_device:
            self._move(self.host, "offload", version)
            self.on_device = False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # else torch's caching allocator keeps the blocks from the other role
            if self.report is not None:
                self.report(version)

    def onload(self, version: int) -> None:
        """Move back to the device."""
        if self.enabled and not self.on_device:
            self._move(self.device, "onload", version)
            self.on_device = True

    def close(self) -> None:
        if self.report is not None:
            self.report.close()

    def _move(self, target: torch.device, kind: str, version: int) -> None:
        t0, start = self.clock(), time.perf_counter()
        moved: Dict[str, int] = {}
        if self.module is not None:
            moved["model"] = move_module(self.module, target, self.drop_grads)
        if self.optimizer is not None:
            moved["optimizer"] = move_optimizer(self.optimizer, target)
        if "cuda" in (self.device.type, target.type):
            torch.cuda.synchronize(self.device)  # copies are asynchronous: time their end, not their launch
        self.events.add(
            kind,
            t0=t0,
            t1=self.clock(),
            v=version,
            what=sorted(moved),
            bytes=sum(moved.values()),
            parts=moved,
            s=time.perf_counter() - start,
            to=str(target),
        )
        self.events.flush()  # a handful per phase: keep them even if the rank dies


class OffloadReporter:
    """A rank's word to trainer rank 0 that its state left the GPU (the `offloaded` message, sent into the
    trainer's intake beside the segments: signed like every message, never pickled)."""

    def __init__(self, secret: bytes, endpoint: str, role: str, rank: int, channel: str = "segments") -> None:
        self.role, self.rank = role, rank
        self.push = Push(secret, channel=channel, name="offloaded->trainer[0]")  # the trainer's intake channel
        self.push.connect(endpoint)

    @classmethod
    def of(cls, ctx, role: str, layout: str) -> Optional[OffloadReporter]:
        """The reporter of rank `ctx` of `role` (a RankContext); None outside the collocated `layout`."""
        if not offloads(layout):
            return None
        endpoint = ctx.member("trainer", 0).endpoint("segments")
        return cls(ctx.secret, endpoint, role, ctx.rank, msgs.channel(ctx.job_key, "segments"))

    def __call__(self, version: int) -> None:
        self.push.send(msgs.offloaded(version, self.role, self.rank))

    def close(self) -> None:
        self.push.close()


class OffloadTimeout(RuntimeError):
    """A rank never said that its state left the GPU: the other role cannot safely move on."""


class OffloadReports:
    """Trainer rank 0's record of the `offloaded` messages: which ranks left the GPU, per version."""

    def __init__(self) -> None:
        self.by_version: Dict[int, Set[Tuple[str, int]]] = {}

    def add(self, version: int, role: str, rank: int) -> None:
        self.by_version.setdefault(version, set()).add((role, rank))

    def missing(self, version: int, role: str, ranks: Iterable[int]) -> List[int]:
        got = self.by_version.get(version, set())
        return [rank for rank in ranks if (role, rank) not in got]

    def wait(
        self, version: int, role: str, ranks: Iterable[int], timeout_s: float, pump: Callable[[], None], waiter: str
    ) -> None:
        """Call `pump` (which takes messages in) until every rank of `role` in `ranks` reported its offload
        of `version`; OffloadTimeout naming the missing ranks after `timeout_s`."""
        ranks = list(ranks)
        deadline = time.monotonic() + timeout_s
        while missing := self.missing(version, role, ranks):
            if time.monotonic() >= deadline:
                names = ", ".join(f"{role}[{rank}]" for rank in missing)
                raise OffloadTimeout(
                    f"{names} did not say within {timeout_s:g} s (runtime.timeout_s; before the first weights "
                    f"runtime.first_meeting_timeout_s) that its state left the GPU for version {version}; {waiter} "
                    "waits for that so that the two roles never hold the shared GPUs at once (resources.layout: "
                    "collocated). See the log of each rank named."
                )
            pump()
        self.by_version = {v: got for v, got in self.by_version.items() if v >= version}  # older: never asked again
