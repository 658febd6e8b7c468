"""The runtime's scheduling claims, checked on real local runs of the synthetic workload.

Every test reads what the ranks recorded (ledger, events, counters, exit
record) and checks it against an independent record where one exists: the
versions a sample was trained with against the generators' served record, the
segments in the ledger against the simulators' shipped counts.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from cpu_hog import cpu_hog as cpu_load
from runtime_helpers import RANKS_2, Run, check_trained_versions, overlaps, run_spec, synthetic_spec

from vlaslurm.envs import make_env, synthetic
from vlaslurm.rundir import read_metrics
from vlaslurm.runtime.episodes import run_chunk
from vlaslurm.spec.env_types import StepTimeConfig, SyntheticEnvConfig

MODES = {"sync": {}, "pipelined": {"pipeline_depth": 2}, "async": {"max_staleness": 1}}


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory) -> Dict[str, Run]:
    """One run per mode with two ranks of every role (shared by the tests below), beside CI's CPU hog. The hog
    stops with the runs: as a module-scoped fixture it had busied a core for the whole module (~2.5 min)."""
    runs = {}
    with cpu_load():
        for mode, extra in MODES.items():
            tmp = tmp_path_factory.mktemp(mode)
            runs[mode] = run_spec(tmp, synthetic_spec(mode, **extra), [RANKS_2], name=mode)
    return runs


def sub_group_of(env_id: int, num_envs: int, sims: int, depth: int) -> tuple:
    """(simulator rank, sub-group) of a global env id, as the lock-step loop splits them."""
    local_count = num_envs // sims
    sim, local = divmod(env_id, local_count)
    groups = np.array_split(np.arange(local_count), depth)
    return sim, next(g for g, ids in enumerate(groups) if local in ids)


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_completes_with_two_ranks_per_role(mode_runs: Dict[str, Run], mode: str) -> None:
    run = mode_runs[mode]
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    exits = run.exits()
    ranks = [f"{role}[{r}]" for role in ("trainer", "generator", "simulator") for r in range(2)]
    assert {k: exits[k]["exit_code"] for k in ranks} == {k: 0 for k in ranks}
    # Stop propagation: every rank is gone within a few seconds of the trainer's last update.
    ends = [exits[k]["end"] for k in ranks]
    assert max(ends) - min(ends) < 5.0, exits
    ledger = run.ledger
    assert ledger.steps.sum() >= 480
    # What the trainer consumed up to its last update (used, or dropped as stale) is in the ledger, all of it.
    consumed = ledger[ledger.used | ledger.dropped].steps.sum()
    last = read_metrics(run.run_dir)[-1]
    assert consumed == last["consumed_steps"], last
    # Lock-step modes consume every phase whole. Async's trainer consumes what has arrived by its updates: one that
    # the CPU hog held back found 580 env steps waiting at its second update once and stopped with 440 unconsumed
    # (and under `drop` it dropped 238 of 572 once).
    if mode != "async":
        assert consumed >= 480 - 64
    # Both simulators shipped, both generators served, both trainers ran every update.
    assert set(ledger.sim_rank) == {0, 1}
    assert {b["rank"] for b in run.events("batch", "generator")} == {0, 1}
    updates = run.events("update", "trainer")
    by_rank = {r: [u["v"] for u in updates if u["rank"] == r] for r in (0, 1)}
    assert by_rank[0] and by_rank[0] == by_rank[1]


@pytest.mark.parametrize("mode", list(MODES))
def test_ledger_has_one_row_per_segment_shipped(mode_runs: Dict[str, Run], mode: str) -> None:
    run = mode_runs[mode]
    ledger = run.ledger
    sims = run.counters("simulator")
    assert len(sims) == 2
    assert len(ledger) == sum(c["shipped_segments"] for c in sims)
    assert ledger.steps.sum() == sum(c["shipped_steps"] for c in sims) == sum(c["env_steps"] for c in sims)
    assert ledger.traj_id.is_unique
    # The (env, episode, segment) triples are unique too and tile each episode without gaps.
    for (_env_id, _episode), rows in ledger.groupby(["env_id", "episode"]):
        assert sorted(rows.segment) == list(range(len(rows)))


def test_async_requests_ready_together_share_one_message(mode_runs: Dict[str, Run]) -> None:
    """Requests a simulator has ready at once go to a generator in one message: at least each simulator's first
    requests (all its environments), and later those of environments whose chunks ended together (how many do
    depends on the machine's timing); the generators serve each request of a message on its own."""
    run = mode_runs["async"]
    sims, per_sim = run.counters("simulator"), 4  # 8 environments on 2 simulators
    sent, messages = sum(c["requests_sent"] for c in sims), sum(c["request_messages"] for c in sims)
    assert 0 < messages <= sent - len(sims) * (per_sim - 1), (messages, sent)
    served = [r for b in run.events("batch", "generator") for r in b["req"]]  # [sub-group, env, sent, arrived]
    assert 0.8 * sent < len(served) <= sent  # a few are still unserved at the stop
    assert len({(g, env) for g, env, _, _ in served}) == 8 and all(g == env % per_sim for g, env, _, _ in served)
    by_message: Dict[tuple, List[int]] = {}  # a message's requests share its send time
    for _, env, sent_at, _ in served:
        by_message.setdefault((env // per_sim, sent_at), []).append(env)
    assert len(by_message) <= messages
    assert max(len(envs) for envs in by_message.values()) == per_sim
    assert all(len(set(envs)) == len(envs) for envs in by_message.values())  # one request per env per message


@pytest.mark.parametrize("mode", list(MODES))
def test_trained_samples_carry_the_version_that_served_them(mode_runs: Dict[str, Run], mode: str) -> None:
    run = mode_runs[mode]
    check_trained_versions(run, max_staleness=1 if mode == "async" else 0)


def test_pipelined_overlaps_serving_and_stepping_sync_never_does(mode_runs: Dict[str, Run]) -> None:
    """Pipelined k=2: some batch serving sub-group g runs while another sub-group of the same simulator
    steps. Sync: no step of a simulator overlaps a batch that serves that simulator."""
    counts = {}
    for mode, depth in (("pipelined", 2), ("sync", 1)):
        run = mode_runs[mode]
        steps = run.events("step", "simulator")
        per_sim: Dict[int, List[int]] = {0: [0, 0], 1: [0, 0]}  # sim -> [batches serving it, overlapping]
        for batch in run.events("batch", "generator"):
            served = {sub_group_of(e, 8, 2, depth) for e, _, _ in batch["items"]}
            for sim in {s for s, _ in served}:
                groups = {g for s, g in served if s == sim}
                # pipelined: a *different* sub-group steps; sync: any step of the simulator at all
                others = [s for s in steps if s["rank"] == sim and (depth == 1 or s["g"] not in groups)]
                per_sim[sim][0] += 1
                per_sim[sim][1] += any(overlaps((batch["t0"], batch["t1"]), (s["t0"], s["t1"])) for s in others)
        counts[mode] = per_sim
    # Quiet machine: about half overlap. A CPU hog beside the run serialises the ranks and shrinks it (16% seen at
    # load 15; one simulator 3 of 36 and the other 13 of 43 beside two more busy loops; once 8 of 37 and 0 of 32):
    # sync's zero is exact, so a tenth over both simulators still tells the two apart.
    pipelined = counts["pipelined"].values()
    assert all(batches > 0 for batches, _ in pipelined), counts
    assert sum(overlapping for _, overlapping in pipelined) >= 0.1 * sum(batches for batches, _ in pipelined), counts
    assert all(batches > 0 and overlapping == 0 for batches, overlapping in counts["sync"].values()), counts


def test_pipelined_sub_groups_step_side_by_side(mode_runs: Dict[str, Run]) -> None:
    """Pipelined k=2 with a thread-safe env (synthetic): each sub-group steps the moment its actions arrive,
    in its own thread, so one sub-group's chunks run while the other's do. (Stepped in turns on one thread,
    as before, no two steps of a simulator would ever overlap and this fails.)"""
    steps = mode_runs["pipelined"].events("step", "simulator")
    for sim in (0, 1):
        mine = [s for s in steps if s["rank"] == sim]
        first = [s for s in mine if s["g"] == 0]
        side_by_side = sum(
            any(overlaps((a["t0"], a["t1"]), (b["t0"], b["t1"])) for b in mine if b["g"] == 1) for a in first
        )
        assert first and side_by_side >= 0.5 * len(first), (sim, side_by_side, len(first))


def test_cancelled_chunk_ends_after_the_step_under_way() -> None:
    """A stop ends the chunks under way after their current step: with `cancel` set, one step runs and the
    mask says so (the segment then carries only the steps that ran)."""
    cfg = SyntheticEnvConfig(type="synthetic", step_ms=StepTimeConfig(dist="constant", mean=1.0), episode_steps=50)
    env = make_env(cfg, num_envs=2, rank=0, seed=0)
    env.reset([0, 1])
    actions = np.zeros((2, 4, env.action_dim), np.float32)
    cancel = threading.Event()
    whole = run_chunk(env, np.array([0, 1]), actions, cancel)
    cancel.set()
    cut = run_chunk(env, np.array([0, 1]), actions, cancel)
    assert whole.mask.all()
    assert cut.mask[:, 0].all() and not cut.mask[:, 1:].any()
    assert [o[1][0] for o in cut.last_obs] == [5 / 50, 5 / 50]  # 4 steps, then 1: the state counts steps


def test_synthetic_step_takes_back_the_lateness_of_its_last_wake_up(monkeypatch) -> None:
    """Each sleep of a synthetic step wakes 1 ms late; the next step of those instances ends that much
    sooner, so 4 steps of 5 ms last 21 ms, not 24. The OS clock is faked (a fixed, known lateness cannot be
    had from a real sleep); the env's own arithmetic runs as is."""
    clock = {"now": 0.0}

    def sleep(seconds: float) -> None:
        clock["now"] += seconds + 0.001

    monkeypatch.setattr(synthetic.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(synthetic.time, "sleep", sleep)
    cfg = SyntheticEnvConfig(type="synthetic", step_ms=StepTimeConfig(dist="constant", mean=5.0), episode_steps=50)
    env = make_env(cfg, num_envs=2, rank=0, seed=0)
    env.reset([0, 1])
    for _ in range(4):
        env.step([0, 1], np.zeros((2, env.action_dim), np.float32))
    assert clock["now"] == pytest.approx(0.021)
    env.step([1], np.zeros((1, env.action_dim), np.float32))  # alone: its own lateness, not credited twice
    assert clock["now"] == pytest.approx(0.026)


def test_synthetic_forward_costs_its_modelled_time_actions_included(monkeypatch) -> None:
    """The synthetic policy's forward of 4 items at 5 ms + 0.5 ms each lasts 7 ms, drawing its actions included;
    each sleep wakes 1 ms late and the next forward ends that much sooner, so 4 forwards last 29 ms, not 32.
    A forward whose drawing alone overruns its time (faked: 9 ms) is not credited to the next one."""
    from vlaslurm.models import base as model_base
    from vlaslurm.models import synthetic as policy_module
    from vlaslurm.spec.model_types import ForwardCostConfig, SyntheticModelConfig

    clock = {"now": 0.0, "draw": 0.0}

    def sleep(seconds: float) -> None:
        clock["now"] += seconds + 0.001

    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(policy_module.time, "sleep", sleep)
    cfg = SyntheticModelConfig(type="synthetic", action_chunk=2, forward_ms=ForwardCostConfig(base=5.0, per_item=0.5))
    policy = policy_module.SyntheticPolicy(cfg, action_dim=3)
    rand = policy_module.torch.rand

    def drawn(*shape, **kw):  # drawing the actions takes clock["draw"] seconds
        clock["now"] += clock["draw"]
        return rand(*shape, **kw)

    monkeypatch.setattr(policy_module.torch, "rand", drawn)
    inp = model_base.PolicyInput(None, np.zeros((4, 2), np.float32), ["x"] * 4, None)
    for _ in range(4):
        assert policy.act(inp).actions.shape == (4, 2, 3)
    assert clock["now"] == pytest.approx(0.029)
    clock["draw"] = 0.009
    policy.act(inp)
    clock["draw"], before = 0.0, clock["now"]
    policy.act(inp)  # no credit from the overrun: 7 ms, waking 1 ms late
    assert clock["now"] - before == pytest.approx(0.008)


def test_slow_trainer_staleness_bound(tmp_path: Path, cpu_hog: int) -> None:
    """A slowed trainer with max_staleness 1: `drop` drops stale segments, `hold` makes the generator wait
    instead, and every used sample's lag stays <= 1 under both. Both runs go at once, so they share
    whatever else loads the machine. Holding drops (almost) nothing: a version serves only what the trainer
    will accept from it, and the trainer takes the oldest version first. What the budget cannot prevent is a
    segment still in flight (its chunk stepping, not yet shipped) when the last update that may use it takes
    newer ones: on a quiet machine and beside the CPU hog none here (drop: ~60 segments, half the env steps);
    one of 241 segments once in CI, which we take to be this race (its run directory was not kept)."""

    def one(policy: str) -> Run:
        spec = synthetic_spec(
            "async", steps_per_update=32, update_ms=150, total_env_steps=800, max_staleness=1, stale_policy=policy
        )
        return run_spec(tmp_path, spec, name=policy)

    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(("drop", "hold"), pool.map(one, ("drop", "hold"))))
    for run in runs.values():
        assert run.rc == 0
        check_trained_versions(run, max_staleness=1)
    (dropper,) = runs["drop"].counters("trainer")
    (holder,) = runs["hold"].counters("generator")
    assert dropper.get("dropped_segments", 0) > 0 and runs["drop"].ledger.dropped.sum() > 0
    assert holder.get("holds", 0) > 0 and holder.get("hold_s", 0) > 0
    dropped_steps = {name: int(run.ledger[run.ledger.dropped].steps.sum()) for name, run in runs.items()}
    assert dropped_steps["hold"] <= 0.02 * runs["hold"].ledger.steps.sum(), dropped_steps
    assert dropped_steps["hold"] * 10 < dropped_steps["drop"], dropped_steps
    assert holder_dropped(runs["hold"]) == runs["hold"].ledger.dropped.sum()  # the counter and the ledger agree


def holder_dropped(run: Run) -> int:
    (trainer,) = run.counters("trainer")
    return int(trainer.get("dropped_segments", 0))


def fast_env_cycle_s(run: Run, slow_envs: set) -> float:
    """Seconds from one decision of a fast environment to its next: the median gap between the starts of its
    chunks (the median keeps start-up and the stop out of it). Lock-step runs step a sub-group as one (`g`)."""
    starts: Dict[int, List[float]] = {}
    for s in run.events("step", "simulator"):
        if s["g"] not in slow_envs:
            starts.setdefault(s["g"], []).append(s["t0"])
    return float(np.median(np.concatenate([np.diff(sorted(t)) for t in starts.values()])))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_one_slow_environment_does_not_slow_the_others_in_async(tmp_path: Path, mode: str, cpu_hog: int) -> None:
    """One environment 20x slower than the other 7 (a chunk of 400 ms against 20 ms). Async: a fast environment
    decides at least twice in the time the slow one takes for one chunk (~20-50 ms a chunk, quiet to CI-like load).
    Sync, the control that shows the measure can fail: lock-step paces every environment at the slow one's chunk.

    The bar is the slow environment's own cost, which no load shortens, rather than the pace of a second run
    without the slow environment: beside a CPU hog two such runs get unequal shares of the cores (a kept pace of
    0.60 was measured in CI that way, where async's own gaps were 30 and 49 ms, far below the slow chunk)."""
    step_ms, chunk, slow_factor = 10, 2, 20
    spec = synthetic_spec(
        mode,
        step_ms=step_ms,
        action_chunk=chunk,
        total_env_steps=960 if mode == "async" else 320,
        steps_per_update=128,
        max_staleness=100,
    )
    spec["env"].update({"slow_fraction": 0.125, "slow_factor": slow_factor})
    run = run_spec(tmp_path, spec, name="one_slow")
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    slow_chunk_s = slow_factor * step_ms * chunk / 1000.0
    cycle = fast_env_cycle_s(run, {7})
    if mode == "async":
        assert cycle <= 0.5 * slow_chunk_s, (cycle, slow_chunk_s)
    else:
        assert cycle >= 0.9 * slow_chunk_s, (cycle, slow_chunk_s)


def trajectories(run: Run) -> set:
    cols = ["traj_id", "behavior_version", "steps", "success", "terminated", "digest"]
    return set(run.ledger[cols].itertuples(index=False, name=None))


def test_sync_is_reproducible_under_a_seed(mode_runs: Dict[str, Run], tmp_path: Path) -> None:
    first = mode_runs["sync"]
    again = run_spec(tmp_path, synthetic_spec("sync"), [RANKS_2], name="again")
    other = run_spec(tmp_path, synthetic_spec("sync", seed=1), [RANKS_2], name="other")
    assert first.rc == again.rc == other.rc == 0
    assert trajectories(first) == trajectories(again)
    a, b = first.ledger.set_index("traj_id"), other.ledger.set_index("traj_id")
    common = a.index.intersection(b.index)
    assert len(common) > 0
    assert (a.loc[common, "digest"] != b.loc[common, "digest"]).mean() > 0.9


def test_sync_success_rate_counts_only_the_episodes_begun_at_a_phase_reset(tmp_path: Path) -> None:
    # A phase of 6 chunks (12 steps) and 5-step episodes: each env ends one episode begun at the phase's reset and
    # one begun inside the phase. Episodes of real tasks differ in length, and of those begun inside a phase only
    # the short ones end there (mostly quick successes): counting them would inflate sync's success rate.
    spec = synthetic_spec("sync", num_envs=4, episode_steps=5, steps_per_update=48, total_env_steps=48 * 3)
    run = run_spec(tmp_path, spec, name="scored")
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    ends = run.ledger[run.ledger.terminated | run.ledger.truncated]
    first = ends.groupby(["env_id", "behavior_version"]).episode.transform("min")
    assert (ends.scored == (ends.episode == first)).all()
    assert (~ends.scored).sum() > 0
    rows = read_metrics(run.run_dir)
    assert [r["rollout/episodes"] for r in rows] == [4] * len(rows)  # one per env and phase, never the second


@pytest.mark.parametrize("mode", ["pipelined", "async"])
def test_episodes_that_run_on_across_updates_all_count(mode_runs: Dict[str, Run], mode: str) -> None:
    ledger = mode_runs[mode].ledger
    assert ledger[ledger.terminated | ledger.truncated].scored.all()


def test_a_chunk_runs_only_its_executed_actions() -> None:
    """model.execute_actions: the first n actions of each chunk run, the rest are masked out (no reward, no ratio)."""
    cfg = SyntheticEnvConfig(type="synthetic", step_ms=StepTimeConfig(dist="constant", mean=1.0), episode_steps=50)
    env = make_env(cfg, num_envs=2, rank=0, seed=0)
    env.reset([0, 1])
    result = run_chunk(env, np.array([0, 1]), np.zeros((2, 4, env.action_dim), np.float32), executed=2)
    assert result.mask[:, :2].all() and not result.mask[:, 2:].any() and not result.rewards[:, 2:].any()
    assert [o[1][0] for o in result.last_obs] == [2 / 50, 2 / 50]  # the state counts steps


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_executing_part_of_each_chunk_still_fills_each_update(tmp_path: Path, mode: str) -> None:
    """Chunks of 4 of which 2 run: a sync phase takes enough decisions for an update's env steps, the budgets count
    the steps that run, and every segment's decisions each ran 2 steps (the last one of an episode at most 2)."""
    spec = synthetic_spec(mode, num_envs=4, episode_steps=9, action_chunk=4, steps_per_update=32, total_env_steps=96)
    spec["model"]["execute_actions"] = 2
    run = run_spec(tmp_path, spec, name=f"executed-{mode}")
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    rows = read_metrics(run.run_dir)
    # Every update used at least steps_per_update executed steps (counted as slots, an update would take half).
    # Sync's phases are exactly one update each; async's number of updates depends on the timing (a loaded
    # machine made async's second update take 72 steps of which some were stale: 2 updates for the 96).
    consumed = [0] + [r["consumed_steps"] for r in rows]
    assert all(b - a >= 32 for a, b in zip(consumed, consumed[1:])) and rows[-1]["env_steps"] >= 96
    assert len(rows) >= 3 or mode == "async"
    ledger = run.ledger
    decisions = ledger.step_ids.apply(len)
    assert (ledger.steps <= 2 * decisions).all() and (ledger.steps >= 2 * decisions - 1).all()
