"""The generator role: dynamic batching of observation requests into policy forwards.

A batch is served when `rollout.batching.max_batch` items wait, the oldest has waited
`max_wait_ms`, or (lock-step) every simulator of this generator has asked; each reply carries its
policy version, and new weights are installed between batches. Requests for a newer version, and
with `stale_policy: hold` rollouts too far ahead, wait (`held`). Collocated, the model leaves the
GPU for the trainer's update. Details: docs/runtime.md
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from vlaslurm.log import get_logger, set_context
from vlaslurm.models import PolicyInput, build_policy, load_trained_state, prepare_to_serve
from vlaslurm.rundir import Counters, EventLog, Heartbeat
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime import signals
from vlaslurm.runtime.context import RankContext, meet, world_roles
from vlaslurm.runtime.offload import HOST, Offloader, OffloadReporter, offloads
from vlaslurm.runtime.schedule import Schedule
from vlaslurm.runtime.transport import PeerUnreachable, Poller, Router, Sub, rejection_counts
from vlaslurm.runtime.weights import make_subscriber, wait_for_version
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.schema import ExperimentSpec, Layout, RolloutConfig

log = get_logger("vlaslurm.generator")
WEIGHTS_CHECK_S = 0.5  # how often the weights are looked for without an announcement
HELD_NOTICE_S = 1.0  # how often a held request is told so again (it also keeps the simulator's deadline alive)
STOP_GRACE_S = 5.0  # how long a generator that lost the trainer's store waits for its stop before calling it dead


@dataclass
class GeneratorConfig:
    """What a generator rank needs from the spec."""

    model: ModelConfig
    rollout: RolloutConfig
    steps_per_update: int
    layout: Layout  # resources.layout: collocated, the model leaves the GPU for the trainer's update
    max_restarts: int  # resources.generator.max_restarts: > 0, its served record is written before it replies
    max_frame_bytes: int = msgs.FRAME_FLOOR_BYTES  # larger frames are refused unread (`msgs.max_frame_bytes`)

    @classmethod
    def from_spec(cls, spec: ExperimentSpec) -> GeneratorConfig:
        return cls(
            spec.model,
            spec.rollout,
            spec.algo.steps_per_update,
            spec.resources.layout,
            spec.max_restarts("generator"),
            msgs.max_frame_bytes(spec.env, spec.model.action_chunk),
        )


@dataclass
class Pending:
    peer: bytes
    request: msgs.ObsRequest
    arrived: float
    told_held: float = 0.0  # when the simulator was last told that this request is held
    arrived_at: float = 0.0  # run clock (comparable with the simulator's records), for the decision breakdown


class Batcher:
    """Which pending requests the next forward serves (the decisions are the schedule's)."""

    def __init__(self, schedule: Schedule, clients: int = 0) -> None:
        self.schedule = schedule
        self.clients = clients  # lock-step: simulators routed here (`Schedule.clients`); 0 = any (async)
        self.pending: List[Pending] = []

    def servable(self, version: int) -> List[Pending]:
        return [p for p in self.pending if self.schedule.servable(p.request.min_version, version)]

    def ready(self, version: int, now: float) -> bool:
        servable = self.servable(version)
        if not servable:
            return False
        senders = len({p.request.sim_rank for p in servable})
        return self.schedule.batch_ready(
            [len(p.request) for p in servable], senders, self.clients, now - servable[0].arrived
        )

    def wait_s(self, version: int, now: float) -> float:
        servable = self.servable(version)
        return max(0.0, servable[0].arrived + self.schedule.max_wait_s - now) if servable else 0.05

    def take(self, version: int, room: Optional[int] = None) -> List[Pending]:
        """Oldest first up to max_batch items, and `room` (the hold budget's); a larger single request alone."""
        servable = self.servable(version)
        batch = servable[: self.schedule.batch_size([len(p.request) for p in servable], room)]
        for p in batch:
            self.pending.remove(p)
        return batch


def to_policy_input(requests: List[msgs.ObsRequest], device: torch.device) -> PolicyInput:
    """Stack the observations of several requests into one batch."""

    def cat(name: str) -> Optional[torch.Tensor]:
        parts = [getattr(r.obs, name) for r in requests]
        return None if parts[0] is None else torch.from_numpy(np.concatenate(parts)).to(device)

    seeds = torch.tensor([s for r in requests for s in r.seeds], dtype=torch.int64)
    return PolicyInput(cat("images"), cat("state"), [i for r in requests for i in r.obs.instructions], seeds)


def replies(
    batch: List[Pending],
    version: int,
    rank: int,
    actions: np.ndarray,
    logprob: np.ndarray,
    value: np.ndarray,
    token_logprob: Optional[np.ndarray] = None,
    replay: Optional[Dict[str, np.ndarray]] = None,
) -> Iterator[Tuple[Pending, msgs.ActReply]]:
    """Each request of `batch` with its reply: its rows of one forward's outputs, in the batch's order."""
    start = 0
    for p in batch:
        n = len(p.request)
        rows = slice(start, start + n)
        tokens = None if token_logprob is None else token_logprob[rows]
        kept = None if replay is None else {k: v[rows] for k, v in replay.items()}
        reply = msgs.ActReply(
            p.request.env_ids,
            p.request.sub_group,
            version,
            actions[rows],
            logprob[rows],
            value[rows],
            rank,
            tokens,
            kept,
        )
        yield p, reply
        start += n


WEIGHT_LAG_ENV = "VLASLURM_DIAG_WEIGHT_LAG"


class WeightLag:
    """A diagnostic (`VLASLURM_DIAG_WEIGHT_LAG=n` in the generator's environment): serve the weights received n
    versions before the newest, still tagged with the newest's version. The behaviour log-probs are the older
    weights', so the trainer's correction sees the truth; the schedule sees no staleness. Sync mode then has
    async's one-update feedback delay and none of its other differences (docs/runtime.md, Diagnostics)."""

    def __init__(self, versions: int) -> None:
        self.versions = versions
        self.kept: List[Dict[str, torch.Tensor]] = []

    @classmethod
    def from_env(cls) -> Optional[WeightLag]:
        versions = int(os.environ.get(WEIGHT_LAG_ENV, "0") or 0)
        return cls(versions) if versions > 0 else None

    def served(self, state_dict) -> Dict[str, torch.Tensor]:
        """The weights to serve now that `state_dict` arrived."""
        self.kept.append({k: v.detach().clone() for k, v in state_dict.items()})
        del self.kept[: -(self.versions + 1)]
        return self.kept[0]


class Generator:
    """One generator rank: its policy, sockets, version and records."""

    def __init__(self, cfg: GeneratorConfig, ctx: RankContext, router: Router) -> None:
        self.cfg, self.ctx, self.router = cfg, ctx, router
        dims = ctx.member("simulator", 0).extra
        collocated = offloads(cfg.layout)  # then the trainer may hold the GPU now: start on the host
        self.policy = build_policy(cfg.model, **dims).to(HOST if collocated else ctx.device).eval()
        merged = prepare_to_serve(self.policy)  # what the trainer's publications hold (model.lora.publish)
        if merged:
            log.info("model.lora.publish merged: serving %d adapted layers as plain layers", merged)
        self.sub = Sub(
            ctx.secret,
            channel=msgs.channel(ctx.job_key, msgs.CTL),
            name="ctl<-trainer[0]",
            accepts=msgs.ANNOUNCEMENTS,
            max_frame_bytes=cfg.max_frame_bytes,
        )
        self.sub.connect(ctx.member("trainer", 0).endpoint("ctl"))
        self.poller = Poller(router, self.sub)
        self.weights = make_subscriber(
            cfg.rollout.weight_sync,
            run_dir=ctx.run_dir,
            world=ctx.world,
            device=ctx.device,
            timeout_s=ctx.deadlines.running_s,
        )
        self.schedule = Schedule.of(cfg.rollout, cfg.steps_per_update)
        ranks = ctx.info.ranks
        self.batcher = Batcher(self.schedule, self.schedule.clients(ctx.rank, ranks["simulator"], ranks["generator"]))
        # A generator that may be killed and restarted writes its served record before it replies, so the
        # record never misses a batch whose actions reached a simulator.
        durable = cfg.max_restarts > 0
        self.events = EventLog(ctx.run_dir, "generator", ctx.rank, flush_every=1 if durable else 512)
        self.incarnation = signals.incarnation()  # tells this process's served record from a killed one's
        self.counters = Counters(ctx.run_dir, "generator", ctx.rank)
        self.counters.gauge(  # forged, replayed, wrong kind, ...; the store's refused values (not with filesystem sync)
            lambda: rejection_counts(self.router, self.sub, store=ctx.world.store if ctx.world else None)
        )
        self.heartbeat = Heartbeat(ctx.run_dir, "generator", ctx.rank)
        self.version = -1
        self.consumed_steps = 0
        self.waiting_steps = 0  # the trainer's current credit for slots it holds but cannot use yet
        self.served_steps = 0
        self.budget_bases: Dict[int, int] = {}  # version -> the slots the trainer had used when it went out
        self.dropped_steps = 0  # slots the trainer dropped as stale
        self.stop = False
        self.holding_since: Optional[float] = None
        self.announced = 0  # newest version whose weights the trainer's announcements say went out
        self._next_weights_check = 0.0
        # The trainer moves onto the GPU only once every generator said that its model left it.
        self.offloader = Offloader(
            collocated,
            ctx.device,
            self.events,
            ctx.now,
            module=self.policy,
            on_device=not collocated,
            report=OffloadReporter.of(ctx, "generator", cfg.layout),
        )
        self.taken = -1  # newest version whose phase the trainer took (lock-step): its model may leave the GPU
        self.replied = [-1.0, -1.0]  # run clock: the last batch's start, and when its replies were sent
        self.weight_lag = WeightLag.from_env()
        if self.weight_lag is not None:
            lag = self.weight_lag.versions
            log.warning("%s=%d: serving weights %d versions old (a diagnostic)", WEIGHT_LAG_ENV, lag, lag)

    def install(self, version: int, state_dict) -> None:
        self.offloader.onload(version)
        load_trained_state(self.policy, state_dict if self.weight_lag is None else self.weight_lag.served(state_dict))
        self.version = version
        newest_older = max((v for v in self.budget_bases if v < version), default=-1)  # stands in for an unheard base
        self.budget_bases = {v: b for v, b in self.budget_bases.items() if v >= newest_older}
        set_context(version=version)
        self.events.add("weights", t=self.ctx.now(), v=version)

    def receive(self, timeout_s: float) -> None:
        for sock in self.poller.poll(int(timeout_s * 1000)):
            if sock is self.sub:
                while (msg := self.sub.recv(0)) is not None:  # checked by the socket (msgs.ANNOUNCEMENTS)
                    ctl = msgs.decode_ctl(msg)
                    self.stop = self.stop or ctl.stop
                    self.consumed_steps = max(self.consumed_steps, ctl.consumed_steps)
                    self.waiting_steps = ctl.waiting  # the latest: it may go down
                    self.announced = max(self.announced, ctl.published)  # weights to fetch
                    self.dropped_steps = max(self.dropped_steps, ctl.dropped)
                    if ctl.published_at >= 0:
                        self.budget_bases[ctl.published] = ctl.published_at
                    self.taken = max(self.taken, ctl.taken)
            else:  # the router, the poller's only other socket; it takes only `obs` (msgs.GENERATOR_INTAKE)
                while (got := self.router.recv(0)) is not None:
                    peer, msg = got
                    arrived, arrived_at = time.monotonic(), self.ctx.now()
                    self.batcher.pending += [
                        Pending(peer, req, arrived, arrived_at=arrived_at) for req in msgs.decode_requests(msg)
                    ]
        self.counters.sample("queue_len", sum(len(p.request) for p in self.batcher.pending))

    def poll_weights(self):
        """New weights, if any. Asking costs a round trip to the trainer's store, so ask when the trainer
        has announced a newer version, and otherwise only now and then (announcements can be lost)."""
        now = time.monotonic()
        if self.announced <= self.version and now < self._next_weights_check:
            return None
        self._next_weights_check = now + WEIGHTS_CHECK_S
        try:
            return self.weights.poll()
        except torch.distributed.DistError as err:
            # A trainer that finished closes its store at once; its stop may still be on the way to us.
            if self.wait_for_stop(STOP_GRACE_S):
                return None
            raise RuntimeError(
                f"generator[{self.ctx.rank}]: trainer[0]'s store stopped answering ({err}) and no "
                f"stop came within {STOP_GRACE_S:g} s: the trainer died"
            ) from err

    def wait_for_stop(self, seconds: float) -> bool:
        """Take the trainer's announcements for up to `seconds`; whether it said stop."""
        end = time.monotonic() + seconds
        while not self.stop and time.monotonic() < end:
            self.receive(0.05)
        return self.stop

    def hold_room(self) -> Optional[int]:
        """Async `hold`: items the weights served may still serve, since they may serve only what the trainer will
        use from them (`Schedule.hold_room` from `Schedule.hold_base`; None: no budget)."""
        base = self.schedule.hold_base(self.budget_bases, self.version, self.dropped_steps, self.consumed_steps)
        generators = self.ctx.info.ranks["generator"]
        return self.schedule.hold_room(
            self.served_steps, base, self.waiting_steps, generators, self.cfg.model.steps_per_decision
        )

    def serve(self, batch: List[Pending]) -> None:
        self.offloader.onload(self.version)  # only if a phase is redone (a restarted simulator) after the offload
        requests = [p.request for p in batch]
        t0 = self.ctx.now()
        with torch.no_grad():
            out = self.policy.act(to_policy_input(requests, self.ctx.device))
        actions, logprob, value = (x.float().cpu().numpy() for x in (out.actions, out.logprob, out.value))
        tokens = None if out.token_logprob is None else out.token_logprob.float().cpu().numpy()
        replay = None if out.replay is None else {k: v.cpu().numpy() for k, v in out.replay.items()}
        t1 = self.ctx.now()
        items = [[e, ep, st] for r in requests for e, ep, st in zip(r.env_ids, r.episodes, r.steps)]
        self.events.add(
            "batch",
            t0=t0,
            t1=t1,
            v=self.version,
            n=len(items),
            inc=self.incarnation,
            g=sorted({r.sub_group for r in requests}),
            items=items,
            # per request, in the batch's order: (sub-group, first environment, sent, arrived) for the breakdown
            req=[[p.request.sub_group, p.request.env_ids[0], p.request.sent_at, p.arrived_at] for p in batch],
            replied=self.replied,  # the previous batch's start and when its replies went out (recorded before them)
        )
        by_peer: Dict[bytes, List[msgs.ActReply]] = {}  # one message per simulator for all its requests
        for p, reply in replies(batch, self.version, self.ctx.rank, actions, logprob, value, tokens, replay):
            by_peer.setdefault(p.peer, []).append(reply)
        for peer, answers in by_peer.items():
            self.reply(peer, msgs.encode_acts(answers))
        self.replied = [t0, self.ctx.now()]
        now = time.monotonic()
        for p in batch:
            self.counters.sample("request_latency_s", now - p.arrived)
        self.served_steps += len(items) * self.cfg.model.steps_per_decision
        self.counters.busy(t1 - t0)
        self.counters.sample("batch_size", len(items))
        self.counters.add("requests", len(items))

    def step(self) -> None:
        """One turn of the loop: take messages, install weights, maybe serve a batch."""
        holding = self.holding_since is not None
        self.receive(0.05 if holding else min(self.batcher.wait_s(self.version, time.monotonic()), 0.05))
        got = self.poll_weights()
        if self.stop:
            return
        if got is not None:
            self.install(*got)
        elif self.taken >= self.version:
            self.offloader.offload(self.version)  # collocated: the phase is over, the trainer's update is next
        room = self.hold_room()
        if room == 0:
            self.holding_since = self.holding_since or self.ctx.now()
            self.tell_held()
        else:
            self.end_hold()
            if self.batcher.ready(self.version, time.monotonic()):
                self.serve(self.batcher.take(self.version, room))
        self.counters.maybe_write()
        state = "holding" if self.holding_since is not None else "serving"
        self.heartbeat.beat(self.version, f"served_steps={self.served_steps} {state}")

    def reply(self, peer: bytes, message) -> None:
        """A simulator that has gone (it stopped, or failed) no longer needs its answer; that is not our error."""
        try:
            self.router.send(peer, message)
        except PeerUnreachable:
            self.counters.add("replies_to_gone_peers")
            log.warning("%s is gone; its reply is dropped", peer.decode(errors="replace"))

    def tell_held(self) -> None:
        now = time.monotonic()
        for p in self.batcher.pending:
            if now - p.told_held >= HELD_NOTICE_S:
                self.reply(p.peer, msgs.held(p.request.env_ids, self.ctx.rank))
                p.told_held = now

    def end_hold(self) -> None:
        """Count a hold that is over (or cut short by the stop)."""
        if self.holding_since is not None:
            now = self.ctx.now()
            self.counters.add("hold_s", now - self.holding_since)
            self.counters.add("holds")
            self.events.add("hold", t0=self.holding_since, t1=now, v=self.version)
            self.holding_since = None

    def close(self) -> None:
        self.end_hold()
        self.events.flush()
        self.counters.maybe_write(force=True)
        self.heartbeat.beat(self.version, f"finished served_steps={self.served_steps}", force=True)
        self.offloader.close()
        for sock in (self.router, self.sub):
            sock.close()


def run(ctx: RankContext, cfg: GeneratorConfig) -> int:
    """Entry point of a generator rank."""
    signals.install(drain_on_term=False)  # USR2 never kills a generator: the trainer's stop ends it
    router = Router(
        ctx.secret,
        **msgs.generator_channels(ctx.job_key, ctx.rank, os.getpid()),  # the pid its rendezvous file names
        name=f"generator[{ctx.rank}]",
        accepts=msgs.GENERATOR_INTAKE,
        max_frame_bytes=cfg.max_frame_bytes,
    )
    router.bind(ctx.address)
    meet(ctx, ports={"obs": router.port}, roles=world_roles(cfg.rollout.weight_sync))
    gen = Generator(cfg, ctx, router)
    gen.install(*wait_for_version(gen.weights, 0, ctx.deadlines.first_s))
    log.info("serving %s with batches up to %d", cfg.model.type, cfg.rollout.batching.max_batch)
    try:
        while not gen.stop:
            gen.step()
    finally:
        gen.close()
    log.info("finished after serving %d env steps", gen.served_steps)
    if ctx.world is not None:
        ctx.world.close()
    return 0
