"""The trainer role: consumes segments, updates the policy, publishes versioned weights.

Trainer rank 0 collects segments, enforces `max_staleness`, decides when a batch is complete
and writes the ledger; every trainer rank runs the update (data parallel). Rank 0 checkpoints
at update boundaries (every `checkpoint.every_versions`, and on USR2/TERM); every rank resumes
from the newest. Collocated, model and optimizer live in host memory between updates. With
`trainer.strategy: fsdp` the state is sharded (`Shards`): rank 0 tells the others after each
update what to join (a sharded save, a gather of the weights to publish; runtime/sharded.py).
Details: docs/runtime.md
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Deque, Dict, List, Optional, Set, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist

from vlaslurm.algos.batch import TrainBatch, collate, decode_strings, encode_strings, is_observation
from vlaslurm.algos.learners import DataParallel, make_learner
from vlaslurm.algos.sharding import ShardedDataParallel
from vlaslurm.log import get_logger, set_context
from vlaslurm.models import build_policy, load_trained_state, publication_state
from vlaslurm.rundir import (
    Counters,
    EventLog,
    Heartbeat,
    RunDir,
    append_metrics,
    keep_metrics_through,
    read_heartbeats,
    write_final_summary,
)
from vlaslurm.runtime import checkpoint as ckpt
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime import signals
from vlaslurm.runtime.context import RankContext, meet, world_roles
from vlaslurm.runtime.failures import FailureKeeper
from vlaslurm.runtime.ledger import Ledger
from vlaslurm.runtime.offload import Offloader, OffloadReporter, OffloadReports, offloads
from vlaslurm.runtime.periodic_eval import PeriodicEval
from vlaslurm.runtime.schedule import ArrivalGaps, Schedule
from vlaslurm.runtime.sharded import (
    Command,
    build_sharded_policy,
    gather_full_state,
    receive_command,
    receive_meta,
    send_command,
    send_meta,
)
from vlaslurm.runtime.stopping import EPISODES_KEY, SUCCESS_KEY, SuccessTarget
from vlaslurm.runtime.transport import Pub, Pull, rejection_counts
from vlaslurm.runtime.weights import DEFAULT_BUCKET_BYTES, make_publisher
from vlaslurm.spec.algo_types import AlgoConfig
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.schema import (
    CheckpointConfig,
    ExperimentSpec,
    Layout,
    PeriodicEvalConfig,
    RolloutConfig,
    TrackingConfig,
)
from vlaslurm.spec.trainer_types import TrainerSpec, fsdp_problem
from vlaslurm.tracking import open_tracker

log = get_logger("vlaslurm.trainer")


@dataclass
class TrainerConfig:
    """What a trainer rank needs from the spec."""

    algo: AlgoConfig
    model: ModelConfig
    rollout: RolloutConfig
    checkpoint: CheckpointConfig
    tracking: TrackingConfig
    layout: Layout  # resources.layout: collocated, model and optimizer leave the GPU during rollouts
    trainer: TrainerSpec = field(default_factory=TrainerSpec)  # the spec's `trainer:`: micro-batches, optimizer
    max_frame_bytes: int = msgs.FRAME_FLOOR_BYTES  # larger frames are refused unread (`msgs.max_frame_bytes`)
    eval: PeriodicEvalConfig = field(default_factory=PeriodicEvalConfig)  # evaluation while training

    @classmethod
    def from_spec(cls, spec: ExperimentSpec) -> TrainerConfig:
        return cls(
            spec.algo,
            spec.model,
            spec.rollout,
            spec.checkpoint,
            spec.tracking,
            spec.resources.layout,
            spec.trainer,
            msgs.max_frame_bytes(spec.env, spec.model.action_chunk),
            spec.eval,
        )


class Collector:
    """Trainer rank 0's intake: segments, phase ends, staleness, the ledger and the metrics."""

    def __init__(self, cfg: TrainerConfig, ctx: RankContext, pull: Pull, pub: Pub) -> None:
        self.cfg, self.ctx, self.pull, self.pub = cfg, ctx, pull, pub
        # When a batch is complete, which segments it takes, which are stale: the mode's schedule.
        self.schedule = Schedule.of(cfg.rollout, cfg.algo.steps_per_update, cfg.algo.episodes_per_group)
        # What the generator's `hold` budget compares with its served steps: whole chunks (it cannot know
        # that an episode ended inside a chunk), so that the two counts never drift apart.
        self.consumed_slots = 0
        self.dropped_slots = 0  # of the consumed slots, those of stale segments: never used
        self.buffer: Deque[msgs.Segment] = deque()
        self.buffered_steps = 0
        self.received_steps = 0
        self.consumed_steps = 0
        self.dropped = 0
        self.phase_ends: Dict[int, Set[int]] = {}
        self.sims_done: Dict[int, Tuple[int, int]] = {}  # sim rank -> (segments, steps) it says it shipped
        self.received_from: Dict[int, int] = {}  # sim rank -> segments received
        self.ledger = Ledger(ctx.run_dir)
        self.events = EventLog(ctx.run_dir, "trainer", 0)
        self.counters = Counters(ctx.run_dir, "trainer", 0)
        # forged, replayed, ...: never decoded; the store's refused values too (none with filesystem sync)
        self.counters.gauge(lambda: rejection_counts(pull, store=ctx.world.store if ctx.world else None))
        self.heartbeat = Heartbeat(ctx.run_dir, "trainer", 0)
        self.failures = FailureKeeper(ctx.run_dir, cfg.tracking.failures_per_task)
        self.window: List[bool] = []  # success of episodes finished since the last report
        self.target = SuccessTarget(cfg.rollout.stop_at_success, cfg.rollout.stop_window)  # an early end
        self.full_since: Optional[float] = None  # when the buffer last came to hold a full batch (`ready`)
        self.started = time.monotonic()
        self.arrivals = ArrivalGaps()  # when data last came, and when a wait for groups in play is over (`ready`)
        self._last_ctl = 0.0
        self._version = 0
        self.taken = -1  # newest version whose phase is over (its batch taken): collocated generators leave the GPU
        self.published = -1  # newest version whose weights went out (rollout.publish_every may skip some)
        self.published_at = -1  # used slots consumed when it went out: the base of the generators' hold budget
        self.offloads = OffloadReports()  # collocated: which ranks said their state left the GPU
        self.incarnations: Dict[int, int] = {}  # sim rank -> newest incarnation heard from
        self.discarded = 0  # segments of a restarted simulator's dead incarnation, thrown away
        self._boundary: Tuple = ()

    @property
    def last_arrival(self) -> float:
        """When data last came (the start, before any)."""
        return self.started if self.arrivals.last is None else self.arrivals.last

    def mark_boundary(self, version: int) -> None:
        """Remember the counters as they are between two updates: what a checkpoint of `version` holds."""
        self._boundary = (
            version,
            self.received_steps,
            self.consumed_steps,
            self.dropped,
            len(self.ledger.rows),
            dict(self.counters.values),
        )

    def checkpoint_state(self) -> Tuple[ckpt.TrainerState, List[dict]]:
        version, received, consumed, dropped, rows, counters = self._boundary
        state = ckpt.TrainerState(
            version=version, received_steps=received, consumed_steps=consumed, dropped=dropped, counters=counters
        )
        return state, self.ledger.rows[:rows]

    def restore(self, state: ckpt.TrainerState, rows: List[dict]) -> None:
        """Continue from a checkpoint: its counters and ledger rows (metrics past it are forgotten)."""
        self.received_steps, self.consumed_steps, self.dropped = (
            state.received_steps,
            state.consumed_steps,
            state.dropped,
        )
        self.counters.values.update(state.counters)
        self.counters.add("resumes")
        self.ledger.rows = list(rows)
        kept = keep_metrics_through(self.ctx.run_dir, state.version)
        self.target.add_reports(kept)  # `rollout.stop_at_success` goes on from them, not anew

    def announce(self, version: int, stop: bool = False, force: bool = False) -> None:
        now = time.monotonic()
        self._version = version
        if force or now - self._last_ctl > 0.1:
            waiting = self.waiting_slots(version)
            self.pub.send(
                msgs.ctl(
                    version,
                    self.consumed_slots,
                    stop,
                    self.taken,
                    waiting,
                    self.published,
                    self.published_at,
                    self.dropped_slots,
                )
            )
            self._last_ctl = now

    def mark_published(self, version: int) -> None:
        """`version`'s weights go out now: what they serve is used only by updates up to version +
        max_staleness, which use what comes after the slots used until now (`Schedule.holds`)."""
        self.published, self.published_at = version, self.consumed_slots - self.dropped_slots

    def waiting_slots(self, version: int) -> int:
        """GRPO in async mode: buffered slots that no batch can use yet, credited to the generators'
        `hold` budget while (and only while) the trainer waits. Without this credit the trainer can wait
        for the rest of a group's episodes while the generators hold until the trainer consumes: neither
        moves. While the trainer waits its version stands still, so what the generators serve meanwhile
        is no staler for it; once it can take a batch the credit is gone (`ctl`'s `waiting`, not latched).
        """
        if not self.schedule.whole_groups or self.ready(version):
            return 0
        credited = self.schedule.credited(self.buffer, full=self.full_since is not None)  # `ready` just set it
        return sum(seg.length for seg in credited) * self.cfg.model.steps_per_decision

    def receive(self, timeout_ms: int) -> None:
        msg = self.pull.recv(timeout_ms)
        if msg is not None:
            self.arrivals.arrived(time.monotonic())
        while msg is not None:
            if msg.kind == msgs.SIM_RESTART:
                self._restarted(int(msg.meta["sim_rank"]), int(msg.meta["incarnation"]))
            elif msg.kind == msgs.SEGMENT:
                seg = msgs.decode_segment(msg)
                if not self._admit(seg):
                    msg = self.pull.recv(0)
                    continue
                self.buffer.append(seg)
                self.buffered_steps += seg.steps
                self.received_steps += seg.steps
                self.received_from[seg.sim_rank] = self.received_from.get(seg.sim_rank, 0) + 1
                if seg.episode_done and seg.scored:
                    self.window.append(bool(seg.success))
                    self.failures.offer(seg)
            elif msg.kind == msgs.PHASE_END:
                if int(msg.meta.get("incarnation", 0)) < self.incarnations.get(int(msg.meta["sim_rank"]), 0):
                    msg = self.pull.recv(0)
                    continue
                self.phase_ends.setdefault(int(msg.meta["version"]), set()).add(int(msg.meta["sim_rank"]))
            elif msg.kind == msgs.SIM_DONE:
                self.sims_done[int(msg.meta["sim_rank"])] = (int(msg.meta["segments"]), int(msg.meta["steps"]))
            elif msg.kind == msgs.OFFLOADED:
                self.offloads.add(int(msg.meta["version"]), str(msg.meta["role"]), int(msg.meta["rank"]))
            msg = self.pull.recv(0)
        self.counters.sample("buffered_steps", self.buffered_steps)

    def _restarted(self, rank: int, incarnation: int) -> None:
        """A simulator's worker was restarted. In the lock-step modes its new incarnation redoes the current
        phase, so what the dead one shipped of it is discarded (counted, never trained on, not in the ledger);
        async segments are whole and stay. The dead one's open segments died with it."""
        if incarnation <= self.incarnations.get(rank, 0):
            return
        self.incarnations[rank] = incarnation
        self.counters.add("simulator_restarts")
        log.warning("simulator[%d] restarted (incarnation %d)", rank, incarnation)
        self.received_from[rank] = 0
        if not self.schedule.lockstep:
            return
        for ends in self.phase_ends.values():
            ends.discard(rank)
        keep: Deque[msgs.Segment] = deque()
        for seg in self.buffer:
            if seg.sim_rank == rank:
                self._discard(seg)
            else:
                keep.append(seg)
        self.buffer = keep

    def _admit(self, seg: msgs.Segment) -> bool:
        """Whether a segment may be buffered: not from a dead incarnation (lock-step), not from a finished phase."""
        if seg.incarnation > self.incarnations.get(seg.sim_rank, 0):
            self._restarted(seg.sim_rank, seg.incarnation)
        if self.schedule.lockstep and (
            seg.incarnation < self.incarnations.get(seg.sim_rank, 0) or seg.version < self._version
        ):
            self._discard(seg, buffered=False)
            return False
        return True

    def _discard(self, seg: msgs.Segment, buffered: bool = True) -> None:
        if buffered:
            self.buffered_steps -= seg.steps
            self.received_steps -= seg.steps
        self.discarded += 1
        self.counters.add("discarded_segments")
        self.counters.add("discarded_steps", seg.steps)

    def ready(self, version: int) -> bool:
        full = self.schedule.update_ready(
            self.buffer, self.buffered_steps, len(self.phase_ends.get(version, ())), self.ctx.info.ranks["simulator"]
        )
        if not full:
            self.full_since = None
            return False
        now = time.monotonic()
        if self.full_since is None:
            self.full_since = now
        held_s, silent_s = now - self.full_since, now - self.last_arrival
        return not self.schedule.awaits_groups(self.buffer, version, held_s, silent_s, self.arrivals.silence_s())

    def take(self, version: int) -> List[msgs.Segment]:
        """The next batch (`Schedule.take`); segments past the staleness bound are dropped and counted."""
        now = self.ctx.now()
        batch = self.schedule.take(self.buffer, version)
        self.full_since = None
        for seg in batch.consumed:
            self.buffered_steps -= seg.steps
            self.consumed_steps += seg.steps
            self.consumed_slots += seg.length * self.cfg.model.steps_per_decision
            stale = self.schedule.stale(version, seg.version)
            self.ledger.add(seg, version, used=not stale, dropped=stale, t_consumed=now)
            if stale:
                self.dropped += 1
                self.dropped_slots += seg.length * self.cfg.model.steps_per_decision
                self.counters.add("dropped_segments")
                self.counters.add("dropped_steps", seg.steps)
        self.buffer = deque(batch.rest)
        self.phase_ends.pop(version, None)
        return batch.used

    def report(self, version: int, used: List[msgs.Segment], stats: Dict[str, float], update_s: float) -> None:
        wall = time.monotonic() - self.started
        lags = np.asarray([version - s.version for s in used]) if used else np.zeros(1)
        row = {
            "version": version + 1,
            "env_steps": self.received_steps,
            "consumed_steps": self.consumed_steps,
            "wall_s": wall,
            "charts/SPS": self.received_steps / wall if wall > 0 else 0.0,
            SUCCESS_KEY: float(np.mean(self.window)) if self.window else float("nan"),
            EPISODES_KEY: len(self.window),
            "staleness/mean": float(lags.mean()),
            "staleness/p50": float(np.percentile(lags, 50)),
            "staleness/p99": float(np.percentile(lags, 99)),
            "staleness/max": int(lags.max()),
            "staleness/dropped_segments": self.dropped,
            "trainer/update_s": update_s,
            "trainer/batch_segments": len(used),
            **stats,
        }
        append_metrics(self.ctx.run_dir, row)
        log.info(
            "progress v=%d env_steps=%d success=%.2f SPS=%.0f lag_mean=%.2f dropped=%d",
            version + 1,
            self.received_steps,
            row[SUCCESS_KEY],
            row["charts/SPS"],
            row["staleness/mean"],
            self.dropped,
        )
        self.target.add(sum(self.window), len(self.window))
        self.window = []
        self.counters.add("updates")
        self.counters.busy(update_s)
        self.counters.set("env_steps", self.received_steps)
        self.counters.maybe_write()
        self.heartbeat.beat(version + 1, f"env_steps={self.received_steps}")

    def drain(self, version: int, deadline_s: Optional[float] = None) -> None:
        """After the last update: keep announcing the stop and taking segments until every simulator
        has said it is done (so the ledger holds every segment shipped), or the running deadline."""
        sims = self.ctx.info.ranks["simulator"]
        deadline_s = self.ctx.deadlines.running_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + deadline_s
        while len(self.sims_done) < sims and time.monotonic() < deadline:
            self.announce(version, stop=True)
            self.receive(20)
        missing = [f"simulator[{r}]" for r in range(sims) if r not in self.sims_done]
        if missing:
            log.warning("stopping without the last word of %s after %g s", ", ".join(missing), deadline_s)
        for rank, (segments, _) in sorted(self.sims_done.items()):
            if self.received_from.get(rank, 0) != segments:
                log.warning(
                    "simulator[%d] shipped %d segments, %d arrived", rank, segments, self.received_from.get(rank, 0)
                )

    def close(self) -> None:
        now = self.ctx.now()
        for seg in self.buffer:  # received but never consumed: still one ledger row each
            self.ledger.add(seg, -1, used=False, dropped=False, t_consumed=now)
        self.ledger.write()
        self.failures.close()
        self.events.flush()
        self.counters.maybe_write(force=True)
        self.heartbeat.beat(None, f"finished env_steps={self.received_steps}", force=True)


def generator_states(run_dir) -> Dict[str, str]:
    """Each generator rank's last reported state ('holding' or 'serving'), from its heartbeat."""
    states = {}
    for name, beat in read_heartbeats(run_dir, "generator").items():  # damaged ones skipped: only a hint
        states[name] = "holding" if beat.get("progress", "").endswith("holding") else "serving"
    return states


def check_starved(silent_s: float, limit_s: float, generators: Dict[str, str]) -> None:
    """The trainer's wait for data has a deadline too: if nothing arrived for `limit_s` while every
    generator holds (the `hold` budget waits for an update that needs that very data), say so and stop."""
    if silent_s < limit_s or not generators or any(s != "holding" for s in generators.values()):
        return
    raise RuntimeError(
        f"no data for {silent_s:.0f} s while every generator holds ({', '.join(sorted(generators))}): the "
        "trainer waits for a batch the hold budget will not let rollouts finish; raise rollout.max_staleness "
        "or algo.steps_per_update (the budget is (max_staleness + 1) x steps_per_update), or use "
        "rollout.stale_policy: drop"
    )


def share_batch(
    batch: Optional[TrainBatch], version: int, dp: DataParallel, src: int
) -> Tuple[int, Optional[TrainBatch]]:
    """Send (rank 0) or receive (other trainer ranks) one batch; None means stop. No pickling.

    Every rank gets the batch whole but for its observations, by far the largest part: of those only the rows it
    holds (`DataParallel.held_rows`), sent to it alone; rank 0 keeps its own rows' (the batch it returns).
    A receiver skips the keep-alives rank 0 sends while it waits for data (`send_keepalive`)."""
    group = dp.group
    if batch is not None or dist.get_rank() == src:
        tensors = {} if batch is None else {**batch.tensors, "_instructions": encode_strings(batch.instructions)}
        whole = {k: v for k, v in tensors.items() if not is_observation(k)}
        observed = {k: v for k, v in tensors.items() if is_observation(k)}
        send_meta(
            {
                "version": version,
                "stop": batch is None,
                "keys": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in whole.items()],
                "rows_of": [[k, str(v.dtype).removeprefix("torch."), list(v.shape[1:])] for k, v in observed.items()],
            },
            group,
            src,
        )
        for value in whole.values():
            dist.broadcast(value.contiguous(), src, group=group)
        if batch is None:
            return version, None
        lengths = batch.tensors["length"]
        for rank in range(1, dp.size):
            held, dst = dp.held_rows(lengths, rank), dist.get_global_rank(cast(dist.ProcessGroup, group), rank)
            for value in observed.values():
                dist.send(value[held].contiguous(), dst, group=group)
        return version, batch.holding(dp.held_rows(lengths))
    meta = receive_meta(group, src)
    while meta.get("keepalive"):
        meta = receive_meta(group, src)
    if meta["stop"]:
        return meta["version"], None
    tensors = {}
    for key, dtype, shape in meta["keys"]:
        value = torch.zeros(shape, dtype=getattr(torch, dtype))
        dist.broadcast(value, src, group=group)
        tensors[key] = value
    held = dp.held_rows(tensors["length"])
    for key, dtype, shape in meta["rows_of"]:
        value = torch.zeros((len(held), *shape), dtype=getattr(torch, dtype))
        dist.recv(value, src, group=group)
        tensors[key] = value
    instructions = decode_strings(tensors.pop("_instructions"))
    return meta["version"], TrainBatch(tensors, instructions, held)


def send_keepalive(version: int, group, src: int) -> None:
    """Rank 0, waiting for data: tell the other trainer ranks, blocked in `share_batch`, to keep waiting.

    Their collective would otherwise fail at the group's timeout with gloo's own message whenever a
    rollout phase (a simulator's start-up, a slow scene) lasts longer; with these it fails only when
    rank 0 itself stops answering."""
    send_meta({"version": version, "stop": False, "keepalive": True, "keys": []}, group, src)


def build_trainer_policy(cfg: TrainerConfig, ctx: RankContext, group: Optional[dist.ProcessGroup]) -> torch.nn.Module:
    """The policy every trainer rank starts from: whole, or (fsdp) sharded over `group`."""
    torch.manual_seed(cfg.rollout.seed)  # every trainer rank starts from the same parameters
    dims = ctx.member("simulator", 0).extra
    if cfg.trainer.strategy == "fsdp":
        assert group is not None  # made for one trainer too
        return build_sharded_policy(cfg.model, dims, cfg.trainer, group, ctx.device)
    return build_policy(cfg.model, **dims).to(ctx.device)


@dataclass
class Shards:
    """trainer.strategy fsdp: the trainers' group every publication, checkpoint and the final model gather over,
    rank 0 (`src`) telling the others after each update what to join (`Command`). None with replicate."""

    group: dist.ProcessGroup
    src: int
    policy: torch.nn.Module
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def tell(self, command: Command) -> None:
        send_command(command, self.group, self.src)

    def full_state(self, keep: bool, publication: bool = False) -> Dict[str, torch.Tensor]:
        """The full weights (a collective), or with `publication` what a weight publication sends; rank 0 keeps
        them in host memory (`keep`), the others get {}."""
        return gather_full_state(self.policy, self.bucket_bytes, keep, publication=publication)


def check_strategy(cfg: TrainerConfig, ranks: int) -> None:
    """What the loader refuses too (`fsdp_problem`), checked again here: a spec from elsewhere fails with the field."""
    problem = fsdp_problem(cfg.trainer, ranks, cfg.layout)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")


def run(ctx: RankContext, cfg: TrainerConfig) -> int:
    """Entry point of a trainer rank."""
    signals.install(drain_on_term=True)
    pull = pub = None
    ports = {}
    if ctx.rank == 0:
        _forget_published_weights(ctx)
        pull = Pull(  # every message it takes is checked by its kind's decoder (msgs.TRAINER_INTAKE)
            ctx.secret,
            channel=msgs.channel(ctx.job_key, "segments"),
            name="segments",
            accepts=msgs.TRAINER_INTAKE,
            max_frame_bytes=cfg.max_frame_bytes,
        )
        pub = Pub(ctx.secret, channel=msgs.channel(ctx.job_key, msgs.CTL), name="ctl")
        pull.bind(ctx.address)
        pub.bind(ctx.address)
        ports = {"segments": pull.port, "ctl": pub.port}
    meet(ctx, ports=ports, roles=world_roles(cfg.rollout.weight_sync))
    assert ctx.world is not None, "the trainers are always in the distributed world (world_roles)"
    trainers = ctx.world.ranks_of("trainer")
    publisher = None
    if ctx.rank == 0:  # the weight-sync group first: see data_parallel_group
        publisher = make_publisher(
            cfg.rollout.weight_sync,
            run_dir=ctx.run_dir,
            world=ctx.world,
            device=ctx.device,
            timeout_s=ctx.deadlines.first_s,
            stopped=signals.requested,
        )
    # Followers wait in this group while rank 0 waits on deadlines of its own (the offload handshake,
    # runtime.timeout_s): outlast those, so that rank 0's error naming the culprit comes first.
    sharded = cfg.trainer.strategy == "fsdp"
    check_strategy(cfg, len(trainers))
    group = data_parallel_group(trainers, ctx.deadlines.first_s + ctx.deadlines.running_s, always=sharded)
    policy = build_trainer_policy(cfg, ctx, group)
    shards = None
    if sharded:
        assert group is not None
        shards = Shards(group, trainers[0], policy)
        dp: DataParallel = ShardedDataParallel(group, ctx.rank, len(trainers))
    else:
        dp = DataParallel(group, ctx.rank, len(trainers))
    learner = make_learner(cfg.algo, policy, dp, cfg.rollout.seed, cfg.trainer)
    optimizer = getattr(learner, "opt", None)
    # The newest checkpoint that verifies (every rank checks the same files; rank 0 records a fallback).
    required = ckpt.SHARDED_REQUIRED if sharded else ckpt.required_files(optimizer)
    ckpt.check_sharding(ctx.run_dir, sharded)
    resume_from = ckpt.resume_point(ctx.run_dir, record=ctx.rank == 0, required=required)
    start = None
    if resume_from is not None and shards is not None:
        start = ckpt.load_sharded(resume_from, policy, optimizer, shards.group)  # a collective: DCP reshards
    elif resume_from is not None:
        start = ckpt.load(resume_from, policy, optimizer, ctx.device, verify_first=False)
    signals.ready()
    if ctx.rank == 0:
        assert pull is not None and pub is not None  # bound above by rank 0
        col = Collector(cfg, ctx, pull, pub)
        if start is not None:
            assert resume_from is not None  # start was loaded from it
            col.restore(start, ckpt.ledger_rows(resume_from))
        code = lead(cfg, ctx, policy, learner, col, publisher, dp, trainers[0], start.version if start else 0, shards)
    else:
        code = follow(cfg, ctx, policy, learner, dp, trainers[0], start.version if start else 0, shards)
    ctx.world.close()
    return code


def data_parallel_group(trainers: List[int], timeout_s: float, always: bool = False) -> Optional[dist.ProcessGroup]:
    """The trainers' group (None for one trainer unless `always`: fsdp shards over it even alone), made after
    trainer[0] made its weight-sync group.

    torch names a locally synchronised group (`dist.new_subgroup`) by its members and the number
    of groups the caller already holds. trainer[0] holds the weight-sync group too, so with
    `new_subgroup` trainer[0] and the other trainers would pick different names and wait for each
    other forever. A group made without local synchronisation is named by a counter that only such
    calls advance; each trainer makes exactly this one, so the names agree. Ranks outside the
    group need not take part (torch adds no world barrier unless TORCH_DIST_INIT_BARRIER=1).
    """
    if len(trainers) == 1 and not always:
        return None
    return dist.new_group(ranks=sorted(trainers), timeout=timedelta(seconds=timeout_s), use_local_synchronization=False)


def _forget_published_weights(ctx: RankContext) -> None:
    """Weight files of an earlier attempt (newer than the checkpoint we resume from) must not reach a
    generator: remove them before meeting (generators look only after the meeting)."""
    from vlaslurm.runtime.weights import weights_dir

    directory = weights_dir(ctx.run_dir)
    if directory.is_dir():
        for path in directory.iterdir():
            path.unlink(missing_ok=True)


def save_checkpoint(
    cfg: TrainerConfig,
    ctx: RankContext,
    col: Collector,
    policy,
    learner,
    shards: Optional[Shards] = None,
    tmp: Optional[Path] = None,
) -> None:
    """Rank 0 saves alone (replicate), or with the other ranks, already told the folder `tmp` (fsdp)."""
    state, rows = col.checkpoint_state()
    t0 = time.monotonic()
    optimizer = getattr(learner, "opt", None)
    if shards is None:
        ckpt.save(ctx.run_dir, state, policy, optimizer, rows, cfg.checkpoint.keep)
    else:
        assert tmp is not None  # made by `sharded_save_folder`, named in the command
        ckpt.save_sharded(ctx.run_dir, tmp, state, policy, optimizer, rows, cfg.checkpoint.keep, shards.group)
    col.events.add("checkpoint", t=ctx.now(), v=state.version, s=time.monotonic() - t0)


def lead(
    cfg: TrainerConfig,
    ctx: RankContext,
    policy,
    learner,
    col: Collector,
    publisher,
    dp: DataParallel,
    src: int,
    version: int = 0,
    shards: Optional[Shards] = None,
) -> int:
    """Trainer rank 0: collect, update, publish, until `rollout.total_env_steps` or a drain signal."""
    group = dp.group
    set_context(version=version)
    col.mark_boundary(version)
    drained = None
    finished = False
    tracker = open_tracker(cfg.tracking, ctx.run_dir)  # MLflow, from its own thread (vlaslurm.tracking)
    offloader = trainer_offloader(ctx, cfg.layout, policy, learner, col.events)
    # fsdp: the followers join this gather
    first = shards.full_state(keep=True, publication=True) if shards is not None else None
    leave_device(ctx, col, offloader, version, ctx.deadlines.first_s)  # the other ranks are still starting
    publisher.publish(version, publication_state(policy) if first is None else first)
    col.mark_published(version)
    del first
    idle = Idle(ctx, col, group, src)
    evals = PeriodicEval(cfg.eval, ctx.run_dir, ctx.device)
    try:
        while True:
            if signals.requested():
                drained = signals.requested()
                break
            col.announce(version)
            col.receive(20)
            if not col.ready(version):
                idle.wait(version)
                continue
            used = col.take(version)
            if not used:
                continue
            # Lock-step simulators wait for the next version as long as this beats (simulator.wait_version).
            with col.heartbeat.during(version, f"env_steps={col.received_steps} updating"):
                run_update(cfg, ctx, policy, learner, col, offloader, dp, src, used, version)
                if col.received_steps >= cfg.rollout.total_env_steps or col.target.reached:
                    if col.target.reached:
                        log.info("stopping at %d env steps: %s", col.received_steps, col.target.describe())
                    if shards is not None:
                        shards.tell(Command())  # the followers wait for a command after every update
                    break
                version += 1
                set_context(version=version)
                col.mark_boundary(version)
                if shards is not None:
                    sharded_boundary(cfg, ctx, col, offloader, publisher, policy, learner, shards, version)
                    continue
                if version % cfg.checkpoint.every_versions == 0:
                    save_checkpoint(cfg, ctx, col, policy, learner)
                evals.maybe_start(policy, version, col.received_steps)
                if signals.requested():
                    continue  # saved at the top of the loop (again only if not just saved)
                if publishes(cfg, version):
                    publish_version(ctx, col, offloader, publisher, policy, version)
        finished = True
    finally:
        if group is not None:
            share_batch(None, version, dp, src)
        final = stop_shards(cfg, ctx, col, policy, learner, shards, drained, finished and not drained, version)
        if drained and shards is None:
            save_drained(cfg, ctx, col, policy, learner, drained, version)
        col.drain(version, deadline_s=2.0 if drained else None)
        col.close()
        evals.close(wait_s=0.0 if drained else ctx.deadlines.running_s)  # before the tracker: its result is sent
        # FINISHED: a run that reached rollout.stop_at_success ends short of the total
        tracker.close(status="FINISHED" if finished and col.target.reached else None, wait_for_start=not drained)
        publisher.close()
    if drained:
        return signals.REQUEUE_EXIT
    final_policy = policy if final is None else unsharded_policy(cfg, ctx, final)
    _save_final(final_policy, ctx, version + 1, col.received_steps, col.target.reached)
    log.info(
        "finished: %d env steps, %d versions, %d segments dropped, %d discarded",
        col.received_steps,
        version + 1,
        col.dropped,
        col.discarded,
    )
    return 0


def sharded_boundary(
    cfg: TrainerConfig,
    ctx: RankContext,
    col: Collector,
    offloader: Offloader,
    publisher,
    policy,
    learner,
    shards: Shards,
    version: int,
) -> None:
    """fsdp, rank 0, between two updates: decide, tell the other ranks, then save and publish with them. A drain
    signal that comes now skips the publication; the top of the loop saves (again only if not just saved)."""
    tmp = sharded_save_folder(ctx, version) if version % cfg.checkpoint.every_versions == 0 else None
    publish = publishes(cfg, version) and not signals.requested()
    shards.tell(Command(publish=publish, checkpoint=str(tmp or "")))
    if tmp is not None:
        save_checkpoint(cfg, ctx, col, policy, learner, shards, tmp)
    if publish:
        # Gathered before the announcement: the generators wait for the weights from the moment they are announced.
        publish_version(ctx, col, offloader, publisher, policy, version, shards.full_state(True, publication=True))


def sharded_save_folder(ctx: RankContext, version: int) -> Path:
    """Rank 0 makes the temporary folder of a sharded save of `version` before telling the other ranks its name."""
    tmp = ckpt.fresh_tmp(ctx.run_dir, version)
    tmp.mkdir(mode=0o700)
    return tmp


def stop_shards(
    cfg: TrainerConfig,
    ctx: RankContext,
    col: Collector,
    policy,
    learner,
    shards: Optional[Shards],
    drained: Optional[str],
    final: bool,
    version: int,
) -> Optional[Dict[str, torch.Tensor]]:
    """fsdp, rank 0, after the stop: with the other ranks, the drain's checkpoint or the final model's gather."""
    if shards is None:
        return None
    save = bool(drained) and not saved_at(ctx, version)
    tmp = sharded_save_folder(ctx, version) if save else None
    shards.tell(Command(checkpoint=str(tmp or ""), final=final))
    if tmp is not None:
        save_checkpoint(cfg, ctx, col, policy, learner, shards, tmp)
    if drained:
        say_drained(drained, version)
    return shards.full_state(keep=True) if final else None


def unsharded_policy(cfg: TrainerConfig, ctx: RankContext, state: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """The final model of an fsdp trainer, whole in rank 0's host memory, to save as the replicated one is."""
    policy = cast(torch.nn.Module, build_policy(cfg.model, **ctx.member("simulator", 0).extra))
    load_trained_state(policy, state)
    return policy


class Idle:
    """Trainer rank 0 while no batch is ready: heartbeat, the starvation check, keep-alives to the followers."""

    def __init__(self, ctx: RankContext, col: Collector, group, src: int) -> None:
        self.ctx, self.col, self.group, self.src = ctx, col, group, src
        self.keepalive_s = min(ctx.deadlines.first_s, ctx.deadlines.running_s) / 4  # well inside the group's timeout
        self.last_keepalive = time.monotonic()

    def wait(self, version: int) -> None:
        col = self.col
        col.heartbeat.beat(version, f"env_steps={col.received_steps} waiting for data")
        check_starved(
            time.monotonic() - col.last_arrival, self.ctx.deadlines.running_s, generator_states(self.ctx.run_dir)
        )
        if self.group is not None and time.monotonic() - self.last_keepalive > self.keepalive_s:
            send_keepalive(version, self.group, self.src)
            self.last_keepalive = time.monotonic()


def run_update(
    cfg: TrainerConfig,
    ctx: RankContext,
    policy,
    learner,
    col: Collector,
    offloader: Offloader,
    dp: DataParallel,
    src: int,
    used: List[msgs.Segment],
    version: int,
) -> None:
    """One update of version `version` on the batch `used`, joined by the follower ranks; then its report."""
    if col.schedule.lockstep:
        col.taken = version
        col.announce(version, force=True)  # the phase is over: collocated generators leave the GPU
    enter_device(ctx, col, offloader, version)
    if hasattr(policy, "set_std_progress"):
        policy.set_std_progress(min(1.0, col.received_steps / cfg.rollout.total_env_steps))
    t0, ev0 = time.monotonic(), ctx.now()
    batch = collate(used)
    if dp.group is not None:
        batch = cast(TrainBatch, share_batch(batch, version, dp, src)[1])
    stats = learner.update(batch.to(ctx.device), version)
    col.events.add("update", t0=ev0, t1=ctx.now(), v=version, segments=len(used), steps=sum(s.steps for s in used))
    col.report(version, used, stats, time.monotonic() - t0)


def publishes(cfg: TrainerConfig, version: int) -> bool:
    """Whether `version`'s weights go out: every `rollout.publish_every`-th version (async only, checked at load;
    RL-VLA³ publishes once per global step). Generators meanwhile serve the last published one."""
    return version % cfg.rollout.publish_every == 0


def publish_version(
    ctx: RankContext,
    col: Collector,
    offloader: Offloader,
    publisher,
    policy,
    version: int,
    gathered: Optional[Dict[str, torch.Tensor]] = None,
) -> None:
    """Hand `version` to the generators: `models.publication_state` of `policy` (what trains: with LoRA the adapters
    and the heads, the generators hold `model.path`'s frozen rest; under `lora.publish: merged` the adapted layers'
    merged weights), or that publication `gathered` from shards."""
    col.events.add("publish", t=ctx.now(), v=version)
    col.mark_published(version)
    # Announce first: generators look for weights when announced (a broadcast waits for all of them);
    # lock-step requests for the new version wait at the generator until it is installed.
    col.announce(version, force=True)
    leave_device(ctx, col, offloader, version, ctx.deadlines.running_s)
    state = publication_state(policy) if gathered is None else gathered
    try:
        publisher.publish(version, state)  # the WeightPublisher protocol: no per-call timeout
    except Exception as err:
        # A preemption's TERM reaches every rank at once: the generators it ends cannot take these weights. The
        # drain must still save its checkpoint (the loop's next turn does), so only this publication is lost.
        if not signals.requested():
            raise
        log.warning(
            "%s came during the publication of v%d (%s); checkpointing without it", signals.requested(), version, err
        )


def save_drained(cfg: TrainerConfig, ctx: RankContext, col: Collector, policy, learner, why: str, version: int) -> None:
    """A drain signal came: make sure a checkpoint of `version` exists before every rank stops."""
    if not saved_at(ctx, version):
        save_checkpoint(cfg, ctx, col, policy, learner)
    say_drained(why, version)


def saved_at(ctx: RankContext, version: int) -> bool:
    """Whether the newest checkpoint is `version`'s (a drain right after a periodic save need not save again)."""
    newest = ckpt.latest(ctx.run_dir)
    return newest is not None and newest.name == RunDir(ctx.run_dir).checkpoint(version).name


def say_drained(why: str, version: int) -> None:
    log.warning(
        "%s: checkpoint v%d saved; stopping every rank (a requeue or `vlaslurm resume` continues from it)", why, version
    )


def follow(
    cfg: TrainerConfig,
    ctx: RankContext,
    policy,
    learner,
    dp: DataParallel,
    src: int,
    version: int = 0,
    shards: Optional[Shards] = None,
) -> int:
    """Other trainer ranks: take each batch from rank 0 and join the update (fsdp: and what rank 0 says next)."""
    group = dp.group
    events = EventLog(ctx.run_dir, "trainer", ctx.rank)
    # Rank 0 publishes the weights, which bring the generators back, only once every trainer rank said it is off.
    offloader = trainer_offloader(
        ctx, cfg.layout, policy, learner, events, OffloadReporter.of(ctx, "trainer", cfg.layout)
    )
    try:
        if shards is not None:
            shards.full_state(keep=False, publication=True)  # rank 0's first publication
        while True:
            offloader.offload(version)  # a rollout phase: the GPU is the generator's
            # Rank 0 sends the batch only once every generator left the GPU: receiving it is our signal to move on.
            version, batch = share_batch(None, version, dp, src)
            if batch is None:
                if shards is not None:
                    join(cfg, ctx, learner, shards, receive_command(group, src))
                return 0
            set_context(version=version)
            offloader.onload(version)
            t0 = ctx.now()
            learner.update(batch.to(ctx.device), version)
            events.add("update", t0=t0, t1=ctx.now(), v=version, segments=len(batch.instructions))
            version += 1
            if shards is not None:
                join(cfg, ctx, learner, shards, receive_command(group, src))
    finally:
        events.flush()
        offloader.close()


def join(cfg: TrainerConfig, ctx: RankContext, learner, shards: Shards, command: Command) -> None:
    """fsdp, a follower: the collectives rank 0 announced, in rank 0's order (save, then gather)."""
    if command.checkpoint:
        optimizer = getattr(learner, "opt", None)
        tmp = Path(command.checkpoint)
        ckpt.save_sharded(ctx.run_dir, tmp, None, shards.policy, optimizer, [], cfg.checkpoint.keep, shards.group)
    if command.publish or command.final:  # never both: a publication between updates, the final model after them
        shards.full_state(keep=False, publication=command.publish)


def trainer_offloader(
    ctx: RankContext, layout: str, policy, learner, events: EventLog, report: Optional[OffloadReporter] = None
) -> Offloader:
    """A trainer rank's model and optimizer state, in host memory during rollouts in the collocated layout."""
    # Gradients are dropped, not moved: every optimizer step starts from zero_grad(set_to_none=True).
    return Offloader(
        offloads(layout),
        ctx.device,
        events,
        ctx.now,
        module=policy,
        optimizer=getattr(learner, "opt", None),
        drop_grads=True,
        report=report,
    )


def leave_device(ctx: RankContext, col: Collector, offloader: Offloader, version: int, timeout_s: float) -> None:
    """Trainer rank 0, collocated: move off the GPU for the rollout phase of `version` and wait until every
    other trainer rank said it did too, before the weights that bring the generators back go out."""
    offloader.offload(version)
    if offloader.enabled:
        col.offloads.wait(
            version,
            "trainer",
            range(1, ctx.info.ranks["trainer"]),
            timeout_s,
            lambda: col.receive(20),
            "trainer rank 0's publication of the weights",
        )


def enter_device(ctx: RankContext, col: Collector, offloader: Offloader, version: int) -> None:
    """Trainer rank 0, collocated: move onto the GPU for the update of `version` once every generator said
    that its model left it (announcing meanwhile: a generator that missed the phase's end learns it)."""

    def pump() -> None:
        col.announce(version)
        col.receive(20)

    if offloader.enabled:
        col.offloads.wait(
            version,
            "generator",
            range(ctx.info.ranks["generator"]),
            ctx.deadlines.running_s,
            pump,
            "the trainers' move onto the GPU",
        )
    offloader.onload(version)


def _save_final(policy, ctx: RankContext, versions: int, env_steps: int, target_reached: bool) -> None:
    if hasattr(policy, "save_pretrained"):
        policy.save_pretrained(str(RunDir(ctx.run_dir).final_model))
    ended_by = "rollout.stop_at_success" if target_reached else "rollout.total_env_steps"
    write_final_summary(ctx.run_dir, versions, env_steps, ended_by, ckpt.param_checksum(policy))
