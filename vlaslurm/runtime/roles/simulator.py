"""The simulator role: steps its share of `env.num_envs` and ships segments to the trainer.

Two small loops over the same pieces: `lockstep_loop` (sync, and pipelined with k sub-groups)
and `async_loop` (every environment requests and steps on its own). Both step through a
`Stepper`, whose threads run the chunks while the main thread keeps the sockets. In sync mode a
phase's trajectories depend only on its version's weights, so resumed and restarted runs repeat it.
Details: docs/runtime.md
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union, cast

import numpy as np
import zmq

from vlaslurm.envs import make_env, preflight
from vlaslurm.envs.base import VecEnv, listed_seed
from vlaslurm.log import get_logger
from vlaslurm.models import env_action_transform
from vlaslurm.rundir import Counters, EventLog, Heartbeat, beat_age_s
from vlaslurm.runtime import checkpoint as ckpt
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime import signals
from vlaslurm.runtime.context import RankContext, meet, world_roles
from vlaslurm.runtime.episodes import ChunkResult, EnvObs, EnvTrack, mix_seed, run_chunk, split_obs, stack_obs
from vlaslurm.runtime.schedule import Schedule
from vlaslurm.runtime.transport import Dealer, Poller, Push, SendTimeout, Sub, rejection_counts, routing_id
from vlaslurm.spec.env_types import EnvConfig
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.schema import ExperimentSpec, RolloutConfig

log = get_logger("vlaslurm.simulator")
MAX_SEGMENT_STEPS = msgs.MAX_SEGMENT_STEPS
CHECK_EVERY_S = 0.5  # how often `Stepper.check` looks for a step past the running deadline


@dataclass
class SimulatorConfig:
    """What a simulator rank needs from the spec."""

    env: EnvConfig
    rollout: RolloutConfig
    action_chunk: int
    steps_per_update: int
    group_size: int = 1  # GRPO: environments env_id // group_size reset from one seed (the same task and state)
    # The policy's checkpoint and post-processing, for the map from its actions to the environment's
    # (`env_action_transform`); None: the policy's actions are the environment's.
    model: Optional[ModelConfig] = None

    @classmethod
    def from_spec(cls, spec: ExperimentSpec) -> SimulatorConfig:
        return cls(
            spec.env,
            spec.rollout,
            spec.model.action_chunk,
            spec.algo.steps_per_update,
            spec.algo.episodes_per_group,
            spec.model,
        )

    @property
    def schedule(self) -> Schedule:
        return Schedule.of(self.rollout, self.steps_per_update, self.group_size)

    @property
    def max_frame_bytes(self) -> int:
        """Larger frames are refused unread by this rank's sockets."""
        return msgs.max_frame_bytes(self.env, self.action_chunk)

    @property
    def steps_per_decision(self) -> int:
        """Env steps of one chunk at most (`model.execute_actions` of `action_chunk`)."""
        return self.model.steps_per_decision if self.model is not None else self.action_chunk


class SimulatorIO:
    """The simulator's sockets: one Dealer per generator, a Push to the trainer, a Sub to its announcements."""

    def __init__(self, ctx: RankContext, schedule: Schedule, max_frame_bytes: int = msgs.FRAME_FLOOR_BYTES) -> None:
        self.ctx, self.schedule, self.max_frame_bytes = ctx, schedule, max_frame_bytes
        gens = ctx.info.ranks["generator"]
        self.dealers = [self._dealer(g, ctx.member("generator", g)) for g in range(gens)]
        self.gen_pids = [ctx.member("generator", g).pid for g in range(gens)]
        self.inflight: Dict[int, tuple] = {}  # first env id of a request -> (generator, request)
        self.reconnects = 0
        self.duplicates = 0  # replies to requests already answered (dropped)
        self.retired: List[Dealer] = []  # closed Dealers to restarted generators: their rejections still count
        self._next_look = 0.0
        trainer = ctx.member("trainer", 0)
        self.push = Push(ctx.secret, channel=msgs.channel(ctx.job_key, "segments"), name="segments->trainer[0]")
        self.push.connect(trainer.endpoint("segments"))
        self.sub = Sub(
            ctx.secret,
            channel=msgs.channel(ctx.job_key, msgs.CTL),
            name="ctl<-trainer[0]",
            accepts=msgs.ANNOUNCEMENTS,
            max_frame_bytes=max_frame_bytes,
        )
        self.sub.connect(trainer.endpoint("ctl"))
        self.poller: Poller[Union[Sub, Dealer]] = Poller(self.sub, *self.dealers)
        self.outstanding = [0] * gens
        self.waiting_since = [0.0] * gens  # since when each generator owes us a reply (monotonic)
        self.answered = [False] * gens  # has it ever replied (first deadline until it has)
        self.version = -1
        self.stop = False
        self.shipped_segments = 0
        self.shipped_steps = 0
        self.requests_sent = 0
        self.request_messages = 0  # fewer than requests where several went in one message
        self.held: List[int] = []  # env ids whose requests a generator holds (async `hold`)

    def _dealer(self, g: int, member) -> Dealer:
        dealer = Dealer(
            self.ctx.secret,
            identity=routing_id(f"simulator-{self.ctx.rank}"),  # unpredictable: nobody can take our replies
            **msgs.generator_channels(self.ctx.job_key, g, member.pid),  # this generator process only
            name=f"obs->generator[{g}]",
            accepts=msgs.REPLIES,
            max_frame_bytes=self.max_frame_bytes,
        )
        dealer.connect(member.endpoint("obs"))
        return dealer

    def send(self, reqs: List[msgs.ObsRequest]) -> None:
        """Send requests, each to the generator the schedule routes it to: one message per generator for all
        of its requests (async environments whose steps ended together share one send and one wake-up)."""
        now = self.ctx.now()
        by_gen: Dict[int, List[msgs.ObsRequest]] = {}
        for req in reqs:
            gen = self.schedule.route(req.sim_rank, self.outstanding)
            req.sent_at = now
            by_gen.setdefault(gen, []).append(req)
            self.inflight[req.env_ids[0]] = (gen, req)
            if self.outstanding[gen] == 0:
                self.waiting_since[gen] = time.monotonic()
            self.outstanding[gen] += 1
        for gen, mine in by_gen.items():
            self.dealers[gen].send(msgs.encode_requests(mine))
        self.requests_sent += len(reqs)
        self.request_messages += len(by_gen)

    def look_for_restarted_generators(self) -> None:
        """A generator that owes replies for a while may have died and been restarted by its step (new pid,
        new port in its rendezvous file): connect to the new one and send it what the old one never answered."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + 0.5
        for g, n in enumerate(self.outstanding):
            if n == 0 or now - self.waiting_since[g] < 1.0:
                continue
            member = self.ctx.rendezvous.read("generator", g)
            if member is None or member.pid == self.gen_pids[g]:
                continue
            log.warning(
                "generator[%d] was restarted (pid %d -> %d); reconnecting and resending %d requests",
                g,
                self.gen_pids[g],
                member.pid,
                n,
            )
            self.poller.unregister(self.dealers[g])
            self.dealers[g].close()
            self.retired.append(self.dealers[g])
            self.dealers[g] = self._dealer(g, member)
            self.poller.register(self.dealers[g])
            self.gen_pids[g] = member.pid
            self.ctx.members[("generator", g)] = member
            self.reconnects += 1
            unanswered = [req for gen, req in self.inflight.values() if gen == g]
            if unanswered:
                self.dealers[g].send(msgs.encode_requests(unanswered))
            self.waiting_since[g] = now
            self.answered[g] = False  # the new process gets the first-meeting deadline (imports, weights)

    def check_deadlines(self) -> None:
        """Raise, naming it, if a generator owes replies and has sent none for too long."""
        self.look_for_restarted_generators()
        now = time.monotonic()
        for g, n in enumerate(self.outstanding):
            limit = self.ctx.deadlines.running_s if self.answered[g] else self.ctx.deadlines.first_s
            if n > 0 and now - self.waiting_since[g] > limit:
                raise TimeoutError(
                    f"simulator[{self.ctx.rank}]: generator[{g}] sent no actions for {limit:g} s "
                    f"({n} requests outstanding; host {self.ctx.member('generator', g).host})"
                )

    def poll(self, timeout_ms: int) -> List[msgs.ActReply]:
        """Replies that arrived within `timeout_ms`; also takes in the trainer's announcements."""
        replies = []
        for sock in self.poller.poll(timeout_ms):
            while (msg := sock.recv(0)) is not None:  # each socket takes only its kinds, checked (msgs.REPLIES)
                if msg.kind == msgs.CTL:
                    self._announced(msg)
                elif msg.kind == msgs.ACT:
                    now = self.ctx.now()
                    for reply in msgs.decode_acts(msg):
                        reply.received_at = now
                        if self._first_answer(reply):
                            replies.append(reply)
                elif msg.kind == msgs.HELD:
                    env_ids, gen_rank = msgs.decode_held(msg)
                    self.held += env_ids
                    if 0 <= gen_rank < len(self.waiting_since):
                        self.waiting_since[gen_rank] = time.monotonic()  # held, not gone
        return replies

    def _first_answer(self, reply: msgs.ActReply) -> bool:
        """Take `reply` off the requests in flight; False if it was answered already (a request resent to a
        restarted generator): stepping its instances twice, from two threads, would corrupt their episodes."""
        if self.inflight.pop(reply.env_ids[0], None) is None:
            log.warning(
                "simulator[%d]: dropped a second reply for envs %s from generator[%d]",
                self.ctx.rank,
                list(reply.env_ids),
                reply.gen_rank,
            )
            self.duplicates += 1
            return False
        self.outstanding[reply.gen_rank] -= 1
        self.answered[reply.gen_rank] = True
        self.waiting_since[reply.gen_rank] = time.monotonic()
        return True

    def _announced(self, msg) -> None:
        ctl = msgs.decode_ctl(msg)
        self.version = max(self.version, ctl.version)
        self.stop = self.stop or ctl.stop

    def counters(self) -> Dict[str, float]:
        """What the sockets sent and dropped (`transport.rejection_counts`), for the rank's counters (a gauge)."""
        sent: Dict[str, float] = {
            "shipped_segments": self.shipped_segments,
            "shipped_steps": self.shipped_steps,
            "generator_reconnects": self.reconnects,
            "duplicate_replies": self.duplicates,
            "requests_sent": self.requests_sent,
            "request_messages": self.request_messages,
        }
        return {**sent, **rejection_counts(self.sub, *self.dealers, *self.retired)}

    def ship(self, segments: List[msgs.Segment]) -> None:
        """Send segments to the trainer (back-pressure blocks here) and count them."""
        for seg in segments:
            self.send_to_trainer(msgs.encode_segment(seg))
            self.shipped_segments += 1
            self.shipped_steps += seg.steps

    def send_to_trainer(self, message) -> None:
        """The trainer keeps reading after it announces a stop, until every simulator said it is done."""
        deadline = time.monotonic() + self.ctx.deadlines.running_s
        while True:
            try:
                self.push.send(message, timeout_ms=200)
                return
            except SendTimeout:
                self._take_ctl()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"simulator[{self.ctx.rank}]: trainer[0] took no segment for {self.ctx.deadlines.running_s:g} s"
                    ) from None

    def finish(self, leftovers: List[msgs.Segment]) -> None:
        """After a stop: ship the open segments, then say how much was shipped in all."""
        self.ship(leftovers)
        self.send_to_trainer(msgs.sim_done(self.ctx.rank, self.shipped_segments, self.shipped_steps))

    def _take_ctl(self) -> None:
        while (msg := self.sub.recv(0)) is not None:
            if msg.kind == msgs.CTL:
                self._announced(msg)

    def close(self) -> None:
        for sock in (*self.dealers, self.push, self.sub):
            sock.close()


class Simulator:
    """One simulator rank's environments and records."""

    def __init__(
        self,
        cfg: SimulatorConfig,
        ctx: RankContext,
        env: VecEnv,
        first_gid: int,
        incarnation: int = 0,
        episode_base: int = 0,
    ) -> None:
        self.cfg, self.ctx, self.env = cfg, ctx, env
        # Built once (it reads the checkpoint's statistics); replies and segments stay in the policy's space.
        self.to_env = None if cfg.model is None else env_action_transform(cfg.model)
        self.seed = cfg.rollout.seed
        self.incarnation = incarnation
        self.stuck: List[int] = []  # instances left in a step that never returned (`Stepper`)
        self.tracks = [
            EnvTrack(first_gid + i, i, env.tasks[i], MAX_SEGMENT_STEPS, ctx.now, ctx.rank, incarnation)
            for i in range(env.num_envs)
        ]
        for track in self.tracks:
            track.episode = episode_base - 1  # the first reset starts episode `episode_base`
        self.events = EventLog(ctx.run_dir, "simulator", ctx.rank)
        self.counters = Counters(ctx.run_dir, "simulator", ctx.rank)
        self.heartbeat = Heartbeat(ctx.run_dir, "simulator", ctx.rank)
        self.env_steps = 0
        self.group = cfg.group_size
        if env.num_envs % self.group:
            raise ValueError(
                f"algo.group_size ({self.group}) must divide the {env.num_envs} environments of each "
                "simulator rank (env.num_envs / simulator ranks)"
            )
        self.schedule = cfg.schedule
        self.reset_seeds = cfg.env.reset_seed_list()  # env.reset_seeds: fixed seeds instead of drawn ones
        self.groups = max(cfg.env.num_envs // self.group, 1)  # over all simulator ranks
        # Async GRPO (`whole_groups`): a finished member waits until its whole group has finished, then they
        # start together, so a group's episodes run side by side (same versions, complete at about one time).
        self.waiting: set = set()
        self.released: List[int] = []

    def reset(self, locals_: List[int]) -> List[int]:
        """Start the next episode of each listed instance, seeded by run seed, group (env id // group size)
        and episode: members of a GRPO group start from the same state with the same instruction.
        Returns the instances that started (with the async GRPO barrier, whole groups only)."""
        if self.schedule.whole_groups:
            self.waiting.update(locals_)
            locals_ = self.schedule.released(self.waiting)
            self.waiting.difference_update(locals_)
            if not locals_:
                return []
        tracks = [self.tracks[i] for i in locals_]
        seeds = [
            self.reset_seed(t.gid // self.group, t.episode + 1, mix_seed(self.seed, t.gid // self.group, t.episode + 1))
            for t in tracks
        ]
        # A phase that starts from reset is cut at its end: of the episodes begun inside it only the short ones end.
        scored = not self.schedule.resets_each_phase
        for track, obs in zip(tracks, split_obs(self.env.reset(locals_, seeds))):
            track.start_episode(obs, scored)
        return locals_

    def reset_seed(self, group: int, episode: int, drawn: int) -> int:
        """The reset seed of `group`'s `episode`: from `env.reset_seeds` if listed, else `drawn`."""
        return listed_seed(self.reset_seeds, group, episode, self.groups) if self.reset_seeds else drawn

    def start_phase(self, version: int, episodes_per_phase: int) -> None:
        """Sync: every instance starts the phase from reset, seeded from (seed, version, env id), in an
        episode numbered from the version (unique in the run, the same in every run of this seed)."""
        for track in self.tracks:
            track.episode = version * episodes_per_phase - 1
        first = version * episodes_per_phase
        seeds = [
            self.reset_seed(t.gid // self.group, first, mix_seed(self.seed, version, t.gid // self.group))
            for t in self.tracks
        ]
        for track, obs in zip(self.tracks, split_obs(self.env.reset(list(range(len(self.tracks))), seeds))):
            track.start_episode(obs)

    def request(self, locals_: List[int], sub_group: int, min_version: int) -> msgs.ObsRequest:
        tracks = [self.tracks[i] for i in locals_]
        return msgs.ObsRequest(
            env_ids=[t.gid for t in tracks],
            episodes=[t.episode for t in tracks],
            steps=[t.step for t in tracks],
            seeds=[mix_seed(self.seed, t.gid, t.episode, t.step, 1) for t in tracks],
            obs=stack_obs([cast(EnvObs, t.obs) for t in tracks]),
            sub_group=sub_group,
            min_version=min_version,
            sim_rank=self.ctx.rank,
        )

    def apply(self, locals_: List[int], reply: msgs.ActReply, result: ChunkResult) -> List[msgs.Segment]:
        """Record a chunk's outcome per instance; reset finished ones; return completed segments."""
        done, finished = [], []
        index = {gid: row for row, gid in enumerate(reply.env_ids)}
        for row_res, i in enumerate(locals_):
            track = self.tracks[i]
            row = index[track.gid]
            done += track.record(
                reply.version,
                reply.actions[row],
                reply.logprob[row],
                float(reply.value[row]),
                result.rewards[row_res],
                result.mask[row_res],
                result.last_obs[row_res],
                bool(result.terminated[row_res]),
                bool(result.truncated[row_res]),
                bool(result.success[row_res]),
                None if reply.token_logprob is None else reply.token_logprob[row],
                None if reply.replay is None else {k: v[row] for k, v in reply.replay.items()},
            )
            if result.terminated[row_res] or result.truncated[row_res]:
                finished.append(i)
        if finished:
            self.released = self.reset(finished)  # partial reset: only the instances that finished
        steps = int(result.mask.sum())
        self.env_steps += steps
        self.counters.add("env_steps", steps)
        return done

    def next_requests(self, local: int) -> List[int]:
        """Instances to ask actions for after `local` stepped: itself, unless it waits for its group; and the
        group members its finish released."""
        if not self.schedule.whole_groups:
            return [local]
        released, self.released = self.released, []
        return released or ([] if local in self.waiting else [local])

    def cut_held(self, gids: List[int]) -> List[msgs.Segment]:
        """The open segments of environments whose requests are held."""
        tracks = [self.tracks[gid - self.tracks[0].gid] for gid in set(gids)]
        return [t.cut() for t in tracks if t.has_steps()]

    def cut_all(self) -> List[msgs.Segment]:
        return [t.cut() for t in self.tracks if t.has_steps()]

    def tick(self, version: int) -> None:
        self.counters.maybe_write()
        self.heartbeat.beat(version, f"env_steps={self.env_steps}")

    def close(self, close_env: bool = True) -> None:
        self.events.flush()
        self.counters.maybe_write(force=True)
        self.heartbeat.beat(None, f"finished env_steps={self.env_steps}", force=True)
        if close_env:
            self.env.close()


def wait_version(sim: Simulator, io: SimulatorIO, version: int) -> None:
    """Block until the trainer announces `version` (or a stop); name the trainer if it stays silent. The deadline
    runs from the trainer's last heartbeat, not from the start of the wait: an update that takes longer than
    runtime.timeout_s (a 7B model's) beats while it runs, a dead trainer does not."""
    limit = sim.ctx.deadlines.first_s if version == 0 else sim.ctx.deadlines.running_s
    deadline = time.monotonic() + limit
    while io.version < version and not io.stop:
        if time.monotonic() > deadline:
            age = beat_age_s(sim.ctx.run_dir, "trainer", 0)
            if age is None or age > limit:
                raise TimeoutError(
                    f"simulator[{sim.ctx.rank}]: trainer[0] announced no version {version} within "
                    f"{limit:g} s (last seen: {io.version}; its last heartbeat "
                    f"{'missing' if age is None else f'{age:.0f} s ago'})"
                )
            deadline = time.monotonic() + limit - age
        io.poll(100)
        sim.tick(io.version)


class StuckStep(TimeoutError):
    """A chunk has been in env.step for longer than the running deadline."""

    def __init__(self, sim: Simulator, instances: List[int], age_s: float, limit_s: float) -> None:
        gids = [sim.tracks[i].gid for i in instances]
        super().__init__(
            f"simulator[{sim.ctx.rank}]: environment(s) {gids} (local {instances}) have been in "
            f"env.step for {age_s:.0f} s (runtime.timeout_s={limit_s:g}): the simulator hangs there"
        )
        self.instances = instances


class Stepper:
    """Executes action chunks off the main thread, so that the main loop keeps sending requests and taking
    replies while instances step: a sub-group steps while the generator serves another (pipelined), and
    every instance steps on its own (async). A chunk that ends wakes the main loop's poll.

    With `workers` > 0 (the env is `thread_safe`: disjoint sets may step at once, and reset while others
    step) that many threads step chunks side by side; with 0 a chunk runs on the caller's thread. At the
    end, chunks under way stop after their current step: a stop need not wait for a whole chunk of slow steps,
    and waits at most the running deadline for a step that never returns (`stuck`)."""

    def __init__(
        self,
        sim: Simulator,
        io: SimulatorIO,
        workers: int,
        to_env: Optional[Callable[[np.ndarray], np.ndarray]] = None,
        executed: Optional[int] = None,
    ) -> None:
        self.sim, self.io = sim, io
        self.to_env = to_env  # policy -> environment actions (`env_action_transform`); replies keep the policy's
        self.executed = executed  # the first actions of each chunk that run (`model.execute_actions`)
        self.done: queue.Queue[tuple] = queue.Queue()
        self.wake = _Waker()
        # A bare wake-up socket: it has the `.socket` and `.recv` the Poller uses, not a _Socket's type.
        io.poller.register(self.wake.pull)  # type: ignore[arg-type]
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env") if workers else None
        # Chunks under way, by number: (future, instances, [its step start]); `finished` removes each (the main
        # loop used to scan every future's done() on each submit: ~16 per submit in async, 155k in 9600 steps).
        self.running: Dict[int, Tuple[Future, List[int], List[float]]] = {}
        self._numbers = itertools.count()
        self._next_check = 0.0
        self.cancel = threading.Event()
        self.open = True

    def submit(self, g: int, locals_: List[int], reply: msgs.ActReply) -> None:
        """Step instances `locals_` (sub-group or instance `g`) through the reply's action chunk."""
        if self.pool is None:
            self._step(g, locals_, reply)
        else:
            number = next(self._numbers)
            started = [time.monotonic()]  # when the chunk's current step started, kept by its thread
            # `finished` takes its end on this thread, so never before this entry exists
            self.running[number] = (self.pool.submit(self._step, g, locals_, reply, started, number), locals_, started)

    def check(self) -> None:
        """Raise StuckStep if a step has lasted longer than the running deadline: a simulator that hangs in
        env.step would otherwise hold its rank, and every phase, without a word (its main loop still beats)."""
        limit = self.sim.ctx.deadlines.running_s
        now = time.monotonic()
        if now < self._next_check:  # deadlines are seconds long: a look every CHECK_EVERY_S is soon enough
            return
        self._next_check = now + CHECK_EVERY_S
        late = [(ids, now - t[0]) for f, ids, t in self.running.values() if not f.done() and now - t[0] > limit]
        if late:
            self.sim.stuck = sorted(i for ids, _ in late for i in ids)
            raise StuckStep(self.sim, self.sim.stuck, max(age for _, age in late), limit)

    def _step(
        self,
        g: int,
        locals_: List[int],
        reply: msgs.ActReply,
        started: Optional[List[float]] = None,
        number: Optional[int] = None,
    ) -> None:
        t0 = self.sim.ctx.now()
        mark = (lambda: started.__setitem__(0, time.monotonic())) if started is not None else None
        result: Union[ChunkResult, BaseException]
        try:
            result = run_chunk(
                self.sim.env,
                np.asarray(locals_),
                reply.actions,
                self.cancel,
                mark,
                self.to_env,
                self.executed,
            )
        except BaseException as exc:  # noqa: BLE001 - raised in the main loop by `finished`
            result = exc
        self.done.put((g, locals_, reply, result, t0, self.sim.ctx.now(), number))
        if self.pool is not None:
            self.wake.wake()

    def finished(self) -> List[Tuple[int, msgs.ActReply, ChunkResult]]:
        """The chunks that ended since the last call, as (g, reply, result), in the event log and the
        counters; a chunk that raised raises here."""
        if self.open:
            self.wake.drain()
        out = []
        while not self.done.empty():
            g, locals_, reply, result, t0, t1, number = self.done.get_nowait()
            self.running.pop(number, None)
            if isinstance(result, BaseException):
                raise result
            self.sim.counters.busy(t1 - t0)
            self.sim.events.add(
                "step",
                t0=t0,
                t1=t1,
                g=g,
                v=reply.version,
                n=len(locals_),
                steps=int(result.mask.sum()),
                rx=reply.received_at,
            )
            out.append((g, reply, result))
        return out

    def close(self) -> None:
        """End the chunks under way after their current step (what they did stays for `finished`); drop
        those not started. A step still running after half the running deadline is left behind (`sim.stuck`):
        the trainer's drain waits the whole deadline from its stop for this rank's last segments."""
        self.sim.events.add("stop", t=self.sim.ctx.now())
        self.cancel.set()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            wait_s = 0.0 if self.sim.stuck else self.sim.ctx.deadlines.running_s / 2  # known stuck: said already
            # Chunks the shutdown cancelled before they started are over, though `wait` does not count them done.
            instances = {f: ids for f, ids, _ in self.running.values() if not f.cancelled()}
            _, late = wait(list(instances), timeout=wait_s)
            stuck = sorted(i for f in late for i in instances[f])
            if stuck and not self.sim.stuck:
                log.error(
                    "%d instance(s) (local %s) still in env.step %.0f s after the stop (half of "
                    "runtime.timeout_s): the simulator hangs there; this rank ends without them",
                    len(stuck),
                    stuck,
                    wait_s,
                )
            self.sim.stuck = self.sim.stuck or stuck
        self.io.poller.unregister(self.wake.pull)  # type: ignore[arg-type]
        self.wake.close()
        self.open = False


def lockstep_loop(sim: Simulator, io: SimulatorIO, cfg: SimulatorConfig) -> None:
    """Sync (depth 1) and pipelined (depth k): phases of one version; each sub-group asks for its next
    actions as soon as its chunk ends, and steps as soon as they arrive, while the others are served or step."""
    schedule = sim.schedule
    groups = schedule.sub_groups(sim.env.num_envs)
    per_phase = schedule.phase_chunks(cfg.env.num_envs, cfg.steps_per_decision, cfg.env.episode_limit())
    threads = schedule.step_threads(sim.env.num_envs, sim.env.thread_safe)
    stepper = Stepper(sim, io, threads, sim.to_env, cfg.steps_per_decision)
    try:
        wait_version(sim, io, 0)
        version = max(io.version, 0)  # a resumed trainer starts at its checkpoint's version
        while True:
            wait_version(sim, io, version)
            if io.stop:
                break
            if schedule.resets_each_phase:
                sim.start_phase(version, per_phase + 1)  # a phase holds at most per_phase + 1 episodes
            if not run_phase(sim, io, stepper, groups, version, per_phase):
                break
            segments = sim.cut_all()
            io.ship(segments)
            io.send_to_trainer(msgs.phase_end(version, sim.ctx.rank, sim.env_steps, len(segments), sim.incarnation))
            version += 1
    finally:
        stepper.close()
    for g, reply, result in stepper.finished():  # chunks that ended after the stop still count
        io.ship(sim.apply(groups[g], reply, result))


def run_phase(
    sim: Simulator, io: SimulatorIO, stepper: Stepper, groups: List[List[int]], version: int, per_phase: int
) -> bool:
    """`per_phase` chunks of every sub-group with weights `version`; False if the trainer said stop."""
    remaining = [per_phase] * len(groups)
    # One message per sub-group: sent together, the generator would serve them in one batch from then on, and
    # the sub-groups would step in step (pipelining needs them apart).
    for g, locals_ in enumerate(groups):
        io.send([sim.request(locals_, g, version)])
    while any(remaining):
        for reply in io.poll(100):
            stepper.submit(reply.sub_group, groups[reply.sub_group], reply)
        for g, reply, result in stepper.finished():
            segments = sim.apply(groups[g], reply, result)
            remaining[g] -= 1
            if remaining[g]:
                io.send([sim.request(groups[g], g, version)])  # before shipping: the generator need not wait
            io.ship(segments)
        if io.stop:
            return False
        io.check_deadlines()
        stepper.check()
        sim.tick(version)
    return True


def async_loop(sim: Simulator, io: SimulatorIO) -> None:
    """Every environment on its own: request when ready, step when its actions arrive."""
    threads = sim.schedule.step_threads(sim.env.num_envs, sim.env.thread_safe)
    stepper = Stepper(sim, io, threads, sim.to_env, sim.cfg.steps_per_decision)
    io.send([sim.request([i], i, 0) for i in range(sim.env.num_envs)])
    first = sim.tracks[0]
    try:
        while not io.stop:
            for reply in io.poll(100):  # env threads wake the poll the moment a chunk ends
                local = first.local + reply.env_ids[0] - first.gid
                stepper.submit(local, [local], reply)
            requests, segments = [], []
            for local, reply, result in stepper.finished():
                segments += sim.apply([local], reply, result)
                requests += [sim.request([i], i, 0) for i in sim.next_requests(local)]
            if requests:
                io.send(requests)  # one message per generator, before shipping: the generator need not wait
            io.ship(segments)
            io.ship(sim.cut_held(io.held))
            io.held.clear()
            io.check_deadlines()
            stepper.check()
            sim.tick(io.version)
    finally:
        stepper.close()
    for local, reply, result in stepper.finished():  # chunks that ended after the stop still count
        io.ship(sim.apply([local], reply, result))


class _Waker:
    """Wakes the main loop's poller from worker threads (ZeroMQ sockets stay in their own threads)."""

    def __init__(self) -> None:
        ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self.address = f"inproc://wake-{id(self)}"
        self.pull = _Raw(ctx.socket(zmq.PULL))
        self.pull.socket.bind(self.address)
        self._local = threading.local()
        self._sockets: list = []
        self._lock = threading.Lock()

    def wake(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.connect(self.address)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        sock.send(b"", zmq.NOBLOCK)

    def drain(self) -> None:
        while True:
            try:
                self.pull.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close(0)
        self.pull.socket.close(0)


class _Raw:
    """A bare inproc socket the Poller can hold; its messages are wake-ups, not Messages."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket

    def recv(self, timeout_ms: int) -> None:
        return None


def env_dims(env: VecEnv, cfg: EnvConfig) -> Dict[str, int]:
    """What generators and trainer need to build the policy, published through the rendezvous."""
    return {
        "action_dim": env.action_dim,
        "state_dim": env.state_dim,
        "image_size": cfg.obs.image_size,
        "num_cameras": len(cfg.obs.cameras) if cfg.obs.image_size else 0,
    }


def run(ctx: RankContext, cfg: SimulatorConfig) -> int:
    """Entry point of a simulator rank."""
    ranks = ctx.info.ranks["simulator"]
    local_count = cfg.env.num_envs // ranks
    signals.install(drain_on_term=False)
    incarnation = signals.incarnation()
    if report := preflight.check_once_per_node(cfg.env, ctx.rank):
        log.info("%s", report.text())
    env = make_env(cfg.env, num_envs=local_count, rank=ctx.rank, seed=cfg.rollout.seed, group_size=cfg.group_size)
    meet(ctx, ports={}, extra=env_dims(env, cfg.env), roles=world_roles(cfg.rollout.weight_sync))
    io = SimulatorIO(ctx, cfg.schedule, cfg.max_frame_bytes)
    if incarnation:
        io.send_to_trainer(msgs.sim_restart(ctx.rank, incarnation))
    # A restarted or resumed simulator numbers its episodes past any of its predecessors (run clock in ms).
    fresh = incarnation == 0 and ckpt.latest(ctx.run_dir) is None
    sim = Simulator(
        cfg,
        ctx,
        env,
        first_gid=ctx.rank * local_count,
        incarnation=incarnation,
        episode_base=0 if fresh else int(ctx.now() * 1000),
    )
    sim.counters.gauge(io.counters)
    if not sim.schedule.resets_each_phase:  # else every phase starts from reset
        sim.reset(list(range(local_count)))
    log.info("%d environments of %s, mode %s", local_count, cfg.env.type, cfg.rollout.mode)
    code = 0
    try:
        if sim.schedule.lockstep:
            lockstep_loop(sim, io, cfg)
        else:
            async_loop(sim, io)
        io.finish(sim.cut_all())
    except Exception as exc:  # noqa: BLE001 - with a thread stuck in a step, the usual way out would hang
        if not sim.stuck:
            raise
        code = 1  # restarted under resources.simulator.max_restarts
        log.error("%s", exc if isinstance(exc, StuckStep) else traceback.format_exc())
    finally:
        sim.close(close_env=not sim.stuck)  # closing an env that a thread is stuck in can hang as well
        io.close()
    if code == 0:
        log.info("finished after %d env steps", sim.env_steps)
    if sim.stuck:
        exit_leaving_threads(code)
    if ctx.world is not None:
        ctx.world.close()
    return 0


def exit_leaving_threads(code: int) -> None:
    """End this process now: Python's own exit would wait for the env threads stuck in a step, forever.
    Events and counters were flushed by `Simulator.close`; what the sockets still hold (the last segments,
    `done`) gets their linger to leave, and the log handlers a flush."""
    zmq.Context.instance().destroy(linger=200)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
