"""A discrete-event simulation of the three-role pipeline, one candidate placement at a time.

It replays what the runtime's roles do (vlaslurm/runtime/roles: lock-step or async simulator
ranks, dynamically batching generators, a trainer bounded by `max_staleness`) with costs drawn
from a `Costs`, charging message hops and wake-ups beside the measured work. Throughput is the
runtime's `charts/SPS`, bounded by the CPU seconds of the roles that share cores (`cpu_pools`).
Details: docs/placement.md
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple, cast

import numpy as np

from vlaslurm.placement.costs import Costs
from vlaslurm.runtime.schedule import GROUP_WAIT_S, ArrivalGaps, Pipelined, Schedule
from vlaslurm.spec.schema import BatchingConfig, Mode, RolloutConfig, StalePolicy

MAX_SEGMENT_STEPS = 64  # the simulator's segment length cap (runtime/roles/simulator.py)
ROLES = ("simulator", "generator", "trainer")


@dataclass(frozen=True)
class Candidate:
    """One placement: mode, layout, units (GPUs, or ranks on a CPU-only spec) per role, depth and batching."""

    mode: Mode
    layout: str
    sim: int
    gen: int
    train: int
    depth: int = 1
    max_batch: int = 64
    max_wait_ms: float = 20.0

    @property
    def units(self) -> int:
        """Units the candidate holds: collocated roles share all; hybrid's trainer spans the others'."""
        if self.layout == "collocated":
            return self.sim
        if self.layout == "hybrid":
            return self.sim + self.gen
        return self.sim + self.gen + self.train

    def label(self) -> str:
        k = f" k={self.depth}" if Schedule.kind(self.mode) is Pipelined else ""
        return (
            f"{self.mode}{k} {self.layout} s{self.sim}/g{self.gen}/t{self.train} "
            f"b{self.max_batch} w{self.max_wait_ms:g}"
        )


@dataclass(frozen=True)
class Workload:
    """The spec's numbers that shape the pipeline (not its placement)."""

    num_envs: int
    chunk: int
    steps_per_update: int
    max_staleness: int = 0
    stale_policy: StalePolicy = "drop"
    cpus: Tuple[float, float, float] = (1.0, 1.0, 1.0)  # cpus_per_task of a simulator, generator, trainer rank
    episode_limit: int = 0  # the most env steps an episode lasts (sync phases run at least that long)
    group_size: int = 1  # GRPO: episodes per group (`algo.episodes_per_group`)

    @classmethod
    def from_spec(cls, spec) -> Workload:
        r = spec.rollout
        sim, gen, train = (float(spec.role_resources(role).cpus_per_task) for role in ROLES)
        return cls(
            spec.env.num_envs,
            spec.model.steps_per_decision,
            spec.algo.steps_per_update,
            r.max_staleness,
            r.stale_policy,
            (sim, gen, train),
            spec.env.episode_limit(),
            spec.algo.episodes_per_group,
        )

    def schedule(self, cand: Candidate) -> Schedule:
        """The runtime's schedule of `cand` on this workload: the decisions the simulation shares with the roles."""
        batching = BatchingConfig(cand.max_batch, cand.max_wait_ms)
        rollout = RolloutConfig(
            mode=cand.mode,
            pipeline_depth=cand.depth,
            max_staleness=self.max_staleness,
            stale_policy=self.stale_policy,
            batching=batching,
        )
        return Schedule.of(rollout, self.steps_per_update, self.group_size)

    def chunks_per_phase(self, cand: Candidate) -> int:
        """The decisions of one lock-step phase of `cand`, as the simulator role counts them."""
        return self.schedule(cand).phase_chunks(self.num_envs, self.chunk, self.episode_limit)


@dataclass
class Prediction:
    """What one candidate is predicted to do."""

    sps: float  # env steps the trainer received per second
    used_sps: float  # of which not dropped as stale
    # Busy fraction of the same simulated wall (stretched when the cores bind), per unit of each role:
    # simulator per instance (stepping), generator per replica (forwards, per-request work, weight
    # installs), trainer per trainer group (updates, publishing).
    util: Dict[str, float]
    lag: Dict[str, float]  # Δv over used segments: mean, p50, p99, max
    dropped: float  # fraction of consumed steps dropped, in the steady state (as `sps`)
    updates: int
    sim_seconds: float
    cpu: Dict[str, float] = field(default_factory=dict)  # cores each role keeps busy at `sps`
    cpu_bound: float = math.inf  # env steps/s the shared cores allow (inf: CPU not measured)
    spread: float = 0.0  # relative standard error of `sps` (batch means over time windows, `_spread`)


def cpu_pools(cand: Candidate, work: Workload, host_cores: Optional[float]) -> List[Tuple[Tuple[str, ...], float]]:
    """Which roles share which cores. One host (a local run): all roles share its cores. On a cluster
    each rank gets its role's `cpus_per_task`; collocated roles overlap on the simulator's allocation
    (Slurm sizes it for the largest role), hybrid's trainer overlaps the simulators' and generators'."""
    if host_cores:
        return [(ROLES, float(host_cores))]
    cores = dict(zip(ROLES, (cand.sim * work.cpus[0], cand.gen * work.cpus[1], cand.train * work.cpus[2])))
    if cand.layout == "collocated":
        return [(ROLES, max(cores.values()))]
    pools: List[Tuple[Tuple[str, ...], float]] = [
        (("simulator",), cores["simulator"]),
        (("generator",), cores["generator"]),
    ]
    if cand.layout == "hybrid":
        return pools + [(ROLES, max(cores["simulator"] + cores["generator"], cores["trainer"]))]
    return pools + [(("trainer",), cores["trainer"])]


def cpu_bound(demand: Dict[str, float], pools: List[Tuple[Tuple[str, ...], float]]) -> float:
    """Env steps/s that the pools' cores allow, given each role's CPU seconds per env step."""
    bounds = [cores / need for roles, cores in pools if (need := sum(demand.get(r, 0.0) for r in roles)) > 0]
    return min(bounds, default=math.inf)


class _Env:
    __slots__ = ("gid", "rank", "prof", "t", "ep_len", "seg_v", "seg_rows", "seg_steps", "episode", "seg_index")

    def __init__(self, gid: int, rank: int, prof: int, ep_len: int) -> None:
        self.gid, self.rank, self.prof, self.t, self.ep_len = gid, rank, prof, 0, ep_len
        self.seg_v, self.seg_rows, self.seg_steps = -1, 0, 0
        self.episode, self.seg_index = 0, 0


class _Seg:
    """A shipped segment, as the schedule reads it (`schedule.SegmentFacts`)."""

    __slots__ = ("env_id", "episode", "index", "version", "steps", "slots", "episode_done")

    def __init__(self, e: _Env, slots: int, done: bool) -> None:
        self.env_id, self.episode, self.index, self.version = e.gid, e.episode, e.seg_index, e.seg_v
        self.steps, self.slots, self.episode_done = e.seg_steps, slots, done


@dataclass
class _Req:
    rank: int
    envs: List[_Env]
    group: int
    min_version: int
    arrival: float = 0.0
    gen: int = 0
    booked: bool = False  # the simulator's main thread has taken its step's result
    received: bool = False  # the simulator's main thread has taken its reply


@dataclass
class _Gen:
    queue: List[_Req] = field(default_factory=list)
    busy: bool = False
    version: int = 0
    incoming: int = 0
    wake_at: float = -1.0
    idle_since: float = 0.0  # since when it sleeps in its poll (a request or timer wakes it: Costs.wake_after_s)
    busy_s: float = 0.0
    served: int = 0  # slots (env steps in whole chunks), as the hold budget counts them
    consumed: int = 0
    waiting: int = 0  # the trainer's credit for slots it holds but cannot use yet (whole groups)
    bases: Dict[int, int] = field(default_factory=lambda: {0: 0})  # version -> used slots when it went out
    dropped: int = 0  # slots the trainer dropped as stale


@dataclass
class _Rank:
    envs: List[_Env]
    groups: List[List[_Env]]
    workers: int
    jobs: Deque = field(default_factory=deque)
    running: int = 0
    remaining: Dict[int, int] = field(default_factory=dict)
    phase: int = 0
    outstanding: List[int] = field(default_factory=list)
    main_free: float = 0.0  # when the rank's main thread is done with its bookkeeping
    waiting: set = field(default_factory=set)  # finished instances waiting for their group (whole groups)


def queue_on(free_at: Dict[int, float], device: int, ready: float, seconds: float) -> float:
    """When work of `seconds`, ready at `ready`, ends on `device`, which serves one piece of work at a time in
    arrival order; `free_at` (device -> when it is next free) is updated."""
    free_at[device] = max(ready, free_at.get(device, 0.0)) + seconds
    return free_at[device]


class Pipeline:
    """One simulated run of a candidate."""

    def __init__(self, cand: Candidate, work: Workload, costs: Costs, seed: int = 0) -> None:
        self.c, self.w, self.k = cand, work, costs
        self.rng = np.random.default_rng(seed)
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.sched = work.schedule(cand)
        self.lockstep = self.sched.lockstep
        self.per_phase = work.chunks_per_phase(cand)
        self.per = per = work.num_envs // cand.sim
        prof = costs.instance_map(per)
        self.ranks: List[_Rank] = []
        for r in range(cand.sim):
            envs = [_Env(r * per + j, r, int(prof[j]), self._episode_len()) for j in range(per)]
            groups = [[envs[i] for i in g] for g in self.sched.sub_groups(per)]
            # The simulator steps in worker threads where the env allows it: one per sub-group in lock-step
            # modes (sub-groups side by side), one per instance in async; else inline, one at a time.
            workers = self.sched.step_threads(per, costs.thread_safe) or 1
            self.ranks.append(_Rank(envs, groups, workers, outstanding=[0] * cand.gen))
        self.gens = [_Gen() for _ in range(cand.gen)]
        self.clients = [self.sched.clients(i, cand.sim, cand.gen) for i in range(cand.gen)]
        self.device_free: Dict[int, float] = {}
        self.sim_device_free: Dict[int, float] = {}  # by simulator rank: when its own device is next free
        self.last_step_end: Dict[tuple, float] = {}  # per simulator thread: when its last chunk ended
        # trainer state
        self.version = 0
        self.buffer: Deque[_Seg] = deque()
        self.buffered = 0
        self.received = 0
        self.consumed = 0
        self.consumed_slots = 0  # what the generators' hold budget compares with their served slots
        self.credit = 0  # the slots last credited to that budget as waiting (whole groups)
        self.dropped_steps = 0
        self.dropped_slots = 0
        self.phase_ends: Dict[int, int] = {}
        self.train_busy = False
        self.full_since: Optional[float] = None  # as the trainer role's `Collector.full_since`
        self.arrivals = ArrivalGaps()  # and its `arrivals`
        self.train_busy_s = 0.0
        self.env_busy_s = 0.0
        self.env_steps = 0  # instance steps the simulators executed
        self.cpu_s = dict.fromkeys(ROLES, 0.0)
        self.lags: List[int] = []
        self.reports: List[tuple] = []

    # ------------------------------------------------------------------ event loop
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, self._seq, fn, args))
        self._seq += 1

    def run(self, updates: int = 16, max_events: int = 5_000_000) -> Prediction:
        for r in range(len(self.ranks)):
            self.start(r)
        events = 0
        while self._heap and len(self.reports) < updates and events < max_events:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
            events += 1
        return self._prediction()

    def _episode_len(self) -> int:
        lens = self.k.episode_len
        return int(lens[self.rng.integers(0, len(lens))])

    def _on_device(self, device: int, duration: float, ready: Optional[float] = None) -> float:
        """When work of `duration`, ready at `ready` (now), on a shared device ends (collocated GPU
        simulators share with generators)."""
        ready = self.now if ready is None else ready
        if not (self.c.layout == "collocated" and self.k.sim_on_gpu):
            return ready + duration
        return queue_on(self.device_free, device, ready, duration)

    # ------------------------------------------------------------------ simulator
    def start(self, r: int) -> None:
        rank = self.ranks[r]
        if self.lockstep:
            rank.remaining = {g: self.per_phase for g in range(len(rank.groups))}
            after = self.phase_reset(rank) if self.sched.resets_each_phase else 0.0
            for g, envs in enumerate(rank.groups):
                self.request(r, envs, g, rank.phase, after)
        else:
            for e in rank.envs:
                self.request(r, [e], 0, 0)

    def phase_reset(self, rank: _Rank) -> float:
        """A sync phase starts every instance from reset, in one call; returns how long that takes."""
        for e in rank.envs:
            e.t, e.ep_len = 0, self._episode_len()
            e.episode, e.seg_index = e.episode + 1, 0
        return self.k.reset_s * (len(rank.envs) if self.k.step_rule == "sum" else 1)

    def request(self, r: int, envs: List[_Env], group: int, min_version: int, after: float = 0.0) -> None:
        rank = self.ranks[r]
        gen = self.sched.route(r, rank.outstanding)
        rank.outstanding[gen] += 1
        self.at(self.now + after + self.k.hop_s, self.arrive, _Req(r, envs, group, min_version, gen=gen))

    def reply(self, req: _Req, version: int) -> None:
        """Actions arrive; the rank's main thread receives them (`reply_s`) before a thread can step them."""
        rank = self.ranks[req.rank]
        if self.k.reply_s > 0 and not req.received:
            rank.main_free = self._main_start(rank) + self.k.reply_s
            req.received = True
            self.at(rank.main_free, self.reply, req, version)
            return
        req.received = False
        rank.outstanding[req.gen] -= 1
        rank.jobs.append((req, version))
        self.run_jobs(req.rank)

    def _main_start(self, rank: _Rank) -> float:
        """When the rank's main thread can take a message: after its other work, or, if it has slept
        in its poll since, once the message has woken it (`wake_after_s`)."""
        if rank.main_free >= self.now:
            return rank.main_free
        return self.now + self.k.wake_after_s(self.now - rank.main_free)

    def run_jobs(self, r: int) -> None:
        rank = self.ranks[r]
        while rank.jobs and rank.running < rank.workers:
            req, version = rank.jobs.popleft()
            rank.running += 1
            duration, device = self.chunk_time(req.envs)
            self.env_busy_s += duration * len(req.envs)
            steps = sum(min(self.w.chunk, e.ep_len - e.t) for e in req.envs)
            self.env_steps += steps
            if self.k.cpu:
                self.cpu_s["simulator"] += self.k.cpu.step_s * steps
            handover = self.k.dispatch_s if self.k.thread_safe else 0.0  # main thread -> worker thread
            # The thread that steps it has slept since its last chunk ended: waking it takes `wake_after_s`.
            # (One thread per sub-group or instance, or the main thread inline: never two chunks at once.)
            worker = (r, (req.group if self.lockstep else req.envs[0].gid) if self.k.thread_safe else -1)
            last = self.last_step_end.get(worker, self.now)
            if self.k.thread_safe:
                ready = self.now + self.k.wake_after_s(self.now - last)
            else:  # the main thread steps it once its other work is done; it slept only if it had none
                last = max(last, rank.main_free)
                asleep = self.now - last if last < self.now else 0.0
                ready = max(self.now, rank.main_free) + (self.k.wake_after_s(asleep) if asleep else 0.0)
            if device > 0:  # the simulator's own device serves its part first, one call after another
                ready = queue_on(self.sim_device_free, r, ready, device)
            end = self._on_device(r, duration - device, ready) + handover
            self.last_step_end[worker] = end - handover
            if not self.k.thread_safe:
                rank.main_free = max(rank.main_free, end)
            self.at(end, self.stepped, req, version)

    def chunk_time(self, envs: List[_Env]) -> Tuple[float, float]:
        """Executing one action chunk: each action step waits for the active instances; finished ones reset.
        Its whole time, and of that the part on the simulator's shared device (`Costs.device_s_per_env`; the
        chunk's device parts are taken as one, ahead of the rest)."""
        per_env = self.k.device_s_per_env
        if len(envs) == 1 and self.k.step_rule != "batch":  # fast path: one instance, its own draws
            e = envs[0]
            steps = min(self.w.chunk, e.ep_len - e.t)
            ids = cast(np.ndarray, (e.prof,))  # group_step reads one instance's id as ids[0]: no numpy call
            total = sum(self.k.group_step(self.rng, ids) for _ in range(steps))
            return total + (self.k.reset_s if e.t + steps >= e.ep_len else 0.0), per_env * steps
        total, active, stepped = 0.0, list(envs), 0
        left = {e.gid: min(self.w.chunk, e.ep_len - e.t) for e in envs}
        for c in range(self.w.chunk):
            active = [e for e in active if left[e.gid] > c]
            if not active:
                break
            stepped += len(active)
            total += self.k.group_step(self.rng, np.fromiter((e.prof for e in active), int, len(active)))
        resets = sum(1 for e in envs if e.t + left[e.gid] >= e.ep_len)
        total += self.k.reset_s * (resets if self.k.step_rule == "sum" else min(1, resets))
        return total, min(total, per_env * stepped)

    def stepped(self, req: _Req, version: int) -> None:
        """A chunk finished; the rank's one main thread records it and sends the next request."""
        rank = self.ranks[req.rank]
        if self.k.cpu and not req.booked:
            self.cpu_s["simulator"] += self.k.cpu.request_s + self.k.cpu.record_s * len(req.envs)
        work = self.k.message_s - self.k.reply_s + self.k.record_s * len(req.envs)  # the request's own part
        if work > 0 and not req.booked:
            rank.main_free = self._main_start(rank) + work
            req.booked = True
            self.at(rank.main_free, self.stepped, req, version)
            return
        rank.running -= 1
        req.booked = False
        ended = [self.record(e, version) for e in req.envs]
        if self.lockstep:
            rank.remaining[req.group] -= 1
            if rank.remaining[req.group]:
                self.request(req.rank, req.envs, req.group, rank.phase)
            elif not any(rank.remaining.values()):
                for e in rank.envs:
                    self.cut(e)
                self.at(self.now + self.k.hop_s, self.phase_end, rank.phase)
        elif ended[0] and self.sched.whole_groups:  # it waits for its group; the group's last starts them all
            rank.waiting.add(req.envs[0].gid - req.rank * self.per)
            released = self.sched.released(rank.waiting)
            rank.waiting.difference_update(released)
            for i in released:
                self.request(req.rank, [rank.envs[i]], req.group, 0)
        else:
            self.request(req.rank, req.envs, req.group, 0)
        self.run_jobs(req.rank)

    def record(self, e: _Env, version: int) -> bool:
        """The segment bookkeeping of EnvTrack.record: one behaviour version per segment, capped length.
        Whether the episode ended."""
        if e.seg_rows and version != e.seg_v:
            self.cut(e)
        if not e.seg_rows:
            e.seg_v = version
        steps = min(self.w.chunk, e.ep_len - e.t)
        e.seg_rows += 1
        e.seg_steps += steps
        e.t += steps
        if e.t >= e.ep_len:
            self.cut(e, done=True)
            e.t, e.ep_len = 0, self._episode_len()
            e.episode, e.seg_index = e.episode + 1, 0
            return True
        if e.seg_rows >= MAX_SEGMENT_STEPS:
            self.cut(e)
        return False

    def cut(self, e: _Env, done: bool = False) -> None:
        if e.seg_rows:
            self.at(self.now + self.k.hop_s, self.segment, _Seg(e, e.seg_rows * self.w.chunk, done))
            e.seg_rows, e.seg_steps = 0, 0
            e.seg_index += 1

    # ------------------------------------------------------------------ generator
    def arrive(self, req: _Req) -> None:
        # The generator stamps a request when it drains its socket (`serve`), so one that comes
        # during a forward or a wake-up starts its max_wait clock only when that ends.
        req.arrival = -1.0
        self.gens[req.gen].queue.append(req)
        self._wake(req.gen)

    def _timer(self, index: int, due: float) -> None:
        """The oldest request's max_wait is over. The runtime recomputes its poll timeout from the queue
        every turn, so a timer whose batch has gone meanwhile never fires there."""
        g = self.gens[index]
        if g.wake_at == due:
            g.wake_at = -1.0
            self._wake(index)

    def _wake(self, index: int) -> None:
        """A request or its batch's timer finds the generator: if it sleeps in its poll (idle, or waiting
        for a batch to fill), it takes the queue (and whatever comes meanwhile) once awake."""
        g = self.gens[index]
        if g.busy:
            return
        wake = self.k.wake_after_s(self.now - g.idle_since)
        if wake > 0:
            g.busy = True
            self.at(self.now + wake, self._after_work, index)
            return
        self._free(index)  # awake at once: back to sleep (from now) unless it serves

    def room(self, g: _Gen) -> Optional[int]:
        """Items the generator may still serve under the hold budget (as the generator role's `hold_room`)."""
        base = self.sched.hold_base(g.bases, g.version, g.dropped, g.consumed)
        return self.sched.hold_room(g.served, base, g.waiting, len(self.gens), self.w.chunk)

    def serve(self, index: int) -> None:
        g = self.gens[index]
        if g.busy:
            return
        for q in g.queue:
            if q.arrival < 0:
                q.arrival = self.now  # received (a holding generator still takes in its requests)
        room = self.room(g)
        if room == 0:
            return
        servable = [q for q in g.queue if self.sched.servable(q.min_version, g.version)]
        if not servable:
            return
        sizes = [len(q.envs) for q in servable]
        clients = self.clients[index]
        senders = len({q.rank for q in servable}) if clients else 0
        if not self.sched.batch_ready(sizes, senders, clients, self.now - servable[0].arrival):
            due = servable[0].arrival + self.sched.max_wait_s
            if g.wake_at != due:
                g.wake_at = due
                self.at(due, self._timer, index, due)
            return
        count = self.sched.batch_size(sizes, room)
        batch, n = servable[:count], sum(sizes[:count])
        if len(servable) == len(g.queue):
            del g.queue[: len(batch)]
        else:
            for q in batch:
                g.queue.remove(q)
        g.busy, g.wake_at = True, -1.0  # a timer set for this batch is void
        duration = self.k.forward_s(n) + self.k.request_s * len(batch) + self.k.batch_s
        if self.k.cpu:
            self.cpu_s["generator"] += self.k.cpu.forward_s(n) + self.k.cpu.serve_s * len(batch) + self.k.cpu.wake_s
        g.busy_s += duration
        g.served += n * self.w.chunk
        self.at(self._on_device(index, duration), self.served, index, batch, g.version)

    def served(self, index: int, batch: List[_Req], version: int) -> None:
        for q in batch:
            self.at(self.now + self.k.hop_s, self.reply, q, version)
        self._after_work(index)

    def _after_work(self, index: int) -> None:
        """A forward (or a wake-up) is over: install announced weights first, else serve what waits."""
        g = self.gens[index]
        if g.incoming > g.version:
            g.busy_s += self.k.install_s
            self.at(self.now + self.k.install_s, self.installed, index, g.incoming)
            return
        self._free(index)

    def _free(self, index: int) -> None:
        g = self.gens[index]
        g.busy = False
        self.serve(index)
        if not g.busy:
            g.idle_since = self.now

    def weights(self, index: int, version: int, base: int) -> None:
        g = self.gens[index]
        g.incoming = max(g.incoming, version)
        g.bases[version] = base
        if not g.busy:
            g.busy = True
            g.busy_s += self.k.install_s
            self.at(self.now + self.k.install_s, self.installed, index, g.incoming)

    def installed(self, index: int, version: int) -> None:
        g = self.gens[index]
        g.version = max(g.version, version)
        self._after_work(index)  # newer weights may have been announced meanwhile

    # ------------------------------------------------------------------ trainer
    def segment(self, seg: _Seg) -> None:
        if self.k.cpu:
            self.cpu_s["trainer"] += self.k.cpu.segment_s
        self.buffer.append(seg)
        self.buffered += seg.steps
        self.received += seg.steps
        self.arrivals.arrived(self.now)
        self.update()
        if self.full_since is not None:  # waiting for groups in play: the wait's end, should nothing come before it
            self.at(self.now + self.arrivals.silence_s(), self.update)
        self._recredit()

    def phase_end(self, version: int) -> None:
        self.phase_ends[version] = self.phase_ends.get(version, 0) + 1
        self.update()

    def _ready(self) -> bool:
        """As the trainer role's `Collector.ready`: a full batch, and no group in play worth waiting for."""
        if not self.sched.update_ready(
            self.buffer, self.buffered, self.phase_ends.get(self.version, 0), len(self.ranks)
        ):
            self.full_since = None
            return False
        if self.full_since is None:
            self.full_since = self.now
            self.at(self.now + GROUP_WAIT_S, self.update)  # the wait's end, should no segment come before it
        held_s, silent_s = self.now - self.full_since, self.now - (self.arrivals.last or self.now)
        return not self.sched.awaits_groups(self.buffer, self.version, held_s, silent_s, self.arrivals.silence_s())

    def _waiting_slots(self) -> int:
        """Whole groups: the buffered slots no batch can use yet, credited to the hold budget while the
        trainer waits (as the trainer role's `Collector.waiting_slots`)."""
        if not self.sched.whole_groups or self._ready():
            return 0
        return sum(seg.slots for seg in self.sched.credited(self.buffer, full=self.full_since is not None))

    def _recredit(self) -> None:
        """Whole groups: a trainer waiting for the rest of its groups tells the generators when its credit changed."""
        if self.sched.whole_groups and not self.train_busy and self._waiting_slots() != self.credit:
            self._announce()

    def _announce(self) -> None:
        """The trainer's credit to every generator's hold budget (its `ctl` message)."""
        self.credit = self._waiting_slots()
        for i in range(len(self.gens)):
            self.at(self.now + self.k.hop_s, self._consumed, i, self.consumed_slots, self.credit, self.dropped_slots)

    def update(self) -> None:
        if self.train_busy or not self._ready():
            return
        used = 0
        take = self.sched.take(self.buffer, self.version)
        self.full_since = None
        for seg in take.consumed:
            self.buffered -= seg.steps
            self.consumed += seg.steps
            self.consumed_slots += seg.slots
            if self.sched.stale(self.version, seg.version):
                self.dropped_steps += seg.steps
                self.dropped_slots += seg.slots
            else:
                used += seg.steps
                self.lags.append(self.version - seg.version)
        self.buffer = deque(take.rest)
        self.phase_ends.pop(self.version, None)
        self._announce()
        if not used:
            return
        swap = self.k.swap_s if self.c.layout == "collocated" else 0.0
        duration = self.k.train_s(used, self.c.train) + swap
        if self.k.cpu:
            self.cpu_s["trainer"] += self.k.cpu.update_s(used / self.c.train) * self.c.train
        self.train_busy = True
        self.train_busy_s += duration + self.k.publish_s
        self.at(self.now + duration, self.trained)

    def _consumed(self, index: int, consumed: int, waiting: int = 0, dropped: int = 0) -> None:
        g = self.gens[index]
        g.consumed = max(g.consumed, consumed)
        g.dropped = max(g.dropped, dropped)
        g.waiting = waiting  # the latest: it may go down
        if not g.busy:
            self._free(index)

    def trained(self) -> None:
        self.reports.append((self.now, self.received, self.consumed, self.dropped_steps))
        self.version += 1
        self.at(self.now + self.k.publish_s, self.published)

    def published(self) -> None:
        self.train_busy = False
        for i in range(len(self.gens)):
            self.weights(i, self.version, self.consumed_slots - self.dropped_slots)
        if self.lockstep:
            for r, rank in enumerate(self.ranks):
                rank.phase = self.version
                self.at(self.now + self.k.hop_s, self.start, r)
        self.update()
        self._recredit()

    # ------------------------------------------------------------------ result
    def _prediction(self) -> Prediction:
        reps = self.reports
        first = reps[max(0, len(reps) // 4)] if len(reps) > 2 else (0.0, 0, 0, 0)
        last = reps[-1] if reps else (self.now, self.received, self.consumed, self.dropped_steps)
        span = last[0] - first[0]
        des_sps = (last[1] - first[1]) / span if span > 0 else 0.0
        # The dropped share of the same steady window: the warm-up drops nothing yet.
        consumed, dropped_steps = last[2] - first[2], last[3] - first[3]
        # CPU seconds per env step of each role, over the whole run; the shared cores bound the rate.
        demand = {r: c / self.env_steps for r, c in self.cpu_s.items()} if self.env_steps and self.k.cpu else {}
        bound = cpu_bound(demand, cpu_pools(self.c, self.w, self.k.host_cores))
        sps = min(des_sps, bound)
        stretch = des_sps / sps if sps > 0 else 1.0  # every busy time spreads over a longer wall when CPU binds
        wall = max(self.now, 1e-9) * stretch
        dropped = dropped_steps / consumed if consumed > 0 else 0.0
        lags = np.asarray(self.lags or [0])
        util = {
            "simulator": self.env_busy_s / (self.w.num_envs * wall),
            "generator": sum(g.busy_s for g in self.gens) / (len(self.gens) * wall),
            "trainer": self.train_busy_s / wall,
        }
        return Prediction(
            sps,
            sps * (1 - dropped),
            {k: min(1.0, v) for k, v in util.items()},
            {
                "mean": float(lags.mean()),
                "p50": float(np.percentile(lags, 50)),
                "p99": float(np.percentile(lags, 99)),
                "max": float(lags.max()),
            },
            dropped,
            len(reps),
            wall,
            {r: d * sps for r, d in demand.items()},
            bound,
            self._spread(reps[max(0, len(reps) // 4) :]),
        )

    @staticmethod
    def _spread(reps: List[tuple], most: int = 8) -> float:
        """Relative standard error of the throughput: batch means over equal time windows of the steady
        state (the received-steps curve interpolated between reports, so bursts of updates even out); as
        many windows as report intervals, up to `most` (fewer would make the error itself too noisy)."""
        windows = min(most, len(reps) - 1)
        if windows < 3:
            return 0.0
        times, steps = np.asarray(reps, float)[:, :2].T
        edges = np.linspace(times[0], times[-1], windows + 1)
        rates = np.diff(np.interp(edges, times, steps)) / np.diff(edges)
        if not rates.mean() > 0:
            return 0.0
        return float(rates.std(ddof=1) / rates.mean() / math.sqrt(windows))


def simulate(cand: Candidate, work: Workload, costs: Costs, updates: int = 16, seed: int = 0) -> Prediction:
    """Predict one candidate: run the pipeline for `updates` trainer updates."""
    return Pipeline(cand, work, costs, seed).run(updates)
