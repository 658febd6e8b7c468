"""Search placements: enumerate candidates, reject those that do not fit memory, simulate, score.

A candidate splits `units` (GPUs; ranks of a CPU-only spec) between the roles in a mode and a
layout (disaggregated, hybrid, collocated). `score_candidates` orders them by a closed-form
estimate, simulates the best and re-simulates the best few with other batching; candidates within
the model's uncertainty of the best are ordered by robustness (`most_robust`).
Details: docs/placement.md
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from vlaslurm.placement.costs import Costs
from vlaslurm.placement.simulate import Candidate, Prediction, Workload, cpu_bound, cpu_pools, simulate
from vlaslurm.runtime.schedule import Pipelined, Schedule
from vlaslurm.spec.schema import Mode

GiB = 2.0**30
LOCKSTEP_LAYOUTS = ("disaggregated", "hybrid", "collocated")
# Relative difference below which two predictions are a tie (why this value: docs/placement.md).
TOLERANCE = 0.02


@dataclass
class Scored:
    """A candidate with its prediction, or with the reason it was rejected."""

    cand: Candidate
    pred: Optional[Prediction] = None
    rejected: str = ""

    @property
    def score(self) -> float:
        return self.pred.used_sps if self.pred else -1.0


def allowed_modes(spec) -> List[Mode]:
    return list(spec.resources.auto.modes) or [spec.rollout.mode]


def splits(total: int, parts: int, step: int = 1) -> Iterator[Tuple[int, ...]]:
    """Ways to write `total` as `parts` positive multiples of `step`."""
    if parts == 1:
        if total > 0 and total % step == 0:
            yield (total,)
        return
    for first in range(step, total - step * (parts - 1) + 1, step):
        for rest in splits(total - first, parts - 1, step):
            yield (first, *rest)


def candidates(spec, units: int, num_envs: int, step: int = 1) -> Iterator[Candidate]:
    """Every structural candidate with the spec's batching (simulator ranks must divide the envs)."""
    b = spec.rollout.batching
    on_gpu = any(spec.role_resources(r).gpus_per_node for r in ("simulator", "generator", "trainer"))
    for mode in allowed_modes(spec):
        depths = (2, 4) if Schedule.kind(mode) is Pipelined else (1,)
        layouts: Tuple[str, ...] = LOCKSTEP_LAYOUTS if Schedule.kind(mode).lockstep else ("disaggregated",)
        if not on_gpu:  # hybrid's trainer takes one rank per GPU of the others: no GPUs, no hybrid
            layouts = tuple(x for x in layouts if x != "hybrid")
        for layout in layouts:
            shapes: List[Tuple[int, ...]]
            if layout == "collocated":
                shapes = [(units, units, units)]
            elif layout == "hybrid":
                shapes = [(s, g, units) for s, g in splits(units, 2, step)]
            else:
                shapes = list(splits(units, 3, step))
            for s, g, t in shapes:
                if num_envs % s:
                    continue
                for k in depths:
                    if num_envs // s < k:
                        continue
                    yield Candidate(mode, layout, s, g, t, k, b.max_batch, b.max_wait_ms)


def memory_check(cand: Candidate, work: Workload, costs: Costs) -> str:
    """Why `cand` does not fit in one unit's memory ('' when it fits)."""
    m = costs.memory
    envs = work.num_envs / cand.sim
    sim, gen = m.sim(envs), m.gen(min(cand.max_batch, work.num_envs))
    steps = work.steps_per_update / cand.train
    train = m.train(steps, cand.train)
    detail = f" ({m.trainer_at(cand.train, steps).describe()})" if m.trainer_at else ""
    cap = m.capacity
    where = "GPU" if costs.on_gpu else "host"

    def gib(x: float) -> str:
        return f"{x / GiB:.1f}"

    if cand.layout == "collocated":
        phases = m.collocated_phases(envs, min(cand.max_batch, work.num_envs), work.steps_per_update / cand.train)
        phase, need = max(phases.items(), key=lambda kv: kv[1])
        if need > cap:
            return (
                f"collocated: {phase} phase needs {gib(need)} GiB > {gib(cap)} GiB per {where} (simulator "
                f"{gib(sim)} GiB for {envs:g} envs, generator {gib(gen)}, trainer {gib(train)}; generator "
                f"weights {gib(m.gen_offload)} and trainer state {gib(m.train_offload)} GiB offloaded between "
                f"phases)"
            )
    elif cand.layout == "hybrid":
        need = max(sim, gen) + train
        if need > cap:
            return (
                f"hybrid: max(simulator {gib(sim)}, generator {gib(gen)}) + trainer {gib(train)} GiB = "
                f"{gib(need)} GiB > {gib(cap)} GiB per {where}{detail}"
            )
    else:
        for role, need in (("simulator", sim), ("generator", gen), ("trainer", train)):
            if need > cap:
                return f"{role} needs {gib(need)} GiB > {gib(cap)} GiB per {where}{detail if role == 'trainer' else ''}"
    return ""


def estimate(cand: Candidate, work: Workload, costs: Costs) -> float:
    """A quick closed-form throughput estimate (env steps/s) to order candidates before simulating."""
    return min(
        _pipeline_estimate(cand, work, costs),
        cpu_bound(cpu_demand(cand, work, costs), cpu_pools(cand, work, costs.host_cores)),
    )


def cpu_demand(cand: Candidate, work: Workload, costs: Costs) -> Dict[str, float]:
    """Closed-form CPU seconds per env step of each role ({} when the profile has no CPU side)."""
    cpu = costs.cpu
    if cpu is None:
        return {}
    C = work.chunk
    sched = work.schedule(cand)
    n = max(1, work.num_envs // cand.sim // sched.depth) if sched.lockstep else 1  # instances per request
    items = n * max(1, cand.sim // cand.gen) if sched.lockstep else n
    b = max(1, min(cand.max_batch, items if sched.lockstep else work.num_envs // cand.gen))
    spu = work.steps_per_update
    return {
        "simulator": cpu.step_s + (cpu.request_s / n + cpu.record_s) / C,
        "generator": (cpu.forward_s(b) + cpu.wake_s) / (b * C) + cpu.serve_s / (n * C),
        "trainer": cpu.update_s(spu / cand.train) * cand.train / spu,
    }


def _pipeline_estimate(cand: Candidate, work: Workload, costs: Costs) -> float:
    C = work.chunk
    per = work.num_envs // cand.sim
    ids = costs.instance_map(per)
    train = costs.train_s(work.steps_per_update, cand.train) + costs.publish_s + costs.install_s
    sched = work.schedule(cand)
    if not sched.lockstep:
        b = max(1, min(cand.max_batch, work.num_envs // cand.gen))
        # Each step waits at least a forward for its actions, so its thread wakes from a sleep that long
        # (the rank's main thread, shared by its instances, is left to the simulation).
        means = costs.step_samples.mean(axis=1)[ids] * C + costs.dispatch_s + costs.wake_after_s(costs.forward_s(b))
        sim_cap = cand.sim * (float(np.sum(C / means)) if costs.thread_safe else C * per / float(means.sum()))
        if costs.device_s_per_env > 0:  # a rank's device steps one instance at a time
            sim_cap = min(sim_cap, cand.sim / costs.device_s_per_env)
        gen_cap = cand.gen * b * C / (costs.forward_s(b) + cand.max_wait_ms / 2000.0)
        return min(sim_cap, gen_cap, work.steps_per_update / train)
    k = sched.depth
    group = [ids[g] for g in sched.sub_groups(per)]
    steps = [costs.mean_group_step(g, draws=16) * C for g in group]
    step = max(steps) if costs.thread_safe else sum(steps)  # sub-groups side by side, or taking turns
    items = per * max(1, cand.sim // cand.gen) / k
    fwd = k * costs.forward_s(items)
    # Each round the generator wakes from sleeping through the steps, the stepping thread from the forwards
    # (pipelined: only through what the other sub-groups' work does not fill), and before it the main
    # thread that receives the actions where that is separate work (stepping in threads, `reply_s`).
    if k == 1:
        cycle, gen_sleep, thread_sleep = step + fwd, step, fwd
    else:
        gen_sleep, thread_sleep = max(0.0, step - fwd), max(0.0, fwd - step)
        # Side by side each sub-group still waits for its own forward; taking turns on one thread, the
        # others' forwards can hide behind its steps.
        # A shared device steps the sub-groups' device parts one after another, whatever the threads.
        device = costs.device_s_per_env * per * C
        cycle = max(step + fwd / k, fwd, device) if costs.thread_safe else max(step, fwd)
    wakes = 2 if costs.thread_safe and costs.reply_s > 0 else 1
    cycle += 2 * costs.hop_s + costs.wake_after_s(gen_sleep) + wakes * costs.wake_after_s(thread_sleep)
    decisions = work.chunks_per_phase(cand)
    swap = costs.swap_s if cand.layout == "collocated" else 0.0
    return work.num_envs * C * decisions / (decisions * cycle + train + swap)


def batching_options(cand: Candidate, work: Workload) -> List[Tuple[int, float]]:
    """Batching to try on a good structural candidate."""
    per_gen = max(1, work.num_envs // cand.gen)
    if not work.schedule(cand).lockstep:
        sizes = sorted({max(1, per_gen // d) for d in (1, 2, 4)} | {cand.max_batch})
        waits = sorted({0.0, 2.0, cand.max_wait_ms})
    else:  # lock-step: a full request set never waits when max_batch is what arrives together
        sizes = sorted({max(1, per_gen // cand.depth), per_gen, cand.max_batch})
        waits = sorted({0.0, cand.max_wait_ms})
    return [(b, w) for b in sizes for w in waits]


def score_candidates(
    spec,
    costs: Costs,
    units: Optional[int] = None,
    work: Optional[Workload] = None,
    simulate_top: int = 16,
    tune_top: int = 4,
    updates: int = 24,
) -> List[Scored]:
    """Every candidate for `units`, best first; rejected ones last with their reasons."""
    work = work or Workload.from_spec(spec)
    units = units or default_units(spec)
    step = unit_step(units)
    if units > 16:  # big pipelines: fewer, shorter simulations (events grow with the envs)
        simulate_top, tune_top, updates = min(simulate_top, 6), min(tune_top, 1), min(updates, 4)
    pool, rejected = [], []
    for cand in candidates(spec, units, work.num_envs, step):
        why = memory_check(cand, work, costs)
        (rejected.append(Scored(cand, rejected=why)) if why else pool.append(cand))
    pool.sort(key=lambda c: -estimate(c, work, costs))
    done: Dict[Candidate, Scored] = {}
    for cand in pool[:simulate_top]:
        done[cand] = Scored(cand, predict(cand, work, costs, updates))
    best = sorted(done.values(), key=lambda r: -r.score)[:tune_top]
    for r in best:
        for b, w in batching_options(r.cand, work):
            cand = replace(r.cand, max_batch=b, max_wait_ms=w)
            if cand not in done and not memory_check(cand, work, costs):
                done[cand] = Scored(cand, predict(cand, work, costs, updates))
    return order(list(done.values())) + rejected


TARGET_SPREAD = 0.01  # relative standard error of a prediction worth simulating longer for (ties: 2x it)


def predict(cand: Candidate, work: Workload, costs: Costs, updates: int, longest: int = 8) -> Prediction:
    """Simulate `updates` updates, and up to `longest` times as many while the throughput's standard error
    stays above TARGET_SPREAD: lock-step phases gated by a long-tailed slowest group vary most from one
    short run to the next, steady async pipelines hardly at all, so only the former pay for the length."""
    pred = simulate(cand, work, costs, updates=updates)
    n = updates
    while pred.spread > TARGET_SPREAD and n < updates * longest:
        n = min(2 * n, updates * longest)
        pred = simulate(cand, work, costs, updates=n)
    return pred


def order(scored: List[Scored]) -> List[Scored]:
    """Best first: repeatedly the most robust of the candidates still left (`most_robust`)."""
    left = sorted(scored, key=lambda r: -r.score)
    out = []
    while left:
        out.append(most_robust(left))
        left.remove(out[-1])
    return out


# What makes a run less exposed to what the model does not see, most important first (why each, and the
# validation behind the order: docs/placement.md).
# Each criterion: what `plan` calls it, and the key whose least value is most robust.
ROBUSTNESS = (
    ("lower Δv p99", lambda r: r.pred.lag["p99"]),
    ("fewer processes", lambda r: r.cand.sim + r.cand.gen + r.cand.train),
    ("shorter max_wait", lambda r: r.cand.max_wait_ms),
    ("larger max_batch", lambda r: -r.cand.max_batch),
)


def most_robust(scored: Sequence[Scored]) -> Scored:
    """The candidate to run among `scored`: for each ROBUSTNESS criterion in turn, keep those predicted
    within the uncertainty of the best kept so far (`TOLERANCE`, or twice its simulation's standard error)
    and, of them, those best on the criterion; then the highest prediction. So throughput decides
    wherever the model can tell candidates apart, robustness where it cannot."""
    pool = list(scored)
    for _, criterion in ROBUSTNESS:
        top = max(pool, key=lambda r: r.score)
        assert top.pred is not None  # only predicted candidates are ordered (score_candidates)
        tol = max(TOLERANCE, 2 * top.pred.spread)
        pool = [r for r in pool if r.score >= top.score * (1 - tol)]
        least = min(criterion(r) for r in pool)
        pool = [r for r in pool if criterion(r) == least]
    return max(pool, key=lambda r: r.score)


def choose(scored: Sequence[Scored]) -> Scored:
    """The best candidate that fits; raise ValueError naming why each was rejected if none does."""
    fitting = [r for r in scored if r.pred is not None]
    if not fitting:
        reasons = sorted({r.rejected for r in scored})
        raise ValueError("no placement fits: " + "; ".join(reasons[:5]))
    return fitting[0]


def default_units(spec) -> int:
    """The spec's own budget: its GPUs, or its ranks on a CPU-only spec."""
    res = [spec.role_resources(r) for r in ("simulator", "generator", "trainer")]
    gpus = sum(r.nodes * r.gpus_per_node for r in res)
    if spec.resources.layout == "collocated":
        gpus = res[0].nodes * res[0].gpus_per_node
    if gpus:
        return gpus
    ranks = dict(spec.runtime.local_ranks) or {}
    return sum(ranks.get(r, x.nodes * x.tasks_per_node) for r, x in zip(("simulator", "generator", "trainer"), res))


def unit_step(units: int) -> int:
    """Granularity of splits: every unit up to 16, then whole nodes of 8, coarser past 128."""
    if units <= 16:
        return 1
    return 8 if units <= 128 else 16


def scaled_workload(spec, units: int) -> Tuple[Workload, str]:
    """At another scale, envs and batch grow with the units (weak scaling); the note says so."""
    work = Workload.from_spec(spec)
    base = default_units(spec)
    if units == base:
        return work, ""
    factor = units / base
    envs = max(16, 16 * int(round(work.num_envs * factor / 16)))  # a multiple of 16: many rank counts divide it
    spu = max(1, int(round(work.steps_per_update * factor)))
    note = (
        f"scaled from {base} to {units} units: env.num_envs {work.num_envs} -> {envs}, "
        f"algo.steps_per_update {work.steps_per_update} -> {spu} (weak scaling)"
    )
    return replace(work, num_envs=envs, steps_per_update=spu), note


def apply(loaded, scored_or_cand, gpus_per_node: int = 8) -> List[str]:
    """The `key=value` overrides that make the spec run `candidate` (and stop asking for auto placement)."""
    cand = scored_or_cand.cand if isinstance(scored_or_cand, Scored) else scored_or_cand
    spec = loaded.spec
    on_gpu = any(spec.role_resources(r).gpus_per_node for r in ("simulator", "generator", "trainer"))
    out = [
        f"rollout.mode={cand.mode}",
        f"rollout.pipeline_depth={cand.depth}",
        f"rollout.batching.max_batch={cand.max_batch}",
        f"rollout.batching.max_wait_ms={cand.max_wait_ms:g}",
        f"resources.layout={cand.layout}",
        "resources.placement=manual",
    ]
    for role, units in (("simulator", cand.sim), ("generator", cand.gen), ("trainer", cand.train)):
        if on_gpu:
            per_node = max(d for d in range(1, min(units, gpus_per_node) + 1) if units % d == 0)
            nodes = units // per_node  # e.g. 12 GPUs on 8-GPU nodes: 2 nodes of 6
            out += [
                f"resources.{role}.nodes={nodes}",
                f"resources.{role}.gpus_per_node={per_node}",
                f"resources.{role}.tasks_per_node={per_node}",
            ]
        else:
            out += [
                f"resources.{role}.nodes=1",
                f"resources.{role}.gpus_per_node=0",
                f"resources.{role}.tasks_per_node={units}",
            ]
    if not on_gpu or spec.runtime.local_ranks:  # local runs start exactly these ranks
        out.append(f"runtime.local_ranks={{simulator: {cand.sim}, generator: {cand.gen}, trainer: {cand.train}}}")
    return out
