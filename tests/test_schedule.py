"""The schedule: its decisions per mode, by hand, and the same decisions through the runtime's and the
simulation's paths (one hand-built event trace fed to the generator's `Batcher` and the trainer's
`Collector`, and to the placement simulation's generator and trainer)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_role_cores import collector, deliver, segment

from vlaslurm.envs.base import Observation
from vlaslurm.placement.costs import Costs, Curve, Memory
from vlaslurm.placement.simulate import Candidate, Pipeline, Workload, _Env, _Req, _Seg
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime.roles.generator import Batcher, Pending
from vlaslurm.runtime.roles.trainer import Collector
from vlaslurm.runtime.schedule import (
    GROUP_WAIT_S,
    SILENCE_FLOOR_S,
    SILENCE_GAPS,
    ArrivalGaps,
    Async,
    Pipelined,
    Schedule,
    Sync,
    complete_groups,
)
from vlaslurm.spec.algo_types import GRPOConfig, PPOConfig
from vlaslurm.spec.schema import BatchingConfig, RolloutConfig


class Seg:
    """A segment as the schedule reads it."""

    def __init__(self, env_id: int, episode: int, index: int, steps: int, version: int, done: bool = False):
        self.env_id, self.episode, self.index, self.steps, self.version = env_id, episode, index, steps, version
        self.episode_done = done

    def key(self) -> tuple:
        return self.env_id, self.episode, self.index


def rollout(
    mode: str, depth: int = 1, staleness: int = 0, policy: str = "drop", max_batch: int = 8, wait_ms: float = 5.0
) -> RolloutConfig:
    return RolloutConfig(
        mode=mode,
        pipeline_depth=depth,
        max_staleness=staleness,
        stale_policy=policy,
        batching=BatchingConfig(max_batch, wait_ms),
    )


# ---------------------------------------------------------------------------- the schedule per mode


def test_the_mode_picks_the_schedule_and_only_pipelined_has_sub_groups() -> None:
    sync, piped, asyn = (Schedule.of(rollout(m, depth=3), 64) for m in ("sync", "pipelined", "async"))
    assert (type(sync), type(piped), type(asyn)) == (Sync, Pipelined, Async)
    assert (sync.depth, piped.depth, asyn.depth) == (1, 3, 1)  # pipeline_depth counts in pipelined mode only
    assert (sync.lockstep, piped.lockstep, asyn.lockstep) == (True, True, False)
    assert (sync.resets_each_phase, piped.resets_each_phase, asyn.resets_each_phase) == (True, False, False)
    assert piped.max_wait_s == 0.005 and piped.max_batch == 8 and piped.steps_per_update == 64
    grpo = GRPOConfig(type="grpo", group_size=4, steps_per_update=32)
    assert Schedule.of(rollout("async"), grpo.steps_per_update, grpo.episodes_per_group).whole_groups
    assert not Schedule.of(rollout("sync"), 32, grpo.episodes_per_group).whole_groups  # phases, not groups
    spec = SimpleNamespace(rollout=rollout("async"), algo=grpo)
    assert Schedule.from_spec(spec) == Async(32, group_size=4, max_batch=8, max_wait_s=0.005)
    assert PPOConfig(type="ppo").episodes_per_group == 1


def test_sub_groups_split_like_array_split_and_async_has_one_per_instance() -> None:
    assert Pipelined(64, depth=3).sub_groups(8) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert Pipelined(64, depth=4).sub_groups(2) == [[0], [1]]  # more sub-groups than instances: none empty
    assert Sync(64).sub_groups(3) == [[0, 1, 2]]
    assert Async(64).sub_groups(3) == [[0], [1], [2]]
    assert (
        Pipelined(64, depth=3).step_threads(8, True),
        Async(64).step_threads(8, True),
        Sync(64).step_threads(8, False),
    ) == (3, 8, 0)


def test_a_phase_is_long_enough_for_the_update_and_from_reset_for_an_episode() -> None:
    # 256 env steps from 16 instances of chunk 1: 16 decisions; starting from reset, 40 for a 40-step episode.
    assert (Sync(256).phase_chunks(16, 1, 40), Pipelined(256, depth=2).phase_chunks(16, 1, 40)) == (40, 16)
    assert Sync(2048).phase_chunks(64, 4, 24) == 8  # ceil(2048 / 256) > 24 / 4


def test_routing_is_fixed_in_lockstep_and_least_busy_in_async() -> None:
    assert [Sync(64).route(r, [5, 0, 0]) for r in range(4)] == [0, 1, 2, 0]
    assert Async(64).route(0, [2, 1, 1]) == 1  # the first of the least busy
    assert [Sync(64).clients(g, 5, 2) for g in range(2)] == [3, 2]  # simulators 0, 2, 4 and 1, 3
    assert Async(64).clients(0, 5, 2) == 0


def test_a_batch_is_ready_when_full_late_or_everyone_asked() -> None:
    s = Sync(64, max_batch=8, max_wait_s=0.005)
    assert not s.batch_ready([], 0, 2, 1.0)
    assert not s.batch_ready([4], 1, 2, 0.004)  # half full, young, one of two simulators
    assert s.batch_ready([4, 4], 1, 2, 0.0)  # full
    assert s.batch_ready([4], 1, 2, 0.005)  # waited max_wait
    assert s.batch_ready([1], 2, 2, 0.0)  # every simulator routed here has asked
    assert not s.batch_ready([1], 2, 0, 0.0)  # async: anyone may still ask
    assert s.servable(1, 1) and not s.servable(2, 1)
    assert (s.batch_size([4, 4, 4]), s.batch_size([12, 1]), s.batch_size([1, 12])) == (2, 1, 1)


def test_the_hold_budget_is_async_hold_only() -> None:
    # (max_staleness + 1) x steps_per_update = 2 x 32 slots past what was consumed, shared by 2 generators.
    hold = Async(32, max_staleness=1, stale_policy="hold")
    assert not hold.holds(served=38, consumed=10, waiting=4, generators=2)  # budget (10 + 4 + 64) / 2 = 39
    assert hold.holds(served=39, consumed=10, waiting=4, generators=2)
    assert not hold.holds(served=39, consumed=10, waiting=6, generators=2)  # the trainer's credit lifts it
    # A forward may not overshoot the budget: what one serves past it could reach the trainer too stale.
    assert hold.hold_room(served=30, consumed=10, waiting=4, generators=2, chunk=2) == 5  # (39 - 30) / 2, up
    assert hold.hold_room(served=39, consumed=10, waiting=4, generators=2, chunk=2) == 0
    assert hold.batch_size([1] * 8, room=5) == 5 and hold.batch_size([1] * 8) == 8
    assert Async(32, max_staleness=1, stale_policy="drop").hold_room(10**6, 0, 0, 1, 2) is None
    assert not Async(32, max_staleness=1, stale_policy="drop").holds(10**6, 0, 0, 1)
    assert not Sync(32, max_staleness=1, stale_policy="hold").holds(10**6, 0, 0, 1)


def test_lockstep_takes_the_whole_phase_in_one_order_and_drops_the_stale() -> None:
    s = Sync(8, max_staleness=1)
    buffer = [Seg(1, 0, 0, 3, 4), Seg(0, 0, 1, 2, 2), Seg(0, 0, 0, 5, 4)]
    assert not s.update_ready(buffer, 10, phase_ends=1, simulators=2)
    assert s.update_ready(buffer, 0, phase_ends=2, simulators=2)
    take = s.take(buffer, version=4)
    assert [x.key() for x in take.consumed] == [(0, 0, 0), (0, 0, 1), (1, 0, 0)]
    assert [x.key() for x in take.used] == [(0, 0, 0), (1, 0, 0)]  # lag 2 > max_staleness 1: dropped
    assert take.rest == []


def test_async_takes_steps_per_update_used_steps_oldest_first() -> None:
    s = Async(6, max_staleness=0)
    buffer = [Seg(0, 0, 0, 4, 3), Seg(1, 0, 0, 4, 2), Seg(2, 0, 0, 4, 3), Seg(3, 0, 0, 4, 3)]
    assert not s.update_ready(buffer, 5, 0, 1) and s.update_ready(buffer, 6, 0, 1)
    take = s.take(buffer, version=3)
    assert [x.env_id for x in take.consumed] == [1, 0, 2]  # the stale one (oldest) does not count towards the 6
    assert [x.env_id for x in take.used] == [0, 2]
    assert [x.env_id for x in take.rest] == [3]


def test_async_takes_the_oldest_version_first_whatever_the_arrival_order() -> None:
    # A segment ships when its episode ends or its version changes, so one served early can arrive after
    # segments served later; taken in arrival order it could pass the staleness bound and be dropped.
    s = Async(6, max_staleness=1)
    buffer = [Seg(0, 0, 0, 3, 5), Seg(1, 0, 0, 3, 4), Seg(2, 0, 0, 3, 5), Seg(3, 0, 0, 3, 4)]
    take = s.take(buffer, version=5)
    assert [x.env_id for x in take.used] == [1, 3]  # version 4 first, in arrival order
    assert [x.env_id for x in take.rest] == [0, 2]


def test_whole_groups_wait_for_every_episode_of_the_group() -> None:
    s = Async(4, group_size=2)
    # Group 0 (envs 0, 1, episode 0): env 0 in two segments, both ended; group 1 (envs 2, 3): env 3 still open.
    buffer = [
        Seg(0, 0, 0, 2, 0),
        Seg(2, 0, 0, 3, 0, True),
        Seg(1, 0, 0, 3, 0, True),
        Seg(3, 0, 0, 2, 0),
        Seg(0, 0, 1, 1, 0, True),
    ]
    whole, rest = complete_groups(buffer, 2)
    assert [x.key() for x in whole] == [(0, 0, 0), (1, 0, 0), (0, 0, 1)]
    assert [x.key() for x in rest] == [(2, 0, 0), (3, 0, 0)]
    assert s.update_ready(buffer, 11, 0, 1)  # 6 steps in whole groups >= 4
    assert not s.update_ready(buffer[1:4], 8, 0, 1)  # 8 buffered, none of them a whole group
    take = s.take(buffer, 0)
    assert [x.key() for x in take.used] == [x.key() for x in whole]  # every whole group, past steps_per_update
    assert [x.key() for x in take.rest] == [(2, 0, 0), (3, 0, 0)]
    # The simulator's side: finished members start again only with their whole group.
    assert s.released({0, 3}) == [] and s.released({0, 1, 3}) == [0, 1]
    assert Async(4).released({3, 0}) == [0, 3]


def test_a_full_batch_waits_for_groups_in_play_that_would_go_stale_next_update() -> None:
    s = Async(4, max_staleness=1, group_size=2)
    whole = [Seg(0, 0, 0, 3, 1, True), Seg(1, 0, 0, 3, 1, True)]  # group 0: a full batch at version 1
    # Group 1's episode began under version 0 (its first segment, cut at the version change) and runs on.
    in_play = [Seg(2, 0, 0, 2, 0), Seg(3, 0, 0, 2, 0), Seg(3, 0, 1, 1, 1, True)]
    buffer = whole + in_play
    assert s.update_ready(buffer, 11, 0, 1)
    # Usable by the update of version 1, dropped by that of version 2: wait for the group, within GROUP_WAIT_S.
    assert s.awaits_groups(buffer, version=1, held_s=0.0)
    assert not s.awaits_groups(buffer, version=1, held_s=GROUP_WAIT_S)  # a member may be lost: go on
    assert s.awaits_groups(buffer, version=1, held_s=0.9, silent_s=0.9, silence_s=1.0)
    assert not s.awaits_groups(buffer, version=1, held_s=1.0, silent_s=1.0, silence_s=1.0)  # the generators hold
    assert not s.awaits_groups(buffer, version=0, held_s=0.0)  # still usable by the next update
    assert not s.awaits_groups(buffer, version=2, held_s=0.0)  # already past the bound: no wait mends it
    assert not s.awaits_groups(whole, version=1, held_s=0.0)  # nothing in play
    assert not Async(4, max_staleness=1).awaits_groups(buffer, version=1, held_s=0.0)  # PPO: no groups
    done = buffer + [Seg(2, 0, 1, 1, 1, True)]  # the group ends: whole, used at version 1
    take = s.take(done, version=1)
    assert [x.env_id for x in take.used] == [2, 3, 3, 2]  # the group that would go stale, whole, fills the batch
    assert [x.env_id for x in take.rest] == [0, 1]  # group 0 stays usable: the next update's


def test_the_usual_gap_between_arrivals_sets_the_silence_that_ends_a_group_wait() -> None:
    gaps = ArrivalGaps()
    assert gaps.silence_s() == GROUP_WAIT_S  # no gap known yet
    t = 0.0
    for _ in range(40):
        t += 0.05
        gaps.arrived(t)
        gaps.arrived(t)  # at the same instant (the simulation's events): one arrival
    assert gaps.silence_s() == pytest.approx(SILENCE_GAPS * 0.05)
    gaps.arrived(t + 30.0)  # an update away from the inbox: one long gap, the median stays
    assert gaps.silence_s() == pytest.approx(SILENCE_GAPS * 0.05)
    for _ in range(64):  # only the recent gaps count
        t += 0.001
        gaps.arrived(t + 30.0)
    assert gaps.silence_s() == SILENCE_FLOOR_S  # 20 ms of silence is no sign on a loaded machine
    slow = ArrivalGaps()
    for i in range(5):
        slow.arrived(2.0 * i)  # a slow simulator's seconds between arrivals
    assert slow.silence_s() == GROUP_WAIT_S


def group(g: int, version: int) -> list:
    """Group g's two ended episodes (environments 2g and 2g+1), of 2 steps each."""
    return [Seg(2 * g, 0, 0, 2, version, True), Seg(2 * g + 1, 0, 0, 2, version, True)]


def test_whole_groups_fill_one_batch_oldest_first_and_never_leave_one_to_go_stale() -> None:
    s = Async(4, max_staleness=1, group_size=2)
    buffer = group(0, 3) + group(1, 2) + group(2, 3) + group(3, 1)  # 4 steps each
    take = s.take(buffer, version=3)
    # group 3 (version 1) is past the bound: consumed, not used; group 1 (version 2) would go stale next update;
    # that fills the batch, so groups 0 and 2 (version 3) wait, in arrival order
    assert [x.env_id for x in take.consumed] == [6, 7, 2, 3] and [x.env_id for x in take.used] == [2, 3]
    assert [x.env_id for x in take.rest] == [0, 1, 4, 5]
    take = s.take(group(0, 2) + group(1, 2) + group(2, 3), version=3)
    assert [x.env_id for x in take.used] == [0, 1, 2, 3]  # both would go stale: both taken, past the batch
    assert [x.env_id for x in take.rest] == [4, 5]


def test_the_trainer_role_waits_for_a_group_in_play_then_takes_it_whole(tmp_path, monkeypatch) -> None:
    grpo = GRPOConfig(type="grpo", steps_per_update=4, group_size=2)
    col = collector(tmp_path, rollout("async", staleness=1), grpo)
    for seg in [segment(0, 0, 0, 3, 1, True), segment(1, 0, 0, 3, 1, True), segment(2, 0, 0, 2, 0, False)]:
        deliver(col, msgs.encode_segment(seg))
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("vlaslurm.runtime.roles.trainer.time.monotonic", lambda: clock.now)
    assert not col.ready(1)  # a full batch, but group 1 began under version 0
    # while it waits, the group's slots (not the batch's) count for the hold budget: the generators may serve its rest
    assert col.waiting_slots(1) == 2
    deliver(col, msgs.encode_segment(segment(3, 0, 0, 4, 1, True)), msgs.encode_segment(segment(2, 0, 1, 2, 1, True)))
    assert col.ready(1)
    assert [s.env_id for s in col.take(1)] == [2, 3, 2] and col.dropped == 0  # the older group; group 0 waits
    # A group whose member never comes (its simulator restarted) holds the trainer GROUP_WAIT_S at most.
    for seg in [segment(0, 1, 0, 3, 2, True), segment(1, 1, 0, 3, 2, True), segment(2, 1, 0, 2, 1, False)]:
        deliver(col, msgs.encode_segment(seg))
    assert not col.ready(2)
    clock.now += GROUP_WAIT_S
    assert col.ready(2)


def test_the_trainer_role_and_the_simulation_end_a_group_wait_after_the_same_silence(tmp_path, monkeypatch) -> None:
    """Every generator holds (nothing arrives): the groups in play cannot end, so the wait ends after a silence of
    SILENCE_GAPS usual gaps between arrivals, long before GROUP_WAIT_S, in the role and its simulation alike."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("vlaslurm.runtime.roles.trainer.time.monotonic", lambda: clock.now)
    p = pipeline("async", sims=1, gens=1, staleness=1, spu=4, group=2, policy="hold")
    col = collector(
        tmp_path,
        rollout("async", staleness=1, policy="hold"),
        GRPOConfig(type="grpo", steps_per_update=4, group_size=2),
    )
    gap = 0.04  # the usual gap: the wait ends after 20 x 0.04 = 0.8 s of silence
    trace = [
        (2, 0, 0, 1, 0, False),  # group 1's episode began under version 0 (cut at the version change)
        (0, 0, 0, 3, 1, True),
        (3, 0, 0, 1, 0, False),
        (2, 0, 1, 1, 1, False),
        (1, 0, 0, 3, 1, True),  # group 0 whole: a full batch at version 1; group 1 in play would go stale next
    ]
    p.version = 1
    for i, (env_id, episode, index, steps, version, done) in enumerate(trace):
        clock.now = p.now = 100.0 + i * gap
        deliver(col, msgs.encode_segment(segment(env_id, episode, index, steps, version, done)))
        e = _Env(env_id, 0, 0, 10)
        e.episode, e.seg_index, e.seg_v, e.seg_steps = episode, index, version, steps
        p.segment(_Seg(e, steps, done))
    last = clock.now
    silence = SILENCE_GAPS * gap
    assert col.arrivals.silence_s() == p.arrivals.silence_s() == pytest.approx(silence)
    for t, ends in [(last + silence - 0.01, False), (last + silence, True)]:
        clock.now = p.now = t
        assert col.ready(1) == p._ready() == ends, t - last
    # the simulation woke at that instant to take the batch, as the role's loop does
    assert any(t == pytest.approx(last + silence) and fn == p.update for t, _, fn, _ in p._heap)


# ---------------------------------------------------------------------------- one trace, two paths


def costs() -> Costs:
    return Costs(
        step_samples=np.full((1, 4), 0.01),
        step_rule="max",
        forward_s=Curve.constant(0.001),
        update_s=Curve.constant(0.01),
        publish_s=0.0,
        install_s=0.0,
        hop_s=0.0,
        memory=Memory(capacity=1e15),
        episode_len=np.asarray([10**6]),
    )


def pipeline(
    mode: str,
    sims: int,
    gens: int,
    depth: int = 1,
    max_batch: int = 8,
    wait_ms: float = 5.0,
    staleness: int = 0,
    policy: str = "drop",
    spu: int = 6,
    group: int = 1,
    chunk: int = 1,
) -> Pipeline:
    cand = Candidate(mode, "disaggregated", sims, gens, 1, depth, max_batch, wait_ms)
    return Pipeline(cand, Workload(8, chunk, spu, staleness, policy, group_size=group), costs())


def obs_request(sim_rank: int, items: int, min_version: int) -> msgs.ObsRequest:
    n = items
    return msgs.ObsRequest(
        list(range(n)), [0] * n, [0] * n, [0] * n, Observation(None, None, [""] * n), 0, min_version, sim_rank=sim_rank
    )


def generator_decisions(trace: list, cfg: RolloutConfig, sims: int, gens: int, p: Pipeline) -> tuple:
    """Feed `trace` to the runtime's Batcher (as generator 0 builds it) and to the simulation's generator 0;
    what each served at every look."""
    schedule = Schedule.of(cfg, 6)
    batcher = Batcher(schedule, schedule.clients(0, sims, gens))
    g = p.gens[0]
    names = {}
    runtime, simulation = [], []
    version = 0
    for t, what, *args in trace:
        if what == "request":
            name, sim_rank, items, min_version = args
            batcher.pending.append(Pending(b"peer", obs_request(sim_rank, items, min_version), t))
            req = _Req(sim_rank, [_Env(0, sim_rank, 0, 10)] * items, 0, min_version, arrival=t)
            names[id(batcher.pending[-1])], names[id(req)] = name, name
            g.queue.append(req)
        elif what == "version":
            version = g.version = args[0]
        else:  # the generator looks: the runtime's loop turn, the simulation's serve
            runtime.append([names[id(x)] for x in batcher.take(version)] if batcher.ready(version, t) else [])
            before = list(g.queue)
            p.now, g.busy = t, False
            p.serve(0)
            simulation.append([names[id(q)] for q in before if q not in g.queue])
    return runtime, simulation


def test_the_generator_batches_alike_in_the_runtime_and_the_simulation() -> None:
    # Pipelined, 3 simulators on 2 generators: generator 0 serves simulators 0 and 2 (max_batch 8, 5 ms).
    trace = [
        (0.000, "request", "A", 0, 4, 0),
        (0.001, "look"),  # half full, young, one of two: wait
        (0.002, "request", "B", 0, 4, 0),
        (0.002, "look"),  # full
        (0.003, "request", "C", 2, 4, 1),
        (0.004, "look"),  # asks for version 1: not servable yet
        (0.005, "version", 1),
        (0.005, "look"),  # servable; one simulator of two, young: wait
        (0.006, "request", "D", 0, 2, 1),
        (0.006, "look"),  # both simulators have asked
        (0.007, "request", "E", 2, 6, 1),
        (0.0071, "request", "F", 2, 6, 1),
        (0.008, "look"),  # E; F too many
        (0.009, "look"),
        (0.0121, "look"),
    ]  # F waits, until its max_wait is over
    p = pipeline("pipelined", sims=3, gens=2, depth=2)
    runtime, simulation = generator_decisions(trace, rollout("pipelined", depth=2), 3, 2, p)
    assert runtime == simulation == [[], ["A", "B"], [], [], ["C", "D"], ["E"], [], ["F"]]
    # Async: nobody is known to be missing, so only a full batch or the wait serves.
    trace = [
        (0.0, "request", "A", 0, 1, 0),
        (0.0, "request", "B", 0, 1, 0),
        (0.001, "look"),
        (0.002, "request", "C", 0, 2, 0),
        (0.002, "look"),
        (0.003, "request", "D", 0, 1, 0),
        (0.004, "look"),
        (0.008, "look"),
    ]
    p = pipeline("async", sims=1, gens=1, max_batch=4, wait_ms=5.0)
    runtime, simulation = generator_decisions(trace, rollout("async", max_batch=4), 1, 1, p)
    assert runtime == simulation == [[], ["A", "B", "C"], [], ["D"]]


def trainer_states(trace: list, col: Collector, p: Pipeline, chunk: int) -> tuple:
    """Feed `trace` to the runtime's Collector (its loop: take whenever ready, then one update) and to the
    simulation's trainer; the state of each after every event."""
    runtime, simulation = [], []
    version = 0
    for what, *args in trace:
        if what == "segment":
            env_id, episode, index, steps, version_of, done, sim_rank = args
            seg = segment(env_id, episode, index, steps, version_of, done, sim_rank, chunk)
            col.pull.inbox.append(msgs.encode_segment(seg))
            e = _Env(env_id, sim_rank, 0, 10)
            e.episode, e.seg_index, e.seg_v, e.seg_steps = episode, index, version_of, steps
            p.segment(_Seg(e, seg.length * chunk, done))
        else:
            col.pull.inbox.append(msgs.phase_end(args[0], args[1], 0, 0))
            p.phase_end(args[0])
        col.receive(0)
        while col.ready(version):
            if col.take(version):
                version += 1
        while p.train_busy:  # the update is over at once
            p.train_busy, p.version = False, p.version + 1
            p.update()
        runtime.append(
            (
                version,
                col.consumed_steps,
                col.consumed_slots,
                col.counters.values.get("dropped_steps", 0),
                sorted(row["lag"] for row in col.ledger.rows if row["used"]),
                sorted((s.env_id, s.episode, s.index) for s in col.buffer),
                col.waiting_slots(version),
            )
        )
        simulation.append(
            (
                p.version,
                p.consumed,
                p.consumed_slots,
                p.dropped_steps,
                sorted(p.lags),
                sorted((s.env_id, s.episode, s.index) for s in p.buffer),
                p._waiting_slots(),
            )
        )
    return runtime, simulation


@pytest.mark.parametrize("case", ["sync", "async", "async-grpo"])
def test_the_trainer_takes_alike_in_the_runtime_and_the_simulation(tmp_path, case: str) -> None:
    seg = "segment"
    if case == "sync":  # 2 simulators (environments 0-3 and 4-7): a phase is over when both said so
        p = pipeline("sync", sims=2, gens=1, staleness=0, spu=4)
        col = collector(tmp_path, rollout("sync"), PPOConfig(type="ppo", steps_per_update=4), 2, 1)
        trace = [
            (seg, 1, 0, 0, 3, 0, False, 0),
            ("phase_end", 0, 0),
            (seg, 5, 0, 0, 2, 0, True, 1),
            (seg, 4, 0, 0, 2, 0, False, 1),
            ("phase_end", 0, 1),  # both ended: update 0 takes all three
            (seg, 1, 1, 0, 4, 1, False, 0),
            (seg, 4, 1, 0, 4, 1, False, 1),
            ("phase_end", 1, 1),
            ("phase_end", 1, 0),
        ]
    elif case == "async":  # 6 used steps an update, max_staleness 1
        p = pipeline("async", sims=1, gens=1, staleness=1, spu=6, chunk=2)
        col = collector(tmp_path, rollout("async", staleness=1), PPOConfig(type="ppo", steps_per_update=6), 1, 2)
        trace = [
            (seg, 0, 0, 0, 4, 0, False, 0),
            (seg, 1, 0, 0, 3, 0, True, 0),  # 7 >= 6: update 0
            (seg, 2, 0, 0, 4, 0, False, 0),
            (seg, 3, 0, 0, 4, 1, False, 0),  # 8: update 1 (lag 1 ok)
            (seg, 0, 0, 1, 2, 0, False, 0),
            (seg, 4, 0, 0, 3, 2, False, 0),  # 5 buffered
            (seg, 5, 0, 0, 4, 2, False, 0),
        ]  # update 2: the lag 2 one dropped, 7 used
    else:  # GRPO groups of 2 episodes in async: whole groups only, and the hold budget's credit meanwhile
        p = pipeline("async", sims=1, gens=1, staleness=0, spu=4, group=2, policy="hold", chunk=2)
        algo = GRPOConfig(type="grpo", group_size=2, steps_per_update=4)
        col = collector(tmp_path, rollout("async", policy="hold"), algo, 1, 2)
        trace = [
            (seg, 0, 0, 0, 3, 0, False, 0),
            (seg, 2, 0, 0, 4, 0, True, 0),  # nothing whole: credit 4 + 4
            (seg, 1, 0, 0, 2, 0, True, 0),  # env 1 ended, env 0 not yet
            (seg, 0, 0, 1, 1, 0, True, 0),  # group 0 is whole (6 steps), group 1 in play would go stale: wait
            (seg, 3, 0, 0, 5, 0, True, 0),  # group 1 whole: update 0 takes both
            (seg, 0, 1, 0, 2, 0, True, 0),  # a straggler of version 0, already stale: no wait for its group
            (seg, 1, 1, 0, 3, 1, True, 0),
        ]  # that group whole: update 1, env 0's segment dropped
    runtime, simulation = trainer_states(trace, col, p, chunk=2 if case != "sync" else 1)
    assert runtime == simulation
    assert runtime[-1][0] == {"sync": 2, "async": 3, "async-grpo": 2}[case]  # every update happened
