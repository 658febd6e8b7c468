"""What each role costs: the numbers that drive the placement model.

A `Costs` comes from a measured profile (`from_profile`) or, for the synthetic
workload, straight from its config (`from_synthetic`). Times are seconds,
memory bytes. Step times are kept as samples, not means: the long tail of the
slowest environment in a lock-step group is what sync mode pays for.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from vlaslurm.placement.profile_types import Profile, TransportProfile
    from vlaslurm.placement.trainer_memory import TrainerBytes

STEP_RULES = ("max", "sum", "batch")


@dataclass
class Curve:
    """A piecewise-linear function of a size (batch items, env steps), extrapolated from its last two points."""

    sizes: List[float]
    values: List[float]
    flat: bool = False  # past the measured sizes, the nearest measured value instead of the trend

    def __call__(self, size: float) -> float:
        # bisect on the lists, not numpy: the simulation asks ~10^6 times per placement search
        xs, ys = self.sizes, self.values
        if len(xs) == 1:
            return ys[0]
        if self.flat:  # np.interp's values: the ends past the sizes, a measured size's own value
            if size <= xs[0]:
                return ys[0]
            if size >= xs[-1]:
                return ys[-1]
            i = bisect.bisect_right(xs, size) - 1
            return ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (size - xs[i])
        i = min(max(bisect.bisect_left(xs, size) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, ys[i] + slope * (size - xs[i]))

    def __post_init__(self) -> None:
        merged: Dict[float, List[float]] = {}
        for x, y in zip(self.sizes, self.values):
            merged.setdefault(float(x), []).append(float(y))
        self.sizes = sorted(merged)
        self.values = [min(merged[x]) for x in self.sizes]  # one size measured twice: its quicker run

    @classmethod
    def constant(cls, value: float) -> Curve:
        return cls([1.0], [value])

    @classmethod
    def linear(cls, base: float, per: float) -> Curve:
        return cls([0.0, 1.0], [base, base + per])


@dataclass
class Memory:
    """Peak memory of each role, linear in what it holds; `capacity` is one GPU's (or the host's)."""

    capacity: float
    sim_base: float = 0.0
    sim_per_env: float = 0.0
    gen_base: float = 0.0
    gen_per_item: float = 0.0
    train_base: float = 0.0
    train_per_step: float = 0.0
    gen_offload: float = 0.0  # collocated: bytes of the generator that leave the GPU while the trainer trains
    train_offload: float = 0.0  # collocated: bytes of the trainer (model, grads, optimizer) off it during rollout
    # (trainer ranks, env steps per rank) -> one rank's bytes by what takes them (placement/trainer_memory.py), in
    # place of train_base/train_per_step where the model's shape is known (fsdp's shards, micro-batches).
    trainer_at: Optional[Callable[[int, float], TrainerBytes]] = None

    def sim(self, envs: float) -> float:
        return self.sim_base + self.sim_per_env * envs

    def gen(self, batch: float) -> float:
        return self.gen_base + self.gen_per_item * batch

    def train(self, steps: float, ranks: int = 1) -> float:
        if self.trainer_at is not None:
            return self.trainer_at(ranks, steps).total
        return self.train_base + self.train_per_step * steps

    def collocated_phases(self, envs: float, batch: float, steps: float) -> Dict[str, float]:
        """Peak of each phase on a collocated unit: generator weights and trainer optimizer state leave the
        GPU between phases, so the peak is the larger phase, not the sum of every role's peak."""
        sim = self.sim(envs)
        return {
            "rollout": sim + self.gen(batch) + max(0.0, self.train_base - self.train_offload),
            "training": sim + self.train(steps) + max(0.0, self.gen_base - self.gen_offload),
        }


@dataclass
class CpuCosts:
    """CPU seconds (not wall) of each role's work, measured beside the wall times.

    Wall times drive the event simulation; these bound it: roles that share cores
    cannot use more CPU seconds per second than there are cores. A simulator that
    sleeps or waits on a device costs wall time but little CPU; the runtime's own
    Python work per decision (signing, sockets, bookkeeping) is nearly all CPU.
    """

    step_s: float  # one action step of one instance
    forward_s: Curve  # generator forward of a batch of n requests (incl. batch assembly)
    update_s: Curve  # trainer collate + update of n env steps on one rank
    request_s: float = 0.0  # simulator main thread, per request: encode, send, receive, decode (real sockets)
    record_s: float = 0.0  # simulator main thread, per instance and decision: segment bookkeeping
    serve_s: float = 0.0  # generator, per request: receive, decode, encode and send its reply
    wake_s: float = 0.0  # generator, per batch: waking from its poll for the batch's requests
    segment_s: float = 0.0  # trainer, per segment received: receive and decode it


@dataclass
class Costs:
    """Everything the simulation draws from."""

    step_samples: np.ndarray  # [instances, samples]: one action step of each instance of a reference rank, alone
    step_rule: str  # a vectorised step of several instances costs the max or the sum of theirs, or `batch`
    forward_s: Curve  # generator forward of a batch of n requests
    update_s: Curve  # collate + update of a batch of n env steps on one trainer rank
    publish_s: float  # trainer side of one weight publication
    install_s: float  # generator side of it
    hop_s: float  # one message between two roles, one way
    memory: Memory
    batch_samples: Dict[int, np.ndarray] = field(default_factory=dict)  # vectorised step of n instances
    # Of a call's step, seconds per instance it steps on the rank's one shared device (a GPU simulator): calls
    # from different threads queue for that part. `batch_samples` include it; `step_samples` do not (the
    # instance's own parallel part; group_step adds it).
    device_s_per_env: float = 0.0
    thread_safe: bool = True  # a rank steps its instances (async) or sub-groups (pipelined) from threads at once
    reset_s: float = 0.0
    dispatch_s: float = 0.0  # async: handing a step to a thread and its result back to the rank's main loop
    message_s: float = 0.0  # simulator main thread, per request: observation out, actions in
    reply_s: float = 0.0  # of message_s, the part each reply costs before its step can start (receive, decode)
    # Waking a thread that has slept for t seconds (the function's argument) costs this much latency on top
    # of a hop: a request wakes its generator, a reply the simulator thread that steps its instances.
    wake_after_s: Curve = field(default_factory=lambda: Curve.constant(0.0))
    record_s: float = 0.0  # simulator main thread, per instance and decision: segment bookkeeping
    request_s: float = 0.0  # generator, per request: decode it, encode the reply
    # generator, per batch: its loop's fixed work, waking for the batch's requests (weights are looked for
    # when the trainer announces them, not with a store round trip per batch)
    batch_s: float = 0.0
    episode_len: np.ndarray = field(default_factory=lambda: np.asarray([100]))  # samples, env steps
    allreduce_bytes_per_s: float = 10e9  # gradient all-reduce bandwidth between trainer ranks
    param_bytes: float = 0.0
    swap_s: float = 0.0  # collocated: offload + onload at each rollout/training boundary (runtime/offload.py)
    sim_on_gpu: bool = False
    on_gpu: bool = False
    gpu_name: str = "cpu"
    cpu: Optional[CpuCosts] = None  # CPU seconds of the same work; None: not measured (no CPU bound)
    host_cores: Optional[float] = None  # measured locally: every role shares this host's cores

    def __post_init__(self) -> None:
        if self.step_rule not in STEP_RULES:
            raise ValueError(f"step_rule must be one of {', '.join(STEP_RULES)}, not {self.step_rule!r}")
        self.step_samples = np.atleast_2d(np.asarray(self.step_samples, float))
        # `_batch_draw`'s lookups, sorted once (numpy's quantile sorted them on every draw)
        self._batch_sizes = sorted(self.batch_samples)
        self._batch_sorted = {n: np.sort(np.asarray(v, float)).tolist() for n, v in self.batch_samples.items()}

    def instance_map(self, envs: int) -> np.ndarray:
        """Which reference instance models each of a rank's `envs` instances (keeps the slow ones' share)."""
        ref = self.step_samples.shape[0]
        return np.minimum(ref - 1, (np.arange(envs) * ref) // max(1, envs))

    def group_step(self, rng: np.random.Generator, profile_ids: np.ndarray) -> float:
        """One action step of the instances `profile_ids`, stepped together in one call (its device part
        included)."""
        n = len(profile_ids)
        if n == 0:
            return 0.0
        if self.step_rule == "batch":
            return self._batch_draw(rng, n)
        device = self.device_s_per_env * n
        if n == 1:  # the common async case, without numpy's per-call overhead
            row = self.step_samples[int(profile_ids[0])]
            return float(row[int(rng.random() * len(row))]) + device
        draws = self.step_samples[profile_ids, rng.integers(0, self.step_samples.shape[1], n)]
        return float(draws.max() if self.step_rule == "max" else draws.sum()) + device

    def _batch_draw(self, rng: np.random.Generator, n: int) -> float:
        sizes = self._batch_sizes
        u = rng.random()
        below, above = bisect.bisect_right(sizes, n), bisect.bisect_left(sizes, n)
        lo = sizes[below - 1] if below else sizes[0]  # the largest measured size <= n (else the smallest)
        hi = sizes[above] if above < len(sizes) else sizes[-1]  # the smallest >= n (else the largest)
        q_lo = quantile_of_sorted(self._batch_sorted[lo], u)
        if hi == lo:
            return q_lo * (n / lo if n > lo else 1.0)  # past the largest measured size: linear in n
        q_hi = quantile_of_sorted(self._batch_sorted[hi], u)
        return q_lo + (q_hi - q_lo) * (n - lo) / (hi - lo)

    def mean_group_step(self, profile_ids: np.ndarray, draws: int = 64, seed: int = 0) -> float:
        rng = np.random.default_rng(seed)
        return float(np.mean([self.group_step(rng, profile_ids) for _ in range(draws)]))

    def train_s(self, steps: float, ranks: int) -> float:
        """One update of `steps` env steps over `ranks` data-parallel trainer ranks (ring all-reduce)."""
        allreduce = 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * self.param_bytes / self.allreduce_bytes_per_s
        return self.update_s(steps / ranks) + allreduce


def quantile_of_sorted(values: Sequence[float], q: float) -> float:
    """`np.quantile(values, q)` (its default, linear method; the same floats) of `values` already sorted, in
    ~1 us instead of numpy's ~60 us per call."""
    position = (len(values) - 1) * q
    if position >= len(values) - 1:
        return float(values[-1])
    i = math.floor(position)
    a, b, t = values[i], values[i + 1], position - i
    return float(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)


def lognormal_samples(mean: float, sigma: float, n: int, rng: np.random.Generator) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return rng.lognormal(mu, sigma, n)


def from_synthetic(spec, samples: int = 4000, hop_s: float = 0.0, capacity: float = 80 * 2**30) -> Costs:
    """The costs a synthetic spec (env, model and algo all `synthetic`) asks for, without measuring."""
    from vlaslurm.envs.synthetic import sample_ms

    env, model, algo = spec.env, spec.model, spec.algo
    rng = np.random.default_rng(0)
    ref = max(1, env.num_envs)
    slow = int(round(env.slow_fraction * ref))
    factor = np.ones(ref)
    factor[ref - slow :] = env.slow_factor
    base = np.asarray([sample_ms(env.step_ms, rng) for _ in range(samples)]) / 1000.0
    rows = np.stack([rng.permutation(base) * f for f in factor])
    episode = min(env.episode_steps, env.max_episode_steps)
    params = model.num_params * 4.0
    return Costs(
        step_samples=rows,
        step_rule="max",
        forward_s=Curve.linear(model.forward_ms.base / 1000.0, model.forward_ms.per_item / 1000.0),
        update_s=Curve.constant(algo.update_ms / 1000.0),
        publish_s=0.0,
        install_s=0.0,
        hop_s=hop_s,
        memory=Memory(capacity=capacity),
        episode_len=np.asarray([episode]),
        param_bytes=params,
        device_s_per_env=env.step_ms.per_env / 1000.0,
    )


def summarize(samples: Sequence[float]) -> Dict[str, float]:
    """Mean and quantiles, for tables and profiles."""
    a = np.asarray(samples, float)
    return {
        "mean": float(a.mean()),
        "p50": float(np.quantile(a, 0.5)),
        "p90": float(np.quantile(a, 0.9)),
        "p99": float(np.quantile(a, 0.99)),
        "max": float(a.max()),
        "n": int(a.size),
    }


def speed_classes(rows: List[np.ndarray], ratio: float = 1.5) -> np.ndarray:
    """Each instance's mean, shared within its speed class.

    A few samples estimate one instance's mean poorly (a lognormal tail), but its
    median well: instances are sorted by median and split where the median jumps by
    more than `ratio`. Classes are taken to share one shape, differing by a scale: each
    class's scale is the geometric mean of its samples (under a long tail a steadier
    estimate than their mean), and its mean that scale times the mean of the shape
    pooled over every class's samples.
    """
    medians = np.asarray([np.median(r) for r in rows])
    order = np.argsort(medians)
    classes, start = [], 0
    for j in range(1, len(order) + 1):
        if j == len(order) or medians[order[j]] > ratio * medians[order[j - 1]]:
            classes.append(order[start:j])
            start = j
    scales, shape = [], []
    for members in classes:
        samples = np.maximum(np.concatenate([rows[i] for i in members]), 1e-12)
        scales.append(float(np.exp(np.log(samples).mean())))
        shape.append(samples / scales[-1])
    shape_mean = float(np.concatenate(shape).mean())
    out = np.empty(len(rows))
    for members, scale in zip(classes, scales):
        out[members] = scale * shape_mean
    return out


def from_profile(prof: Profile, spec) -> Costs:
    """Costs from a saved profile (`vlaslurm.placement.profile_types.Profile`, read at the current version)."""
    sim, gen, tr, wts, transport = prof.simulator, prof.generator, prof.trainer, prof.weights, prof.transport
    # An instance stepped alone also waits for its own device part: the rows keep only its parallel part.
    device = float(sim.device_s_per_env)
    rows = [np.maximum(np.asarray(r, float) - device, 1e-6) for r in sim.per_instance.samples]
    means = speed_classes(rows)
    shape = np.concatenate([r / m for r, m in zip(rows, means)])  # pooled, unit mean: the tail they share
    step_samples = np.stack([shape * m for m in means])
    batch = {int(n): np.asarray(v.samples, float) for n, v in sim.batch.items()}
    probe = Costs(
        step_samples=step_samples,
        step_rule="max",
        forward_s=Curve.constant(0.0),
        update_s=Curve.constant(0.0),
        publish_s=0.0,
        install_s=0.0,
        hop_s=0.0,
        memory=Memory(1.0),
        device_s_per_env=device,
    )
    rule = pick_step_rule(probe, batch)
    fwd = gen.forward
    upd = tr.update
    nbytes = float(wts.bytes)
    if spec.rollout.weight_sync == "filesystem":
        publish, install = wts.filesystem_publish_s, wts.filesystem_install_s + 0.1  # polled every 0.2 s
    else:  # a store handshake with every generator, then the broadcast
        rtt = float(transport.round_trip_s)
        publish = install = 3 * rtt + nbytes / wts.copy_bytes_per_s
    # A profile does not keep the torch device it was measured on (only `gpu`, the model), so no profile
    # has charged the collocated swap: kept so, to keep the validated predictions.
    on_gpu = False
    # Collocated offload (runtime/offload.py): the generator's model, and the trainer's model, gradients and
    # optimizer state, leave the GPU at each phase boundary and come back for the next phase.
    swap_bytes = gen.weights_bytes + tr.memory.base
    cpu = cpu_costs(prof)
    hop = hop_s(prof)
    # The runtime's per-decision work (message, record, request, batch) is the CPU seconds measured through
    # real sockets on the target node.
    return Costs(
        step_samples=step_samples,
        step_rule=rule,
        batch_samples=batch,
        forward_s=Curve(list(map(float, fwd.sizes)), isotonic(fwd.seconds)),
        update_s=Curve(list(map(float, upd.sizes)), isotonic(upd.seconds)),
        publish_s=float(publish),
        install_s=float(install),
        hop_s=hop,
        message_s=cpu.request_s,
        reply_s=float(prof.overhead.sim_reply_cpu_s),
        wake_after_s=wake_curve(transport),
        record_s=cpu.record_s,
        request_s=cpu.serve_s,
        batch_s=cpu.wake_s,
        memory=Memory(
            capacity=float(prof.capacity_bytes),
            sim_base=sim.memory.base,
            sim_per_env=sim.memory.per_env,
            gen_base=gen.memory.base,
            gen_per_item=gen.memory.per_item,
            train_base=tr.memory.base,
            train_per_step=tr.memory.per_step,
            gen_offload=float(gen.weights_bytes),
            train_offload=float(tr.memory.base),
            trainer_at=estimated_trainer(spec),
        ),
        thread_safe=bool(sim.thread_safe),
        device_s_per_env=device,
        reset_s=float(sim.reset_s),
        dispatch_s=float(sim.per_instance.dispatch_s) + hop,
        episode_len=np.asarray(sim.episode_len, int),
        param_bytes=nbytes,
        swap_s=(2 * swap_bytes / wts.h2d_bytes_per_s) if on_gpu else 0.0,
        sim_on_gpu=False,
        on_gpu=on_gpu,
        gpu_name=str(prof.gpu),
        cpu=cpu,
        host_cores=float(prof.cpu_count or os.cpu_count() or 1) if prof.local else None,
    )


def estimated_trainer(spec) -> Optional[Callable[[int, float], TrainerBytes]]:
    """A trainer rank's memory from the model's shape and the spec's `trainer:` section, where the model is an
    OpenVLA release (None otherwise: the profile's measurement stands). A profile measures one replicated rank at
    its own batch; this follows the candidate's trainer ranks, fsdp's shards and the micro-batch."""
    from vlaslurm.placement.trainer_memory import sequences_per_rank, spec_model_shape, trainer_bytes

    shape = spec_model_shape(spec)
    if shape is None:
        return None
    algo = spec.algo

    def at(ranks: int, steps: float) -> TrainerBytes:
        sequences = sequences_per_rank(spec.trainer, int(steps * ranks), algo.minibatches, ranks)
        return trainer_bytes(shape, spec.trainer, ranks, sequences)

    return at


def hop_s(prof: Profile) -> float:
    """One message's latency, one way. The per-decision CPU is measured and charged to the roles as their
    work, so the hop is only what is left of the round trip: waking the peer, the wire."""
    transport = prof.transport
    # Right after the last message (wake-ups after a sleep are `wake_after_s`, not counted twice).
    rtt = float(transport.idle_round_trip_s[0])
    return max(0.0, rtt - transport.client_cpu_s - transport.server_cpu_s) / 2


def wake_curve(transport: TransportProfile) -> Curve:
    """Extra latency of a message to a process that has slept t seconds: its round trip after a gap of t,
    less the round trip right after the last one."""
    gaps, rtts = transport.idle_s, transport.idle_round_trip_s
    base = rtts[0]
    return Curve([float(g) for g in gaps], isotonic([max(0.0, r - base) for r in rtts]), flat=True)


def cpu_costs(prof: Profile) -> CpuCosts:
    """The CPU side of a profile."""
    over, sim, fwd, upd = prof.overhead, prof.simulator, prof.generator.forward, prof.trainer.update
    return CpuCosts(
        step_s=float(sim.per_instance.cpu_s),
        forward_s=Curve(list(map(float, fwd.sizes)), isotonic(fwd.cpu_seconds)),
        update_s=Curve(list(map(float, upd.sizes)), isotonic(upd.cpu_seconds)),
        request_s=float(over.sim_request_cpu_s),
        record_s=float(over.record_cpu_s),
        serve_s=float(over.gen_serve_cpu_s),
        wake_s=float(over.gen_wake_cpu_s),
        segment_s=float(over.segment_cpu_s),
    )


def isotonic(values: Sequence[float]) -> List[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a bigger batch never costs less,
    so one noisy measurement on a busy machine does not bend the curve."""
    blocks: List[List[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def pick_step_rule(costs: Costs, batch: Dict[int, np.ndarray], tolerance: float = 0.15) -> str:
    """`max` (instances run in parallel) or `sum` (one after another) if either predicts every measured
    vectorised step within `tolerance`, else `batch` (draw from the measured vectorised steps)."""
    for rule in ("max", "sum"):
        costs.step_rule = rule
        ok = True
        for n, samples in batch.items():
            if n == 1:
                continue
            ids = costs.instance_map(n)
            predicted = costs.mean_group_step(ids, draws=400)
            ok = ok and abs(predicted - samples.mean()) <= tolerance * samples.mean()
        if ok:
            return rule
    costs.step_rule = "batch"
    return "batch"
