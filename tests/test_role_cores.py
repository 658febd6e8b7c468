"""The roles' cores on hand-built inputs, without processes: the generator's `Batcher`, the trainer's
`Collector` (fed through a stand-in socket) and the simulator's `Stepper` (with a hand-made env)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
import pytest
import torch

from vlaslurm.envs.base import Observation, StepResult
from vlaslurm.rundir import Counters, EventLog, read_events
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime.roles.generator import WEIGHT_LAG_ENV, Batcher, Pending, WeightLag
from vlaslurm.runtime.roles.simulator import Stepper, StuckStep
from vlaslurm.runtime.roles.trainer import Collector, TrainerConfig
from vlaslurm.runtime.schedule import Async, Sync
from vlaslurm.runtime.transport import Message, Poller
from vlaslurm.spec.algo_types import GRPOConfig, PPOConfig
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.schema import BatchingConfig, CheckpointConfig, RolloutConfig, TrackingConfig

# ---------------------------------------------------------------------------- generator: Batcher


def pending(sim_rank: int, items: int, arrived: float, min_version: int = 0) -> Pending:
    request = msgs.ObsRequest(
        list(range(items)),
        [0] * items,
        [0] * items,
        [0] * items,
        Observation(None, None, [""] * items),
        0,
        min_version,
        sim_rank=sim_rank,
    )
    return Pending(f"sim{sim_rank}".encode(), request, arrived)


def test_batcher_serves_oldest_first_up_to_max_batch() -> None:
    b = Batcher(Async(64, max_batch=4, max_wait_s=0.010))
    b.pending += [pending(0, 3, 0.0), pending(0, 2, 0.001), pending(0, 1, 0.002)]
    assert b.ready(0, 0.002)  # 6 items >= 4
    assert [len(p.request) for p in b.take(0)] == [3]  # 3 + 2 would pass max_batch
    assert not b.ready(0, 0.003) and b.wait_s(0, 0.003) == pytest.approx(0.008)  # 3 items, the oldest 2 ms
    assert b.ready(0, 0.011)
    assert [len(p.request) for p in b.take(0)] == [2, 1]
    b.pending.append(pending(0, 9, 0.02))
    assert b.ready(0, 0.02) and [len(p.request) for p in b.take(0)] == [9]  # a larger one alone
    assert b.wait_s(0, 0.03) == 0.05 and b.take(0) == []  # nothing waits: the poll's own timeout


def test_weight_lag_serves_the_weights_received_n_versions_earlier(monkeypatch) -> None:
    """The diagnostic that gives sync async's feedback delay: with n = 1 each version is served one late, and
    what it serves is a copy (the subscriber may reuse its buffers)."""
    assert WeightLag.from_env() is None  # off unless asked
    monkeypatch.setenv(WEIGHT_LAG_ENV, "1")
    lag = WeightLag.from_env()
    assert lag is not None and lag.versions == 1
    received = [{"w": torch.full((2,), float(v))} for v in range(4)]
    served = [float(lag.served(sd)["w"][0]) for sd in received]
    assert served == [0.0, 0.0, 1.0, 2.0]
    received[2]["w"].add_(10.0)
    assert float(lag.kept[0]["w"][0]) == 2.0 and len(lag.kept) == 2


def test_batcher_in_lockstep_serves_once_every_simulator_asked_and_holds_newer_versions() -> None:
    b = Batcher(Sync(64, max_batch=64, max_wait_s=1.0), clients=2)
    b.pending += [pending(0, 4, 0.0), pending(1, 4, 0.0, min_version=1)]
    assert not b.ready(0, 0.1)  # simulator 1 asks for version 1: only one of two servable
    assert b.ready(1, 0.1)  # with version 1 both have asked: nothing more can come
    assert [p.request.sim_rank for p in b.take(1)] == [0, 1] and b.pending == []


# ---------------------------------------------------------------------------- trainer: Collector


class FakePull:
    """The trainer's segment socket, fed by the test."""

    def __init__(self) -> None:
        self.inbox: List[Message] = []
        self.rejected = 0

    def recv(self, timeout_ms: int) -> Optional[Message]:
        return self.inbox.pop(0) if self.inbox else None


class FakePub:
    def __init__(self) -> None:
        self.sent: List[Message] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)


def segment(
    env_id: int,
    episode: int,
    index: int,
    steps: int,
    version: int,
    done: bool,
    sim_rank: int = 0,
    chunk: int = 1,
    incarnation: int = 0,
) -> msgs.Segment:
    """A segment of `steps` env steps in chunks of `chunk` (the last one cut short where `steps` ends)."""
    rows = -(-steps // chunk)
    mask = np.arange(rows * chunk).reshape(rows, chunk) < steps
    z = np.zeros((rows, chunk), np.float32)
    return msgs.Segment(
        f"{env_id}-{episode}-{index}",
        env_id,
        episode,
        index,
        "task",
        "go",
        version,
        None,
        np.zeros((rows + 1, 2), np.float32),
        np.zeros((rows, chunk, 2), np.float32),
        z,
        np.zeros(rows, np.float32),
        z,
        mask,
        np.zeros(rows, np.int64),
        np.full(rows, version),
        done,
        False,
        False,
        0.0,
        0.0,
        sim_rank=sim_rank,
        incarnation=incarnation,
    )


def collector(tmp_path, rollout: RolloutConfig, algo, sims: int = 1, chunk: int = 1) -> Collector:
    """Trainer rank 0's Collector with what it reads of its rank: run directory, clock, simulator ranks."""
    cfg = TrainerConfig(
        algo=algo,
        model=ModelConfig(type="synthetic", action_chunk=chunk),
        rollout=rollout,
        checkpoint=CheckpointConfig(),
        tracking=TrackingConfig(failures_per_task=0),
        layout="disaggregated",
    )
    ctx = SimpleNamespace(
        run_dir=tmp_path, now=lambda: 0.0, info=SimpleNamespace(ranks={"simulator": sims}), world=None
    )  # a RankContext without the distributed world
    return Collector(cfg, ctx, FakePull(), FakePub())


def deliver(col: Collector, *messages: Message) -> None:
    col.pull.inbox += messages
    col.receive(0)


def test_collector_takes_a_phase_once_every_simulator_ended_it(tmp_path) -> None:
    col = collector(tmp_path, RolloutConfig(mode="sync"), PPOConfig(type="ppo", steps_per_update=8), sims=2, chunk=2)
    deliver(col, msgs.encode_segment(segment(5, 0, 0, 3, 0, True, sim_rank=1, chunk=2)), msgs.phase_end(0, 1, 3, 1))
    deliver(col, msgs.encode_segment(segment(0, 0, 0, 4, 0, False, chunk=2)))
    assert not col.ready(0) and col.buffered_steps == 7  # simulator 0 is still in its phase
    deliver(col, msgs.phase_end(0, 0, 4, 1))
    assert col.ready(0)
    used = col.take(0)
    assert [s.env_id for s in used] == [0, 5]  # one order, whatever the arrival order
    assert (col.consumed_steps, col.consumed_slots, col.buffered_steps) == (7, 8, 0)  # 3 steps fill 2 chunks
    assert [r["used"] for r in col.ledger.rows] == [True, True] and not col.ready(0)


def test_collector_drops_segments_past_the_staleness_bound(tmp_path) -> None:
    col = collector(tmp_path, RolloutConfig(mode="async", max_staleness=0), PPOConfig(type="ppo", steps_per_update=4))
    deliver(
        col,
        msgs.encode_segment(segment(0, 0, 0, 3, 0, False)),
        msgs.encode_segment(segment(1, 0, 0, 4, 1, False)),
        msgs.encode_segment(segment(2, 0, 0, 4, 1, False)),
    )
    assert col.ready(1)
    assert [s.env_id for s in col.take(1)] == [1]  # 0 is stale; 1 makes the 4 steps
    assert col.dropped == 1 and col.counters.values["dropped_steps"] == 3
    assert [(r["env_id"], r["used"], r["dropped"], r["lag"]) for r in col.ledger.rows] == [
        (0, False, True, 1),
        (1, True, False, 0),
    ]
    assert [s.env_id for s in col.buffer] == [2] and col.buffered_steps == 4


def test_collector_discards_what_a_restarted_simulator_s_dead_process_shipped(tmp_path) -> None:
    col = collector(tmp_path, RolloutConfig(mode="sync"), PPOConfig(type="ppo", steps_per_update=4), sims=2)
    deliver(
        col,
        msgs.encode_segment(segment(0, 0, 0, 2, 0, False)),
        msgs.encode_segment(segment(4, 0, 0, 2, 0, False, sim_rank=1)),
        msgs.phase_end(0, 1, 2, 1),
    )
    deliver(col, msgs.sim_restart(1, 1))  # simulator 1's new process redoes the phase
    assert [s.env_id for s in col.buffer] == [0] and col.discarded == 1 and not col.phase_ends[0] - {0}
    deliver(
        col,
        msgs.encode_segment(segment(5, 0, 0, 2, 0, False, sim_rank=1)),  # late, from the dead one
        msgs.phase_end(0, 1, 2, 1),
        msgs.phase_end(0, 0, 2, 1),
    )
    assert col.discarded == 2 and not col.ready(0)  # the dead one's phase end does not count either
    deliver(
        col,
        msgs.encode_segment(segment(4, 1, 0, 3, 0, False, sim_rank=1, incarnation=1)),
        msgs.phase_end(0, 1, 3, 1, incarnation=1),
    )
    assert col.ready(0) and [s.env_id for s in col.take(0)] == [0, 4]


def test_collector_credits_the_hold_budget_while_grpo_groups_are_not_whole(tmp_path) -> None:
    # max_staleness 1: group 1 (env 2 ended, env 3 on) stays usable next update, so nothing waits for it
    rollout = RolloutConfig(mode="async", max_staleness=1, stale_policy="hold", batching=BatchingConfig(8, 5.0))
    col = collector(tmp_path, rollout, GRPOConfig(type="grpo", group_size=2, steps_per_update=2), chunk=2)
    deliver(
        col,
        msgs.encode_segment(segment(0, 0, 0, 3, 0, True, chunk=2)),
        msgs.encode_segment(segment(2, 0, 0, 2, 0, True, chunk=2)),
    )
    assert not col.ready(0) and col.waiting_slots(0) == 4 + 2  # 5 steps buffered, no group whole
    col.announce(0, force=True)
    assert col.pub.sent[-1].meta["waiting"] == 6
    deliver(col, msgs.encode_segment(segment(1, 0, 0, 1, 0, True, chunk=2)))
    assert col.ready(0) and col.waiting_slots(0) == 0  # group 0 is whole: the credit is gone
    assert [s.env_id for s in col.take(0)] == [0, 1] and [s.env_id for s in col.buffer] == [2]


# ---------------------------------------------------------------------------- simulator: Stepper


class CountingEnv:
    """A hand-made VecEnv: the state counts each instance's steps; an episode lasts `length` steps.
    `gate` (a Barrier or an Event) is waited on in every step when given."""

    action_dim, state_dim = 1, 1

    def __init__(self, num_envs: int, length: int = 100, thread_safe: bool = True, gate=None) -> None:
        self.num_envs, self.length, self.thread_safe, self.gate = num_envs, length, thread_safe, gate
        self.tasks = ["count"] * num_envs
        self.t = np.zeros(num_envs, int)
        self.threads: List[str] = []

    def step(self, env_ids, actions: np.ndarray) -> StepResult:
        self.threads.append(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(5.0)
        ids = np.asarray(env_ids)
        self.t[ids] += 1
        n = len(ids)
        done = self.t[ids] >= self.length
        return StepResult(
            Observation(None, self.t[ids, None].astype(np.float32), ["count"] * n),
            np.ones(n, np.float32),
            done,
            np.zeros(n, bool),
            done,
        )


def stepper(tmp_path, env: CountingEnv, workers: int, running_s: float = 60.0) -> Stepper:
    """A Stepper with what it reads of its simulator: env, clock, deadline, records; and a bare poller."""
    ctx = SimpleNamespace(now=time.monotonic, rank=0, deadlines=SimpleNamespace(running_s=running_s))
    sim = SimpleNamespace(
        env=env,
        ctx=ctx,
        counters=Counters(tmp_path, "simulator", 0),
        events=EventLog(tmp_path, "simulator", 0),
        stuck=[],
        tracks=[SimpleNamespace(gid=100 + i) for i in range(env.num_envs)],
    )
    return Stepper(sim, SimpleNamespace(poller=Poller()), workers)


def reply(env_ids: List[int], chunk: int, version: int = 3) -> msgs.ActReply:
    n = len(env_ids)
    return msgs.ActReply(
        env_ids,
        0,
        version,
        np.zeros((n, chunk, 1), np.float32),
        np.zeros((n, chunk), np.float32),
        np.zeros(n, np.float32),
    )


def wait_finished(st: Stepper, count: int) -> list:
    out: list = []
    end = time.monotonic() + 10
    while len(out) < count and time.monotonic() < end:
        st.io.poller.poll(100)  # a chunk that ends wakes the main loop's poll
        out += st.finished()
    return out


def test_stepper_inline_steps_on_the_callers_thread(tmp_path) -> None:
    env = CountingEnv(3, length=2)
    st = stepper(tmp_path, env, workers=0)
    st.submit(1, [0, 2], reply([0, 2], chunk=3))
    ((g, rep, result),) = st.finished()
    assert g == 1 and rep.version == 3 and set(env.threads) == {threading.current_thread().name}
    assert result.mask.tolist() == [[True, True, False]] * 2  # the episode ended after 2 of the 3 actions
    assert result.terminated.all() and env.t.tolist() == [2, 0, 2]
    st.close()
    st.sim.events.flush()
    events = [(e["ev"], e.get("g"), e.get("steps")) for e in read_events(tmp_path)]
    assert events == [("step", 1, 4), ("stop", None, None)]


def test_stepper_threads_step_sub_groups_side_by_side(tmp_path) -> None:
    env = CountingEnv(4, gate=threading.Barrier(2))  # each step waits for a step of the other sub-group
    st = stepper(tmp_path, env, workers=2)
    st.submit(0, [0, 1], reply([0, 1], chunk=2))
    st.submit(1, [2, 3], reply([2, 3], chunk=2))
    done = wait_finished(st, 2)
    assert st.running == {}  # a chunk taken by `finished` is no longer under way (nothing left to scan)
    st.close()
    assert sorted(g for g, _, _ in done) == [0, 1] and env.t.tolist() == [2, 2, 2, 2]
    assert len(set(env.threads)) == 2 and threading.current_thread().name not in env.threads


def test_stepper_names_a_step_that_never_returns(tmp_path) -> None:
    gate = threading.Event()
    st = stepper(tmp_path, CountingEnv(2, gate=gate), workers=1, running_s=0.05)
    st.submit(0, [1], reply([1], chunk=1))
    time.sleep(0.2)
    with pytest.raises(StuckStep, match=r"environment\(s\) \[101\]"):
        st.check()
    assert st.sim.stuck == [1]
    gate.set()
    st.close()


def test_stepper_close_ends_a_chunk_after_the_step_under_way(tmp_path) -> None:
    gate = threading.Event()
    env = CountingEnv(1, gate=gate)
    st = stepper(tmp_path, env, workers=1)
    st.submit(0, [0], reply([0], chunk=5))
    time.sleep(0.1)  # in its first step
    threading.Timer(0.1, gate.set).start()
    st.close()
    ((_, _, result),) = st.finished()
    assert result.mask.tolist() == [[True, False, False, False, False]] and env.t.tolist() == [1]


def test_counters_read_their_gauges_when_written(tmp_path) -> None:
    """A gauge is read at each write, not on every turn of a role's loop: the file shows its value then."""
    import json

    sent = {"rejected_messages": 0.0}
    counters = Counters(tmp_path, "simulator", 0, every_s=3600.0)
    counters.gauge(lambda: dict(sent))
    counters.add("env_steps", 5)
    counters.maybe_write(force=True)
    sent["rejected_messages"] = 2.0
    counters.maybe_write()  # not due: the file keeps the first read
    assert json.loads(counters.path.read_text())["rejected_messages"] == 0.0
    counters.maybe_write(force=True)
    written = json.loads(counters.path.read_text())
    assert (written["rejected_messages"], written["env_steps"]) == (2.0, 5.0)
