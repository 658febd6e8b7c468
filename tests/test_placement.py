"""Auto placement: the pipeline model on hand-computable cases, memory rejection, applying a choice,
and a real profiling job that is cached and reused. No timing assertions on this machine's speed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from vlaslurm.placement import search as ps
from vlaslurm.placement.costs import (
    Costs,
    CpuCosts,
    Curve,
    Memory,
    from_profile,
    from_synthetic,
    isotonic,
    speed_classes,
)
from vlaslurm.placement.simulate import Candidate, Prediction, Workload, simulate
from vlaslurm.spec import load_spec
from vlaslurm.spec.plan import build_plan

GiB = 2.0**30


def constant_costs(
    step_s: float, forward: Curve, update_s: float, hop_s: float = 0.0, episode: int = 10**6, **kw
) -> Costs:
    return Costs(
        step_samples=np.full((1, 8), step_s),
        step_rule="max",
        forward_s=forward,
        update_s=Curve.constant(update_s),
        publish_s=0.0,
        install_s=0.0,
        hop_s=hop_s,
        memory=kw.pop("memory", Memory(capacity=1e15)),
        episode_len=np.asarray([episode]),
        **kw,
    )


@pytest.mark.parametrize("chunk", [1, 2])
def test_sync_matches_closed_form(chunk: int) -> None:
    # One phase: P decision steps of (C * T_step + T_forward(N)), then the trainer's update, serialised.
    n, step, spu, update = 16, 0.010, 256, 0.020
    costs = constant_costs(step, Curve.linear(0.002, 0.0002), update)
    pred = simulate(
        Candidate("sync", "disaggregated", 1, 1, 1, 1, max_batch=n, max_wait_ms=20), Workload(n, chunk, spu), costs
    )
    phases = math.ceil(spu / (n * chunk))
    expected = n * chunk * phases / (phases * (chunk * step + 0.002 + 0.0002 * n) + update)
    assert pred.sps == pytest.approx(expected, rel=1e-6)
    assert pred.lag["max"] == 0


def test_a_sync_phase_lasts_an_episode_when_the_update_needs_fewer_steps() -> None:
    # 256 env steps an update from 16 instances is 16 decisions, but sync phases start from reset, so the
    # simulator role runs 40 (the episode limit); a pipelined phase keeps its 16 per sub-group.
    work = Workload(16, 1, 256, episode_limit=40)
    sync, piped = Candidate("sync", "disaggregated", 1, 1, 1), Candidate("pipelined", "disaggregated", 1, 1, 1, 2)
    assert (work.chunks_per_phase(sync), work.chunks_per_phase(piped)) == (40, 16)
    step, fwd, update = 0.010, 0.002, 0.020
    pred = simulate(
        Candidate("sync", "disaggregated", 1, 1, 1, 1, 16, 0), work, constant_costs(step, Curve.constant(fwd), update)
    )
    assert pred.sps == pytest.approx(16 * 40 / (40 * (step + fwd) + update), rel=1e-6)


def test_a_thread_woken_from_a_sleep_adds_its_wake_up_to_the_round() -> None:
    # Sync, constant 10 ms steps and 2 ms forwards; waking anything that slept over 1 ms costs 0.5 ms. Each
    # decision the generator wakes after sleeping through the step, the stepping thread after the forward:
    # P x (step + fwd + 2 wake) a phase, less one wake: the phase's first request comes right after the
    # generator installed the new weights, which ended its sleep.
    wake = Curve([0.0, 0.001], [0.0, 0.0005], flat=True)
    assert (wake(0.0005), wake(0.004), wake(60.0)) == pytest.approx((0.00025, 0.0005, 0.0005))
    costs = constant_costs(0.010, Curve.constant(0.002), 0.020, wake_after_s=wake)
    pred = simulate(Candidate("sync", "disaggregated", 1, 1, 1, 1, 16, 0), Workload(16, 1, 256), costs)
    phase = 16 * (0.010 + 0.002 + 2 * 0.0005) - 0.0005
    assert pred.sps == pytest.approx(256 / (phase + 0.020), rel=1e-6)


def test_each_reply_is_received_by_the_one_main_thread_before_its_step() -> None:
    # Async, 8 instances answered in one batch (max_wait long enough to fill it). The main thread receives the
    # replies one after another (r each), so the steps start r apart; each result's bookkeeping (m - r) fits
    # in the gap, and the last request leaves (n - 1) r + step + m after the forward.
    n, step, fwd, m, r = 8, 0.010, 0.002, 0.0003, 0.0002
    work = Workload(n, 1, 256, max_staleness=100)
    cand = Candidate("async", "disaggregated", 1, 1, 1, 1, n, 1000.0)
    split = simulate(cand, work, constant_costs(step, Curve.constant(fwd), 1e-4, message_s=m, reply_s=r), updates=20)
    assert split.sps == pytest.approx(n / (fwd + (n - 1) * r + step + m), rel=1e-6)
    # All of it after the step instead: the n results queue for the main thread.
    after = simulate(cand, work, constant_costs(step, Curve.constant(fwd), 1e-4, message_s=m), updates=20)
    assert after.sps == pytest.approx(n / (fwd + step + n * m), rel=1e-6)


def test_a_message_wakes_the_main_thread_that_slept_in_its_poll() -> None:
    # Async, 8 instances answered in one batch, and anything that slept over 1 ms takes w to wake. The
    # main thread slept through the forward: the first reply wakes it (w), then it receives the replies
    # (r each). Each step's thread, asleep since its last step, wakes (w) and steps; the main thread slept
    # through the steps too, so the first result wakes it again (w). The results then queue for its
    # bookkeeping (m - r each, longer than the r between them); the last request completes the batch.
    # (The first request wakes the generator (w), hidden behind the 7 (m - r) until the last; each later
    # one finds it asleep for less than 1 ms: no wake-up.)
    n, step, fwd, m, r, w = 8, 0.010, 0.002, 0.0005, 0.0002, 0.0005
    work = Workload(n, 1, 256, max_staleness=100)
    cand = Candidate("async", "disaggregated", 1, 1, 1, 1, n, 1000.0)
    wake = Curve([0.0, 0.001, 0.0011], [0.0, 0.0, w], flat=True)
    pred = simulate(
        cand,
        work,
        constant_costs(step, Curve.constant(fwd), 1e-4, message_s=m, reply_s=r, wake_after_s=wake),
        updates=20,
    )
    assert pred.sps == pytest.approx(n / (fwd + w + r + w + step + w + n * (m - r)), rel=1e-6)


def test_a_batch_that_never_fills_waits_max_wait() -> None:
    # Async, max_batch above the 4 instances that ask together: every decision step also waits max_wait_ms.
    costs = constant_costs(0.010, Curve.constant(0.002), 0.0)
    pred = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, max_batch=64, max_wait_ms=5),
        Workload(4, 1, 256, max_staleness=100),
        costs,
    )
    assert pred.sps == pytest.approx(4 / (0.010 + 0.005 + 0.002), rel=1e-6)


def test_sync_serves_at_once_when_every_simulator_has_asked() -> None:
    # Lock-step, as the generator role (Schedule.batch_ready): the one simulator routed here has asked, so
    # nothing more can come and the batch is served without waiting max_wait_ms for max_batch.
    costs = constant_costs(0.010, Curve.constant(0.002), 0.0)
    pred = simulate(
        Candidate("sync", "disaggregated", 1, 1, 1, 1, max_batch=64, max_wait_ms=5), Workload(16, 1, 256), costs
    )
    assert pred.sps == pytest.approx(16 / (0.010 + 0.002), rel=1e-6)


def test_the_batch_timer_wakes_a_generator_asleep_in_its_poll() -> None:
    # As the async case above with wake-ups (w after any sleep over 1 ms): each decision the requests wake
    # the generator (asleep through the step), which then sleeps max_wait_ms for a batch that never fills
    # and is woken by its timer (w); the stepping threads wake after the forward (w). New weights (installed
    # in no time here) interrupt one of its sleeps but leave it over 1 ms: no wake-up is saved.
    w = 0.0005
    wake = Curve([0.0, 0.001], [0.0, w], flat=True)
    costs = constant_costs(0.010, Curve.constant(0.002), 0.020, wake_after_s=wake)
    pred = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, max_batch=64, max_wait_ms=5),
        Workload(4, 1, 256, max_staleness=100),
        costs,
    )
    assert pred.sps == pytest.approx(4 / (0.010 + 0.005 + 0.002 + 3 * w), rel=1e-6)


def test_pipelined_two_subgroups_keep_the_simulator_busy() -> None:
    # k=2, step 10 ms >> forward 2 ms, a thread-safe env: each sub-group steps in its own thread, so
    # each cycles forward + step (12 ms) on its own, the second 2 ms behind the first (it waited for
    # the first forward); a phase of P = 16 rounds is 2 ms + P * 12 ms, then the update. (With the
    # sub-groups taking turns on one thread it would be 2 ms + P * k * 10 ms.)
    costs = constant_costs(0.010, Curve.constant(0.002), 0.020)
    pred = simulate(
        Candidate("pipelined", "disaggregated", 1, 1, 1, 2, max_batch=8, max_wait_ms=0), Workload(16, 1, 256), costs
    )
    assert pred.sps == pytest.approx(256 / (0.002 + 16 * (0.010 + 0.002) + 0.020), rel=1e-6)
    # An env that is not thread-safe steps inline: sub-group after sub-group on the one thread.
    inline = simulate(
        Candidate("pipelined", "disaggregated", 1, 1, 1, 2, max_batch=8, max_wait_ms=0),
        Workload(16, 1, 256),
        constant_costs(0.010, Curve.constant(0.002), 0.020, thread_safe=False),
    )
    assert inline.sps == pytest.approx(256 / (0.002 + 16 * 2 * 0.010 + 0.020), rel=1e-6)


def test_pipelined_hides_the_generator_when_it_is_the_bottleneck() -> None:
    # Forward 10 ms per sub-group, step 1 ms: the generator serves sub-groups back to back.
    costs = constant_costs(0.001, Curve.constant(0.010), 0.0)
    work = Workload(16, 1, 256)
    sync = simulate(Candidate("sync", "disaggregated", 1, 1, 1, 1, 16, 0), work, costs).sps
    piped = simulate(Candidate("pipelined", "disaggregated", 1, 1, 1, 2, 8, 0), work, costs).sps
    assert sync == pytest.approx(16 / 0.011, rel=1e-6)
    assert piped == pytest.approx(256 / (16 * 2 * 0.010 + 0.001), rel=1e-6)  # generator-bound: 2 forwards a round


def test_async_is_the_minimum_of_the_capacities() -> None:
    work = Workload(8, 1, 256, max_staleness=100, stale_policy="drop")
    free = Curve.constant(0.0)
    sim_bound = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 8, 0), work, constant_costs(0.010, free, 0.001), updates=30
    )
    assert sim_bound.sps == pytest.approx(8 / 0.010, rel=0.03)
    gen_bound = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 1, 0),
        work,
        constant_costs(0.001, Curve.constant(0.010), 0.001),
        updates=30,
    )
    assert gen_bound.sps == pytest.approx(1 / 0.010, rel=0.03)
    # Short episodes ship segments often; `hold` stops the generators at max_staleness versions ahead.
    work = Workload(8, 1, 256, max_staleness=1, stale_policy="hold")
    trainer_bound = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 8, 0),
        work,
        constant_costs(0.010, free, 1.0, episode=8),
        updates=40,
    )
    # The trainer uses what its updates can take; what arrives too stale meanwhile is dropped, as the runtime does.
    assert trainer_bound.used_sps == pytest.approx(256 / 1.0, rel=0.08)
    assert trainer_bound.lag["max"] <= 1


def test_async_drop_keeps_rolling_out_and_drops_what_is_too_stale() -> None:
    work = Workload(8, 1, 256, max_staleness=0, stale_policy="drop")
    pred = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 8, 0),
        work,
        constant_costs(0.010, Curve.constant(0.0), 1.0),
        updates=12,
    )
    assert pred.sps == pytest.approx(800, rel=0.05)
    assert pred.dropped > 0.3
    assert pred.lag["max"] == 0  # used samples only


def test_slow_instances_set_the_pace_of_a_lockstep_group() -> None:
    rows = np.full((4, 8), 0.010)
    rows[3] = 0.030  # the last instance is 3x slower
    costs = Costs(
        step_samples=rows,
        step_rule="max",
        forward_s=Curve.constant(0.0),
        update_s=Curve.constant(0.0),
        publish_s=0,
        install_s=0,
        hop_s=0,
        memory=Memory(1e15),
        episode_len=np.asarray([10**6]),
    )
    pred = simulate(Candidate("sync", "disaggregated", 1, 1, 1, 1, 4, 0), Workload(4, 1, 64), costs)
    assert pred.sps == pytest.approx(4 / 0.030, rel=1e-6)


def test_memory_rejection_names_the_role_and_sizes() -> None:
    mem = Memory(capacity=10 * GiB, train_base=12 * GiB, gen_base=2 * GiB, sim_base=1 * GiB)
    costs = constant_costs(0.01, Curve.constant(0.002), 0.02, memory=mem, on_gpu=True)
    work = Workload(16, 1, 256)
    why = ps.memory_check(Candidate("sync", "disaggregated", 1, 1, 2), work, costs)
    assert why == "trainer needs 12.0 GiB > 10.0 GiB per GPU"
    assert ps.memory_check(Candidate("sync", "disaggregated", 1, 1, 2), work, replace_capacity(costs, 20 * GiB)) == ""


def test_collocated_memory_is_the_larger_phase_when_weights_and_optimizer_offload() -> None:
    # Nothing offloaded: both phases hold every role, 1 + 2 + 12 = 15 GiB.
    mem = Memory(capacity=14 * GiB, train_base=12 * GiB, gen_base=2 * GiB, sim_base=1 * GiB)
    costs = constant_costs(0.01, Curve.constant(0.002), 0.02, memory=mem, on_gpu=True)
    work, cand = Workload(16, 1, 256), Candidate("sync", "collocated", 4, 4, 4)
    assert ps.memory_check(cand, work, costs).startswith("collocated: rollout phase needs 15.0 GiB > 14.0 GiB")
    # Generator weights (2) and optimizer state (8) leave the GPU between phases:
    # rollout 1 + 2 + (12 - 8) = 7, training 1 + 12 + (2 - 2) = 13: the peak is 13, not 15.
    mem.gen_offload, mem.train_offload = 2 * GiB, 8 * GiB
    assert mem.collocated_phases(4, 16, 64) == {"rollout": 7 * GiB, "training": 13 * GiB}
    assert ps.memory_check(cand, work, costs) == ""
    mem.capacity = 12 * GiB
    assert ps.memory_check(cand, work, costs).startswith("collocated: training phase needs 13.0 GiB > 12.0 GiB")


def replace_capacity(costs: Costs, capacity: float) -> Costs:
    costs.memory.capacity = capacity
    return costs


def write_spec(directory: Path, **sections) -> Path:
    data = {
        "name": "placement-test",
        "env": {"type": "synthetic", "num_envs": 8, "step_ms": {"dist": "constant", "mean": 1}},
        "model": {"type": "synthetic", "forward_ms": {"base": 0.5, "per_item": 0.05}},
        "algo": {"type": "synthetic", "update_ms": 2, "steps_per_update": 64},
        "rollout": {"mode": "sync", "total_env_steps": 256, "batching": {"max_batch": 8, "max_wait_ms": 1}},
        "slurm": {"partition": "cpu"},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = directory / "spec with 'odd' name.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_fitting_candidate_is_rejected_with_its_reason_and_choose_says_why(tmp_path: Path) -> None:
    loaded = load_spec(write_spec(tmp_path, resources={"auto": {"modes": ["sync", "async"]}}))
    costs = from_synthetic(loaded.spec, samples=64, capacity=1.0)
    costs.memory.train_base = 2.0
    scored = ps.score_candidates(loaded.spec, costs, units=3)
    assert scored and all(r.rejected for r in scored)
    with pytest.raises(ValueError, match="no placement fits: .*trainer needs"):
        ps.choose(scored)


def test_only_allowed_modes_and_no_async_collocated(tmp_path: Path) -> None:
    loaded = load_spec(write_spec(tmp_path))
    assert {c.mode for c in ps.candidates(loaded.spec, 3, 8)} == {"sync"}
    loaded = load_spec(write_spec(tmp_path, resources={"auto": {"modes": ["async", "pipelined"]}}))
    cands = list(ps.candidates(loaded.spec, 4, 8))
    assert {c.mode for c in cands} == {"async", "pipelined"}
    assert not [c for c in cands if c.mode == "async" and c.layout != "disaggregated"]
    assert {c.depth for c in cands if c.mode == "pipelined"} == {2, 4}
    assert all(8 % c.sim == 0 for c in cands)


def test_chosen_candidate_applies_as_overrides_that_the_spec_accepts(tmp_path: Path) -> None:
    path = write_spec(tmp_path, resources={"placement": "auto", "auto": {"modes": ["sync", "pipelined", "async"]}})
    loaded = load_spec(path)
    costs = from_synthetic(loaded.spec, samples=256)
    best = ps.choose(ps.score_candidates(loaded.spec, costs, units=4, simulate_top=6, tune_top=2, updates=6))
    overrides = ps.apply(loaded, best)
    again = load_spec(path, overrides)
    assert again.spec.resources.placement == "manual"
    assert again.spec.rollout.mode == best.cand.mode
    assert again.spec.rollout.batching.max_batch == best.cand.max_batch
    ranks = build_plan(again).ranks()
    ranks.update(again.spec.runtime.local_ranks)
    assert ranks == {"simulator": best.cand.sim, "generator": best.cand.gen, "trainer": best.cand.train}


def test_another_scale_is_predicted_from_the_same_costs(tmp_path: Path) -> None:
    loaded = load_spec(write_spec(tmp_path, resources={"auto": {"modes": ["sync", "async"]}}))
    costs = from_synthetic(loaded.spec, samples=256)
    work, note = ps.scaled_workload(loaded.spec, 64)
    assert work.num_envs == 176 and work.steps_per_update == round(64 * 64 / 3)  # 3 units -> 64: envs x 21.3
    assert "weak scaling" in note
    scored = ps.score_candidates(loaded.spec, costs, units=64, work=work, simulate_top=4, tune_top=1, updates=4)
    best = ps.choose(scored)
    assert best.cand.units == 64 and best.pred.sps > 0


def test_isotonic_and_speed_classes() -> None:
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    rows = [np.full(10, 1.0), np.full(10, 1.1), np.full(10, 3.0), np.full(10, 3.2)]
    means = speed_classes(rows)
    assert means[0] == means[1] and means[2] == means[3]  # two classes, split where the median jumps
    assert list(means) == pytest.approx([1.05, 1.05, 3.1, 3.1], rel=2e-3)


def test_speed_classes_estimate_a_long_tailed_class_steadier_than_its_mean() -> None:
    # Four fast instances and two 3x slower ones, 250 lognormal (sigma 1) samples each, as a short profile
    # gets: over many draws the estimated slow/fast ratio lands nearer 3 than the ratio of plain means.
    rng = np.random.default_rng(7)
    ours, plain = [], []
    for _ in range(300):
        rows = [rng.lognormal(0.0, 1.0, 250) * (3.0 if i >= 4 else 1.0) for i in range(6)]
        means = speed_classes(rows)
        ours.append(means[5] / means[0])
        plain.append(np.concatenate(rows[4:]).mean() / np.concatenate(rows[:4]).mean())
    rms = [float(np.sqrt(np.mean((np.asarray(r) - 3.0) ** 2))) for r in (ours, plain)]
    assert rms[0] < 0.85 * rms[1]
    assert abs(np.mean(ours) - 3.0) < 0.05


def test_profile_is_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    from vlaslurm.placement import profile as prof

    runs_root = tmp_path / "runs root with spaces"
    loaded = load_spec(write_spec(tmp_path))
    first = prof.profile(loaded, runs_root, local=True, budget_s=2.0)
    path = prof.profile_path(runs_root, first.key)
    jobs = list((runs_root / ".profiles" / "jobs").rglob("*_result.pkl"))
    assert path.is_file() and jobs
    assert first.simulator.batch["8"].mean > 0 and first.generator.forward.sizes[0] == 1
    mtime = path.stat().st_mtime_ns

    def no_job(*args, **kwargs):
        raise AssertionError("a cached profile must not submit a job")

    monkeypatch.setattr(prof, "_executor", no_job)
    second = prof.profile(loaded, runs_root, local=True)
    assert second == first and second.to_dict() == json.loads(path.read_text())
    assert path.stat().st_mtime_ns == mtime
    assert list((runs_root / ".profiles" / "jobs").rglob("*_result.pkl")) == jobs
    # What the numbers depend on changes the key; rollout settings do not.
    other = load_spec(write_spec(tmp_path, model={"forward_ms": {"base": 1.0, "per_item": 0.05}}))
    assert prof.cache_key(other.spec, True, "cpu") != first.key
    same = load_spec(write_spec(tmp_path, rollout={"mode": "async"}))
    assert prof.cache_key(same.spec, True, "cpu") == first.key


def test_gpu_candidates_fill_whole_nodes_without_asking_for_more_gpus(tmp_path: Path) -> None:
    path = write_spec(
        tmp_path,
        env={"num_envs": 24},
        resources={role: {"gpus_per_node": 1} for role in ("simulator", "generator", "trainer")},
    )
    loaded = load_spec(path)
    overrides = ps.apply(loaded, Candidate("sync", "disaggregated", 12, 2, 2), gpus_per_node=8)
    again = load_spec(path, overrides)
    sim = again.spec.resources.simulator
    assert (sim.nodes, sim.gpus_per_node, sim.tasks_per_node) == (2, 6, 6)
    assert build_plan(again).ranks() == {"simulator": 12, "generator": 2, "trainer": 2}


def test_async_per_decision_overhead_has_a_closed_form() -> None:
    # One instance, a batch of one: a decision is step + the simulator's request and bookkeeping work
    # + forward + the generator's work per request, one after another (hops free).
    step, fwd, message, record, serve = 0.004, 0.002, 0.0005, 0.0001, 0.0003
    costs = constant_costs(step, Curve.constant(fwd), 0.0001, message_s=message, record_s=record, request_s=serve)
    pred = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 1, 0), Workload(1, 1, 256, max_staleness=100), costs, updates=20
    )
    assert pred.sps == pytest.approx(1 / (step + message + record + fwd + serve), rel=1e-6)
    bare = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 1, 0),
        Workload(1, 1, 256, max_staleness=100),
        constant_costs(step, Curve.constant(fwd), 0.0001),
        updates=20,
    )
    assert bare.sps == pytest.approx(1 / (step + fwd), rel=1e-6)


def test_generator_pays_its_wake_up_once_per_batch_and_its_request_work_per_request() -> None:
    # Generator-bound async: 8 instances with free steps, batches of 8 (max_wait long enough to fill them).
    # A batch takes forward + wake + 8 x serve; each of its requests brings one env step.
    fwd, wake, serve = 0.004, 0.001, 0.0002
    costs = constant_costs(
        0.0,
        Curve.constant(fwd),
        0.0,
        request_s=serve,
        batch_s=wake,
        cpu=CpuCosts(
            step_s=0.0, forward_s=Curve.constant(fwd), update_s=Curve.constant(0.0), serve_s=serve, wake_s=wake
        ),
    )
    cand = Candidate("async", "disaggregated", 1, 1, 1, 1, 8, 1000.0)
    pred = simulate(cand, Workload(8, 1, 256, max_staleness=100), costs, updates=20)
    assert pred.sps == pytest.approx(8 / (fwd + wake + 8 * serve), rel=0.01)  # not 8 / (fwd + 8 (wake + serve))
    assert pred.cpu["generator"] == pytest.approx(1.0, rel=1e-3)  # all of it is CPU work, back to back
    # The closed form that orders candidates charges the same CPU per env step.
    demand = ps.cpu_demand(cand, Workload(8, 1, 256), costs)["generator"]
    assert demand == pytest.approx((fwd + wake) / 8 + serve)


SYNC8 = Candidate("sync", "disaggregated", 1, 1, 1, 1, 8, 0)


def test_noisy_predictions_are_simulated_longer_and_steady_ones_are_not() -> None:
    work = Workload(8, 1, 256)
    steady = ps.predict(SYNC8, work, constant_costs(0.01, Curve.constant(0.002), 0.001), updates=12)
    assert steady.updates == 12 and steady.spread == pytest.approx(0.0, abs=1e-9)
    # Rare 1-second steps in 8-instance lock-step phases: phase times swing widely from one update to the next.
    rows = np.full((1, 200), 0.005)
    rows[0, ::50] = 1.0
    tail = constant_costs(0.0, Curve.constant(0.002), 0.001)
    tail.step_samples = rows
    noisy = ps.predict(SYNC8, work, tail, updates=12)
    assert noisy.updates > 12
    assert noisy.spread <= ps.TARGET_SPREAD or noisy.updates == 12 * 8


def cpu_costs(host_cores, step_cpu: float = 0.001) -> Costs:
    # sync, 8 instances stepped together in 10 ms (wall), a free forward and update: 800 env steps/s
    # unbounded. CPU per env step: simulator 1 ms, generator 8 ms per batch of 8 = 1 ms.
    return constant_costs(
        0.010,
        Curve.constant(0.0),
        0.0,
        host_cores=host_cores,
        cpu=CpuCosts(step_s=step_cpu, forward_s=Curve.constant(0.008), update_s=Curve.constant(0)),
    )


def cpu_bound_case(host_cores, step_cpu: float = 0.001):
    return simulate(SYNC8, Workload(8, 1, 256), cpu_costs(host_cores, step_cpu))


def test_cpu_bound_binds_when_cores_are_few_and_not_when_many() -> None:
    one = cpu_bound_case(host_cores=1.0)  # all roles on 1 core: 1 / (1 ms + 1 ms) = 500 env steps/s
    assert one.cpu_bound == pytest.approx(500) and one.sps == pytest.approx(500)
    assert one.cpu == pytest.approx({"simulator": 0.5, "generator": 0.5, "trainer": 0.0})
    two = cpu_bound_case(host_cores=2.0)  # bound 1000 > 800: the pipeline's own pace
    assert two.cpu_bound == pytest.approx(1000) and two.sps == pytest.approx(800)
    # On a cluster each role has its own cpus_per_task: 1 core each, 1000 per role, no bound at 800;
    # a simulator that computes 2 ms per step on its one core binds it at 500.
    assert cpu_bound_case(host_cores=None).sps == pytest.approx(800)
    assert cpu_bound_case(host_cores=None, step_cpu=0.002).sps == pytest.approx(500)
    # When the cores bind, the roles are busy for a smaller share of the (longer) wall.
    assert one.util["simulator"] == pytest.approx(two.util["simulator"] * 500 / 800, rel=1e-6)
    # The closed-form estimate that orders candidates before simulating applies the same bound.
    assert ps.estimate(SYNC8, Workload(8, 1, 256), cpu_costs(1.0)) == pytest.approx(500)
    assert ps.estimate(SYNC8, Workload(8, 1, 256), cpu_costs(2.0)) == pytest.approx(800, rel=0.01)


def test_cpu_pools_follow_the_layout() -> None:
    from vlaslurm.placement.simulate import cpu_pools

    work = replace_cpus(Workload(8, 1, 256), (2.0, 4.0, 8.0))
    assert cpu_pools(Candidate("sync", "disaggregated", 2, 1, 1), work, None) == [
        (("simulator",), 4.0),
        (("generator",), 4.0),
        (("trainer",), 8.0),
    ]
    roles = ("simulator", "generator", "trainer")
    assert cpu_pools(Candidate("sync", "collocated", 2, 2, 2), work, None) == [(roles, 16.0)]
    assert cpu_pools(Candidate("async", "disaggregated", 2, 1, 1), work, 2.0) == [(roles, 2.0)]


def replace_cpus(work: Workload, cpus) -> Workload:
    from dataclasses import replace

    return replace(work, cpus=cpus)


def fake_scored(mode: str, sps: float, batch: int, p99: float, spread: float = 0.0, wait_ms: float = 0.0) -> ps.Scored:
    pred = Prediction(sps, sps, {}, {"mean": 0, "p50": 0, "p99": p99, "max": p99}, 0.0, 10, 1.0, spread=spread)
    return ps.Scored(Candidate(mode, "disaggregated", 1, 1, 1, 1, batch, wait_ms), pred)


def test_ties_within_the_model_uncertainty_go_to_the_more_robust_candidate() -> None:
    # Three async variants within 2% of each other tie on Δv, processes and wait: the larger max_batch comes
    # first, though predicted lowest (fewer batches, less per-batch work); a clearly slower sync stays last.
    scored = ps.order(
        [
            fake_scored("async", 759, 4, 1),
            fake_scored("async", 752, 8, 1),
            fake_scored("async", 746, 16, 1),
            fake_scored("sync", 197, 16, 0),
        ]
    )
    assert [(r.cand.mode, r.cand.max_batch) for r in scored] == [
        ("async", 16),
        ("async", 8),
        ("async", 4),
        ("sync", 16),
    ]
    # Within tolerance, fresher data wins; past the tolerance throughput decides.
    assert ps.order([fake_scored("async", 1000, 4, 1), fake_scored("sync", 985, 16, 0)])[0].cand.mode == "sync"
    assert ps.order([fake_scored("async", 1000, 4, 1), fake_scored("sync", 960, 16, 0)])[0].cand.mode == "async"
    # A noisy simulation widens the band: 2 x 8% standard error.
    noisy = [fake_scored("async", 1000, 4, 1, spread=0.08), fake_scored("sync", 900, 16, 0)]
    assert ps.order(noisy)[0].cand.mode == "sync"
    # Among the fresher ones, throughput decides again where it can: sync 900 is 6% above pipelined 850.
    noisy.append(fake_scored("pipelined", 850, 8, 0))
    assert [r.cand.mode for r in ps.order(noisy)] == ["sync", "pipelined", "async"]
    # A batching wait loses a tie, even to a slightly lower prediction; past the band it does not.
    waited = fake_scored("async", 1000, 16, 1, wait_ms=5)
    assert ps.order([waited, fake_scored("async", 995, 16, 1)])[0].cand.max_wait_ms == 0
    assert ps.order([waited, fake_scored("async", 950, 16, 1)])[0].cand.max_wait_ms == 5


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A real profiling job (submitit's local executor) of the small synthetic spec."""
    from vlaslurm.placement import profile as prof

    root = tmp_path_factory.mktemp("measured")
    loaded = load_spec(write_spec(root))
    return loaded, root / "runs", prof.profile(loaded, root / "runs", local=True, budget_s=2.0)


def test_profile_measures_cpu_seconds_and_the_runtime_overhead(measured) -> None:
    loaded, _, typed = measured
    profile = typed.to_dict()
    over = profile["overhead"]
    assert set(over) == {
        "sim_request_cpu_s",
        "sim_reply_cpu_s",
        "record_cpu_s",
        "gen_serve_cpu_s",
        "gen_wake_cpu_s",
        "segment_cpu_s",
    }
    assert all(v > 0 for k, v in over.items() if k != "gen_wake_cpu_s") and over["gen_wake_cpu_s"] >= 0
    # The generator's per-request share comes from bursts of requests drained in one wake-up; what a lone
    # request cost beyond it is the wake-up, charged once per batch.
    transport = profile["transport"]
    assert transport["burst"] > 1 and transport["server_burst_cpu_s"] > 0
    assert over["gen_wake_cpu_s"] == pytest.approx(
        max(0.0, transport["server_cpu_s"] - transport["server_burst_cpu_s"])
    )
    forward = profile["generator"]["forward"]
    assert len(forward["cpu_seconds"]) == len(forward["cpu_wait_mean_s"]) == len(forward["sizes"])
    costs = from_profile(typed, loaded.spec)
    assert costs.cpu is not None and costs.host_cores == profile["cpu_count"]
    # The per-decision work is charged as the roles' own work, and not again inside the hop.
    assert costs.message_s == over["sim_request_cpu_s"] and costs.request_s == over["gen_serve_cpu_s"]
    assert costs.batch_s == costs.cpu.wake_s == over["gen_wake_cpu_s"]
    # Against the same series (the round trip right after the last one): two series differ beside other load.
    assert costs.hop_s < transport["idle_round_trip_s"][0] / 2
    pred = simulate(
        Candidate("async", "disaggregated", 1, 1, 1, 1, 8, 0), Workload.from_spec(loaded.spec), costs, updates=6
    )
    assert pred.cpu_bound < math.inf and set(pred.cpu) == {"simulator", "generator", "trainer"}
    # Round trips after idle gaps give the wake-up curve (never shorter after a longer sleep, flat past the
    # longest gap); the client's CPU splits into sending and receiving, and receiving plus decoding is what
    # each reply costs the simulator's main thread before its step.
    gaps = transport["idle_s"]
    assert gaps[0] == 0.0 and len(transport["idle_round_trip_s"]) == len(gaps) > 3
    waits = [costs.wake_after_s(g) for g in gaps]
    assert waits == sorted(waits) and costs.wake_after_s(10.0) == waits[-1]
    # The curve is the measurements' isotonic fit: its plateau lies between the last gap's extra latency and the
    # largest one (equal to the largest only when no shorter gap measured more, which load breaks: 4.5 ms fitted
    # against 5.6 ms measured beside two busy loops).
    rtts = transport["idle_round_trip_s"]
    assert max(0.0, rtts[-1] - rtts[0]) - 1e-9 <= waits[-1] <= max(0.0, max(rtts) - rtts[0]) + 1e-9
    assert transport["client_cpu_s"] == pytest.approx(transport["client_send_cpu_s"] + transport["client_recv_cpu_s"])
    assert costs.reply_s == over["sim_reply_cpu_s"]
    assert transport["client_recv_cpu_s"] < costs.reply_s <= costs.message_s


def test_an_old_profile_is_not_reused_and_is_refused_when_read(measured, monkeypatch) -> None:
    from vlaslurm.placement import profile as prof
    from vlaslurm.placement.profile_types import Profile, StaleProfile

    loaded, runs_root, profile = measured
    old = profile.to_dict()
    del old["overhead"]
    old["version"] = 3
    # Saved under the version 3 key, it is not found: the version is part of the key, so it is re-profiled.
    monkeypatch.setattr(prof, "PROFILE_VERSION", 3)
    old_key = prof.cache_key(loaded.spec, True, "cpu")
    monkeypatch.undo()
    assert old_key != profile.key
    prof.profile_path(runs_root, old_key).write_text(json.dumps(old))
    assert prof.cached_profile(loaded, runs_root, local=True) == profile
    # Read directly, it is refused (no fallbacks to what older versions did not measure).
    with pytest.raises(StaleProfile, match=f"is version 3, this vlaslurm reads version {prof.PROFILE_VERSION}"):
        Profile.from_dict(old)
    assert prof.read_profile(prof.profile_path(runs_root, old_key)) is None  # a cache miss


def test_profile_wall_times_leave_out_waiting_for_a_cpu_that_other_work_held(monkeypatch) -> None:
    from vlaslurm.placement import profile as prof

    # 300 ms of wall, of which the thread waited 200 ms runnable (a busy host): 100 ms is the role's cost.
    monkeypatch.setattr(prof, "_clock", lambda: (10.3, 1.1, 0.7))
    assert prof._since((10.0, 1.0, 0.5)) == pytest.approx((0.1, 0.1, 0.2))
    monkeypatch.undo()
    assert prof._runqueue_wait() >= 0.0  # readable here (Linux); 0 where schedstat is missing


AUTO_SPEC = {
    "name": "auto-e2e",
    "env": {"type": "synthetic", "num_envs": 8},
    "model": {"type": "synthetic"},
    "algo": {"type": "synthetic", "steps_per_update": 64},
    "rollout": {"mode": "sync", "total_env_steps": 640},
    "resources": {"placement": "auto", "auto": {"modes": ["sync", "async"]}},
    "slurm": {"partition": "cpu", "time": "00:05:00"},
    "runtime": {"first_meeting_timeout_s": 60},
}


@pytest.mark.slurm
@pytest.mark.slow
def test_submit_with_auto_placement_profiles_on_the_cluster_and_runs_the_choice(local_slurm, tmp_path: Path) -> None:
    # `submit` on a `placement: auto` spec: the profiling job goes through submitit's Slurm executor to the
    # run's partition, the model chooses, and the hetjob runs the choice to completion.
    from slurm_helpers import submit, wait_done

    from vlaslurm.placement.choose import auto_overrides

    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(AUTO_SPEC))
    root = tmp_path / "runs"
    job = submit(root, str(path))
    assert wait_done(job) == 0
    profiles = list((root / ".profiles").glob("*.json"))
    assert len(profiles) == 1
    prof = json.loads(profiles[0].read_text())
    assert prof["local"] is False and set(prof["partitions"].values()) == {"cpu"}
    jobs = sorted((root / ".profiles" / "jobs").rglob("*_submitted.pkl"))
    # Choosing again reads the cached profile (no second job) and gives what the run was given.
    again = load_spec(path, auto_overrides(load_spec(path, site="local"), root), site="local").spec
    assert sorted((root / ".profiles" / "jobs").rglob("*_submitted.pkl")) == jobs
    ran = load_spec(job.run_dir / "spec.yaml", site="local").spec
    assert ran.resources.placement == again.resources.placement == "manual"
    assert (ran.rollout.mode, ran.rollout.batching, ran.rollout.pipeline_depth) == (
        again.rollout.mode,
        again.rollout.batching,
        again.rollout.pipeline_depth,
    )
