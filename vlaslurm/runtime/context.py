"""What every rank knows about itself and the run, and how it meets the others."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

from vlaslurm.log import get_logger, set_context
from vlaslurm.rundir import RunDir, RunInfo, read_info
from vlaslurm.rundir.secret import load_secret
from vlaslurm.runtime import dist as rdist
from vlaslurm.runtime.netaddr import bind_address
from vlaslurm.runtime.rendezvous import Deadlines, Key, Member, Rendezvous, global_rank, rendezvous_dir
from vlaslurm.spec import ExperimentSpec, load_spec
from vlaslurm.spec.schema import RuntimeConfig

log = get_logger("vlaslurm.context")


@dataclass
class RankContext:
    """One rank of one role and the rendezvous it meets in. What the role does comes from its own
    config (`run(ctx, cfg)`), never from here: the context holds no spec."""

    role: str
    rank: int
    run_dir: Path
    info: RunInfo
    job_key: str
    secret: bytes
    deadlines: Deadlines
    address: str
    node: str
    device: torch.device
    rendezvous: Rendezvous
    members: Dict[Key, Member] = field(default_factory=dict)
    world: Optional[rdist.World] = None
    t0: float = 0.0  # the run's clock starts at the run's creation, on every host alike

    @property
    def global_rank(self) -> int:
        return global_rank(self.role, self.rank, self.info.ranks)

    def now(self) -> float:
        """Seconds on the run's clock."""
        return time.time() - self.t0

    def member(self, role: str, rank: int) -> Member:
        return self.members[(role, rank)]


def rank_from_env(environ=os.environ) -> int:
    """This process's rank within its role's step."""
    for name in ("VLASLURM_RANK", "SLURM_PROCID"):
        if name in environ:
            return int(environ[name])
    raise RuntimeError("no VLASLURM_RANK or SLURM_PROCID: start workers with `vlaslurm run` or `vlaslurm submit`")


def run_spec(run_dir: Path) -> ExperimentSpec:
    """The spec a run was started with (its run directory's copy)."""
    return load_spec(RunDir(run_dir).spec).spec


def make_context(role: str, run_dir: Path, runtime: RuntimeConfig) -> RankContext:
    """Read the run directory and the environment into this rank's context; `runtime` (the spec's section)
    gives the deadlines and the bind address."""
    rank = rank_from_env()
    set_context(role=role, rank=rank)
    info = read_info(run_dir)
    job_key = os.environ.get("VLASLURM_JOB_KEY") or f"{info.job_id or 'local'}-r0"
    deadlines = Deadlines(runtime.first_meeting_timeout_s, runtime.timeout_s)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    rdzv = Rendezvous(rendezvous_dir(run_dir, job_key), info.ranks)
    return RankContext(
        role,
        rank,
        run_dir,
        info,
        job_key,
        load_secret(run_dir),
        deadlines,
        bind_address(runtime.bind_address),
        node,
        _device(role, rank),
        rdzv,
        t0=info.created,
    )


def _device(role: str, rank: int) -> torch.device:
    if role == "simulator" or not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("SLURM_LOCALID", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


def world_roles(weight_sync: str) -> Tuple[str, ...]:
    """Roles in the torch.distributed world of a training run (`rollout.weight_sync`): the trainers, and the
    generators when weights go by broadcast. Simulators never need it after the start, so they stay out and a
    restarted simulator (or a generator with filesystem weights) can rejoin: a process group cannot take a new
    member mid-run."""
    return ("trainer", "generator") if weight_sync == "nccl" else ("trainer",)


def meet(
    ctx: RankContext, ports: Dict[str, int], extra: Optional[dict] = None, roles: Optional[Sequence[str]] = None
) -> None:
    """Join the rendezvous, wait for every rank, then form the torch.distributed world of `roles`
    (None: every rank, as the probe does); a rank outside them gets `ctx.world = None`."""
    store = rdist.host_store(ctx.address, ctx.deadlines.first_s) if ctx.global_rank == 0 else None
    me = Member(
        role=ctx.role,
        rank=ctx.rank,
        host=socket.gethostname(),
        address=ctx.address,
        ports={**ports, **rdist.store_ports(store)},
        pid=os.getpid(),
        node=ctx.node,
        extra=extra or {},
    )
    ctx.rendezvous.join(me)
    ctx.members = ctx.rendezvous.wait(ctx.deadlines.first_s)
    if roles is not None and ctx.role not in roles:
        ctx.world = None
        log.info("met %d ranks in %s (outside the distributed world)", len(ctx.members), ctx.rendezvous.directory)
        return
    members = ctx.members if roles is None else {k: m for k, m in ctx.members.items() if k[0] in roles}
    backend = rdist.world_backend(ctx.device.type == "cuda")
    ctx.world = rdist.init_world(members, me, backend, ctx.deadlines.first_s, store=store, secret=ctx.secret)
    log.info("met %d ranks in %s", len(ctx.members), ctx.rendezvous.directory)
