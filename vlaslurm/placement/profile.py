"""The profiling job: measure the spec's real simulator, policy and learner where the run will run.

`profile(loaded, local=...)` submits `measure` through submitit (the local executor, or Slurm on
the partitions the roles use) and caches the merged result as JSON under
`<runs_root>/.profiles/<key>.json`, keyed by a hash of what the numbers depend on. Each role's
wall times are recorded with their CPU seconds beside them.
Details (what is measured, profile versions): docs/placement.md
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vlaslurm.log import get_logger
from vlaslurm.placement.costs import summarize
from vlaslurm.placement.profile_types import PROFILE_VERSION, Profile, StaleProfile
from vlaslurm.rundir import profiles_dir

log = get_logger("vlaslurm.placement")
ROLES = ("simulator", "generator", "trainer")


# ---------------------------------------------------------------------------- cache


def gpu_model(spec, local: bool) -> str:
    """The GPU model the profile will run on: torch's device name locally, sinfo's gres type under Slurm, or 'cpu'."""
    if local:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if not any(spec.role_resources(r).gpus_per_node for r in ROLES):
        return "cpu"
    from vlaslurm.slurm.cluster import run_slurm

    models = set()
    for partition in partitions(spec).values():
        args = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
        for gres in run_slurm(args).split():
            parts = gres.split(":")
            if parts[0] == "gpu":
                models.add(parts[1] if len(parts) > 2 else "gpu")
    return ",".join(sorted(models)) or "gpu"


def partitions(spec) -> Dict[str, Optional[str]]:
    """The partition of each role (None = Slurm's default)."""
    return {r: spec.role_resources(r).partition or spec.slurm.partition for r in ROLES}


def cache_key(spec, local: bool, gpu: str) -> str:
    """Hash of what the measured numbers depend on."""

    def role(name: str) -> Dict[str, Any]:
        res = spec.role_resources(name)
        return {
            "partition": None if local else (res.partition or spec.slurm.partition),
            "constraint": res.constraint,
            "cpus": res.cpus_per_task,
            "gpu": bool(res.gpus_per_node),
        }

    content = {
        "version": PROFILE_VERSION,
        "env": dataclasses.asdict(spec.env),
        "model": dataclasses.asdict(spec.model),
        "algo": dataclasses.asdict(spec.algo),
        "roles": {r: role(r) for r in ROLES},
        "local": local,
        "gpu": gpu,
    }
    text = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_path(runs_root: Path, key: str) -> Path:
    return profiles_dir(runs_root) / f"{key}.json"


def read_profile(path: Path) -> Optional[Profile]:
    """The profile saved at `path`; None if there is none or it is of another version (a cache miss).
    ProfileError if it is of this version but malformed."""
    if not path.is_file():
        return None
    try:
        return Profile.from_dict(json.loads(path.read_text()), source=f"profile {path}")
    except StaleProfile as exc:
        log.info("%s; not used", exc)
        return None


def cached_profile(loaded, runs_root: Path, local: bool) -> Optional[Profile]:
    """The saved profile of this spec, or None."""
    return read_profile(profile_path(runs_root, cache_key(loaded.spec, local, gpu_model(loaded.spec, local))))


def profile(
    loaded, runs_root: Path, local: bool = False, force: bool = False, timeout_min: int = 20, budget_s: float = 60.0
) -> Profile:
    """Measure the spec's roles in a submitit job (cached); return the profile."""
    spec = loaded.spec
    gpu = gpu_model(spec, local)
    key = cache_key(spec, local, gpu)
    path = profile_path(runs_root, key)
    cached = None if force else read_profile(path)
    if cached is not None:
        log.info("profile %s is cached: %s", key, path)
        return cached
    folder = profiles_dir(runs_root) / "jobs" / key
    groups = {None: list(ROLES)} if local else _roles_by_partition(spec)
    results: Dict[str, Any] = {}
    for partition, roles in groups.items():
        executor = _executor(spec, folder, local, partition, roles, timeout_min)
        job = executor.submit(measure, spec, roles, budget_s / len(groups))
        log.info("profiling %s in job %s (%s)", "+".join(roles), job.job_id, partition or "local")
        part = job.result()
        for role in roles:
            results[role] = part[role]
        results.setdefault("weights", part["weights"])
        results.setdefault("transport", part["transport"])
        results.setdefault("capacity_bytes", part["capacity_bytes"])
        results.setdefault("overhead", part["overhead"])
        results.setdefault("cpu_count", part["cpu_count"])
        results.setdefault("hosts", []).append(part["host"])
    results.update(
        {
            "key": key,
            "version": PROFILE_VERSION,
            "gpu": gpu,
            "local": local,
            "created": time.time(),
            "spec": spec.name,
            "partitions": {r: p for r, p in partitions(spec).items()},
        }
    )
    text = json.dumps(results)
    measured = Profile.from_dict(json.loads(text), source=f"profile {key} just measured")  # as a read will see it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return measured


def _roles_by_partition(spec) -> Dict[Optional[str], List[str]]:
    """One job per partition; each job builds a simulator too (the policy needs its observation shapes)."""
    groups: Dict[Optional[str], List[str]] = {}
    for role, partition in partitions(spec).items():
        groups.setdefault(partition, []).append(role)
    return groups


def _executor(spec, folder: Path, local: bool, partition: Optional[str], roles: List[str], timeout_min: int):
    import submitit

    if local:
        local_executor = submitit.LocalExecutor(folder=str(folder))
        local_executor.update_parameters(timeout_min=timeout_min)
        return local_executor
    res = [spec.role_resources(r) for r in roles]
    executor = submitit.SlurmExecutor(folder=str(folder))
    params: Dict[str, Any] = {
        "time": timeout_min,
        "cpus_per_task": max(r.cpus_per_task for r in res),
        "ntasks_per_node": 1,
        "nodes": 1,
        "job_name": f"vlaslurm-profile-{spec.name}",
    }
    if partition:
        params["partition"] = partition
    gpus = max(1 if r.gpus_per_node else 0 for r in res)
    if gpus:
        params["gres"] = f"gpu:{gpus}"
    constraint = next((r.constraint for r in res if r.constraint), None)
    if constraint:
        params["constraint"] = constraint
    if spec.slurm.account:
        params["account"] = spec.slurm.account
    executor.update_parameters(**params)
    return executor


# ---------------------------------------------------------------------------- the job


def measure(spec, roles: Sequence[str] = ROLES, budget_s: float = 60.0) -> Dict[str, Any]:
    """Run inside the profiling job: measure `roles` of `spec` on this machine; return plain data."""
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # As many threads as a rank gets (the local launcher sets OMP_NUM_THREADS=1): more would
    # oversubscribe the CPUs and measure contention instead of the model.
    torch.set_num_threads(max(1, min(spec.role_resources(r).cpus_per_task for r in roles)))
    share = budget_s / 4
    sim = _measure_simulator(spec, share)
    dims, obs = sim.pop("_dims"), sim.pop("_obs")
    out: Dict[str, Any] = {
        "host": socket.gethostname(),
        "device": str(device),
        "capacity_bytes": _capacity(device),
        "roles": list(roles),
        "simulator": sim,
    }
    policy = _policy(spec, dims, device)
    out["generator"] = _measure_generator(spec, policy, obs, device, share)
    out["trainer"] = _measure_trainer(spec, dims, obs, device, share)
    out["weights"] = _measure_weights(policy, device)
    out["transport"] = _measure_transport(spec, obs, dims)
    out["overhead"] = _overhead(spec, obs, dims, out["transport"], sim.get("run_chunk_cpu_s", 0.0))
    out["cpu_count"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return out


def _capacity(device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _rss() -> float:
    with open("/proc/self/statm") as handle:
        return float(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _runqueue_wait() -> float:
    """Seconds this thread has so far waited for a CPU while runnable (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as handle:
            return int(handle.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _clock() -> Tuple[float, float, float]:
    return time.perf_counter(), time.process_time(), _runqueue_wait()


def _since(start: Tuple[float, float, float]) -> Tuple[float, float, float]:
    """(wall, CPU, CPU wait) seconds since `_clock()`. The wall leaves out the time the thread waited for a CPU that
    other work held: the profile is cached and reused, so a busy moment must not become the role's cost
    (the model adds contention between the run's own roles itself, from the CPU seconds). CPU counts
    every thread of this process (torch's, zmq's). The wait is kept in the profile, to show how busy the
    host was."""
    wall, cpu, wait = _clock()
    return max(0.0, wall - start[0] - (wait - start[2])), cpu - start[1], wait - start[2]


def _timed_cpu(fn: Callable[[], Any]) -> Tuple[float, float, float]:
    start = _clock()
    fn()
    return _since(start)


def _cpu_per_call(fn: Callable[[], Any], rounds: int) -> float:
    start = time.process_time()
    for _ in range(rounds):
        fn()
    return (time.process_time() - start) / rounds


def _instance_counts(spec) -> List[int]:
    ranks = spec.runtime.local_ranks.get("simulator") or max(
        1, spec.resources.simulator.tasks_per_node * spec.resources.simulator.nodes
    )
    per_rank = max(1, spec.env.num_envs // ranks)
    return sorted({1, min(4, per_rank), per_rank, spec.env.num_envs})


def _measure_simulator(spec, budget_s: float) -> Dict[str, Any]:
    from vlaslurm.envs import make_env
    from vlaslurm.runtime.roles.simulator import env_dims

    counts = _instance_counts(spec)
    rng = np.random.default_rng(0)
    batch: Dict[str, Any] = {}
    memory: Dict[str, float] = {}
    episode_lens: List[int] = []
    reset_times: List[float] = []
    env = None
    for n in counts:
        before = _rss()
        env = make_env(spec.env, num_envs=n, rank=0, seed=spec.rollout.seed)
        ids = np.arange(n)
        env.reset(ids.tolist())
        memory[str(n)] = max(0.0, _rss() - before)
        elapsed = np.zeros(n, int)
        samples: List[float] = []
        waits: List[float] = []
        deadline = time.perf_counter() + budget_s / (2 * len(counts))
        while len(samples) < 200 and (len(samples) < 10 or time.perf_counter() < deadline):
            actions = rng.uniform(-1, 1, (n, env.action_dim)).astype(np.float32)
            start = _clock()
            res = env.step(ids, actions)
            wall, _, wait = _since(start)
            samples.append(wall)
            waits.append(wait)
            elapsed += 1
            ended = np.flatnonzero(res.terminated | res.truncated)
            if len(ended):
                episode_lens += elapsed[ended].tolist()
                elapsed[ended] = 0
                reset_times.append(_timed(functools.partial(env.reset, ended.tolist())) / len(ended))
        batch[str(n)] = {
            "samples": [round(s, 7) for s in samples],
            **summarize(samples),
            "cpu_wait_mean_s": float(np.mean(waits)),
        }
        if n != counts[-1]:
            env.close()
    assert env is not None  # counts always holds 1
    device = device_s_per_env(env, counts[-1], rng) if env.thread_safe and env.shared_device else 0.0
    # With a shared device, instances stepped from threads at once would queue for it in their samples, and the
    # simulation queues them again: step them one after another, each alone on the device.
    per_instance = _per_instance(env, counts[-1], rng, budget_s / 2, threaded=device == 0.0)
    run_chunk_cpu = _run_chunk_cpu(env, spec.model.steps_per_decision, rng)
    dims = env_dims(env, spec.env)
    final_obs = env.reset(list(range(counts[-1])))
    env.close()
    sizes = [int(n) for n in memory]
    per_env = float(np.polyfit(sizes, list(memory.values()), 1)[0]) if len(sizes) > 1 else 0.0
    return {
        "counts": counts,
        "batch": batch,
        "per_instance": per_instance,
        "thread_safe": bool(env.thread_safe),
        "reset_s": float(np.mean(reset_times)) if reset_times else 0.0,
        "episode_len": episode_lens[:500] or [spec.env.max_episode_steps],
        "memory": {"base": max(0.0, memory[str(sizes[0])] - per_env * sizes[0]), "per_env": max(0.0, per_env)},
        "run_chunk_cpu_s": run_chunk_cpu,
        "device_s_per_env": device,
        "_dims": dims,
        "_obs": final_obs,
    }


def _run_chunk_cpu(env, chunk: int, rng, rounds: int = 200) -> float:
    """CPU seconds of run_chunk's own work per instance and decision: it drives a replay of one real step
    result (no episode end), so what is timed is the runtime's loop around `env.step`, not the simulator."""
    from vlaslurm.runtime.episodes import run_chunk

    env.reset([0])
    action = rng.uniform(-1, 1, (1, env.action_dim)).astype(np.float32)
    res = env.step([0], action)
    res = dataclasses.replace(res, terminated=np.zeros(1, bool), truncated=np.zeros(1, bool))
    replay = type("Replay", (), {"action_dim": env.action_dim, "step": lambda self, ids, actions: res})()
    actions = np.zeros((1, chunk, env.action_dim), np.float32)
    return _cpu_per_call(lambda: run_chunk(replay, np.zeros(1, int), actions), rounds)


PER_INSTANCE_MAX = 1000  # samples of one instance: quick ones stop here, slow ones at the deadline


def device_s_per_env(env, n: int, rng, rounds: int = 24) -> float:
    """Seconds per instance of the part of a step that concurrent calls queue for.

    Two halves of the instances stepped from two threads at once take one half's time if the
    simulator is parallel hardware, and that plus the queued part of the other half if a part of
    each call runs on one shared device: that excess, per instance of a half. Lower quartiles, not
    medians: a late wake-up only adds time, and on a loaded machine the second thread's would count as
    queueing (a parallel simulator measured 0.7 ms per instance beside the test suite with medians).
    """
    half = n // 2
    if half < 1:
        return 0.0
    first, second = np.arange(half), np.arange(half, 2 * half)
    mine, theirs = (np.random.default_rng(s) for s in rng.integers(0, 2**31, 2))  # a Generator per thread

    def step(ids: np.ndarray, local: np.random.Generator) -> None:
        res = env.step(ids, local.uniform(-1, 1, (len(ids), env.action_dim)).astype(np.float32))
        ended = ids[res.terminated | res.truncated]
        if len(ended):
            env.reset(ended.tolist())

    alone, pair = [], []
    for _ in range(rounds):
        alone.append(_timed(lambda: step(first, mine)))
        other = threading.Thread(target=step, args=(second, theirs))
        start = time.perf_counter()
        other.start()
        step(first, mine)
        other.join()
        pair.append(time.perf_counter() - start)
    return max(0.0, float(np.quantile(pair, 0.25) - np.quantile(alone, 0.25))) / half


def _per_instance(env, n: int, rng, budget_s: float, threaded: bool = True) -> Dict[str, Any]:
    """Each instance stepped alone, so slow instances and the tail show.

    A thread-safe simulator is stepped from one thread per instance at once, as async
    mode steps it (contention included, so its wall times keep the CPU waits), unless
    `threaded` is False; any other one instance after another.
    """
    rows: List[List[float]] = [[] for _ in range(n)]
    cpu: List[float] = []
    waits: List[float] = []
    deadline = time.perf_counter() + budget_s
    env.reset(list(range(n)))
    seeds = rng.integers(0, 2**31, n)

    def run(i: int, rounds: int) -> None:
        local = np.random.default_rng(int(seeds[i]))
        for _ in range(rounds):
            action = local.uniform(-1, 1, (1, env.action_dim)).astype(np.float32)
            start = _clock()
            res = env.step([i], action)
            wall, used, wait = _since(start)
            rows[i].append(wall)
            cpu.append(used)
            waits.append(wait)
            if res.terminated[0] or res.truncated[0]:
                env.reset([i])

    dispatch: List[float] = []
    if threaded and env.thread_safe and n > 1:
        dispatch = _threaded_steps(env, n, rows, seeds, deadline, cpu)
    else:
        while len(rows[-1]) < PER_INSTANCE_MAX and (len(rows[-1]) < 8 or time.perf_counter() < deadline):
            for i in range(n):
                run(i, 1)
    return {
        "n": n,
        "threaded": bool(dispatch),
        "dispatch_s": float(np.mean(dispatch)) if dispatch else 0.0,
        "cpu_s": float(np.mean(cpu)) if cpu else 0.0,
        "cpu_wait_mean_s": float(np.mean(waits)) if waits else 0.0,
        "samples": [[round(s, 7) for s in row] for row in rows],
        "summary": [summarize(row) for row in rows],
    }


def _threaded_steps(env, n: int, rows: List[List[float]], seeds, deadline: float, cpu: List[float]) -> List[float]:
    """Async mode's simulator loop without sockets: a main thread hands each instance's next step
    to a pool of n threads and takes finished ones back. Returns the hand-over latencies; appends
    each step's CPU seconds (its thread's own) to `cpu`."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    done: queue.Queue[tuple] = queue.Queue()
    rngs = [np.random.default_rng(int(s)) for s in seeds]

    def step(i: int, submitted: float) -> None:
        action = rngs[i].uniform(-1, 1, (1, env.action_dim)).astype(np.float32)
        t0, c0 = time.perf_counter(), time.thread_time()
        res = env.step([i], action)
        t1 = time.perf_counter()
        cpu.append(time.thread_time() - c0)
        if res.terminated[0] or res.truncated[0]:
            env.reset([i])
        done.put((i, submitted, t0, t1))

    latencies: List[float] = []
    with ThreadPoolExecutor(max_workers=n) as pool:
        for i in range(n):
            pool.submit(step, i, time.perf_counter())
        running = n
        while running:
            i, submitted, t0, t1 = done.get()
            latencies.append((t0 - submitted) + (time.perf_counter() - t1))
            rows[i].append(t1 - t0)
            if len(rows[i]) < PER_INSTANCE_MAX and (len(rows[i]) < 8 or time.perf_counter() < deadline):
                pool.submit(step, i, time.perf_counter())
            else:
                running -= 1
    return latencies


def _overhead(spec, obs, dims, transport: Dict[str, Any], run_chunk_s: float) -> Dict[str, float]:
    """The runtime's own CPU per decision, per role that pays it (CPU seconds on this node).

    - simulator, per request: build and encode the observation, the signed round trip
      through real sockets (client side), decode the actions; and of that, the reply's part
      (receive, decode) apart;
    - simulator, per instance and decision: run_chunk's loop around the steps (`run_chunk_s`),
      EnvTrack.record, and encoding the segments it ships;
    - generator, per request: its side of the round trip (receive, verify, sign, send)
      as measured in bursts, and decoding the observation, encoding the actions;
    - generator, per batch: waking for it (a lone request's CPU beyond a burst's share);
    - trainer, per segment: verify and decode it.
    """
    from vlaslurm.runtime import messages as msgs
    from vlaslurm.runtime.episodes import EnvTrack, split_obs, stack_obs
    from vlaslurm.runtime.transport import decode, socket_encoder

    key = b"k" * 32
    chunk, action_dim = spec.model.action_chunk, dims["action_dim"]
    item = split_obs(obs)[0]
    track = EnvTrack(0, 0, "t", 64, time.monotonic, 0)
    track.start_episode(item)
    reply = _act_reply(chunk, action_dim)
    encode = socket_encoder(key)
    act_msg = decode(encode(msgs.encode_act(reply)), key)
    obs_msg = decode(encode(msgs.encode_obs(msgs.ObsRequest([0], [0], [0], [1], stack_obs([item]), 0, 0))), key)
    first_obs = track.obs
    assert first_obs is not None  # start_episode set it
    sim_payload = _cpu_per_call(
        lambda: (
            msgs.encode_obs(msgs.ObsRequest([0], [0], [0], [1], stack_obs([first_obs]), 0, 0)),
            msgs.decode_act(act_msg),
        ),
        300,
    )
    reply_payload = _cpu_per_call(lambda: msgs.decode_act(act_msg), 300)
    gen_payload = _cpu_per_call(lambda: (msgs.decode_obs(obs_msg), msgs.encode_act(reply)), 300)
    rounds, segments = 400, []
    start = time.process_time()
    for _ in range(rounds):
        segments += track.record(
            0,
            reply.actions[0],
            reply.logprob[0],
            0.0,
            np.zeros(chunk, np.float32),
            np.ones(chunk, bool),
            item,
            False,
            False,
            False,
        )
    record = (time.process_time() - start) / rounds
    sample = segments[0] if segments else fake_segments(spec, obs, dims, 1)[0]
    wire = encode(msgs.encode_segment(sample))
    seg_encode = _cpu_per_call(lambda: encode(msgs.encode_segment(sample)), 50)
    seg_decode = _cpu_per_call(lambda: msgs.decode_segment(decode(wire, key)), 50)
    request = transport["client_cpu_s"] + sim_payload
    return {
        "sim_request_cpu_s": request,
        # of which a reply's part, before its step can start: receiving it, decoding the actions
        "sim_reply_cpu_s": min(request, transport["client_recv_cpu_s"] + reply_payload),
        "record_cpu_s": run_chunk_s + record + seg_encode * len(segments) / rounds,
        "gen_serve_cpu_s": transport["server_burst_cpu_s"] + gen_payload,
        "gen_wake_cpu_s": max(0.0, transport["server_cpu_s"] - transport["server_burst_cpu_s"]),
        "segment_cpu_s": seg_decode,
    }


def _act_reply(chunk: int, action_dim: int):
    from vlaslurm.runtime import messages as msgs

    return msgs.ActReply(
        [0],
        0,
        0,
        np.zeros((1, chunk, action_dim), np.float32),
        np.zeros((1, chunk), np.float32),
        np.zeros(1, np.float32),
    )


def _policy(spec, dims, device):
    import torch

    from vlaslurm.models import build_policy

    torch.manual_seed(spec.rollout.seed)
    return build_policy(spec.model, **dims).to(device)


def _batch_sizes(spec) -> List[int]:
    top = max(spec.env.num_envs, spec.rollout.batching.max_batch)
    sizes, b = [], 1
    while b < top:
        sizes.append(b)
        b *= 2
    return sizes + [top]


def _tile_obs(obs, n: int):
    from vlaslurm.runtime.episodes import split_obs, stack_obs

    items = split_obs(obs)
    return stack_obs([items[i % len(items)] for i in range(n)])


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_generator(spec, policy, obs, device, budget_s: float) -> Dict[str, Any]:
    import torch

    from vlaslurm.runtime import messages as msgs
    from vlaslurm.runtime.roles.generator import to_policy_input

    policy.eval()
    sizes, seconds, cpu, waits, memory = [], [], [], [], {}
    deadline = time.perf_counter() + budget_s
    for b in _batch_sizes(spec):
        req = msgs.ObsRequest(list(range(b)), [0] * b, [0] * b, list(range(b)), _tile_obs(obs, b), 0, 0)
        before = _rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def forward(req: msgs.ObsRequest = req) -> None:
            with torch.no_grad():
                out = policy.act(to_policy_input([req], device))
            [x.float().cpu().numpy() for x in (out.actions, out.logprob, out.value)]
            _sync(device)

        forward()  # warm-up
        times = np.asarray([_timed_cpu(forward) for _ in range(15 if time.perf_counter() < deadline else 3)])
        sizes.append(b)
        seconds.append(float(np.quantile(times[:, 0], 0.25)))  # a busy machine's spikes inflate means and medians
        cpu.append(float(np.quantile(times[:, 1], 0.25)))
        waits.append(float(times[:, 2].mean()))
        memory[str(b)] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else max(0.0, _rss() - before)
    weights = float(sum(t.numel() * t.element_size() for t in policy.state_dict().values()))
    per_item = float(np.polyfit(sizes, [memory[str(b)] for b in sizes], 1)[0]) if len(sizes) > 1 else 0.0
    return {
        "forward": {"sizes": sizes, "seconds": seconds, "cpu_seconds": cpu, "cpu_wait_mean_s": waits},
        "weights_bytes": weights,
        "request_s": _request_s(spec, obs),
        "memory": {"base": weights, "per_item": max(0.0, per_item)},
    }


def _request_s(spec, obs) -> float:
    """The generator's work per request besides the forward: take it in, answer it (signed both ways)."""
    from vlaslurm.runtime import messages as msgs
    from vlaslurm.runtime.transport import decode, socket_encoder

    key = b"k" * 32
    chunk = spec.model.action_chunk
    encode = socket_encoder(key)
    wire = encode(msgs.encode_obs(msgs.ObsRequest([0], [0], [0], [0], _tile_obs(obs, 1), 0, 0)))
    reply = msgs.ActReply(
        [0], 0, 0, np.zeros((1, chunk, 7), np.float32), np.zeros((1, chunk), np.float32), np.zeros(1, np.float32)
    )
    rounds = 300
    start = time.perf_counter()
    for _ in range(rounds):
        msgs.decode_obs(decode(wire, key))
        encode(msgs.encode_act(reply))
    return (time.perf_counter() - start) / rounds


def fake_segments(spec, obs, dims, steps: int) -> List[Any]:
    """Segments of the spec's shapes totalling about `steps` env steps (what the trainer consumes)."""
    from vlaslurm.runtime.episodes import split_obs
    from vlaslurm.runtime.messages import Segment

    chunk, action_dim = spec.model.action_chunk, dims["action_dim"]
    length = max(1, min(64, spec.env.max_episode_steps // chunk))
    item = split_obs(obs)[0]
    rng = np.random.default_rng(0)
    segments: List[Segment] = []
    total = 0
    while total < steps:
        images = None if item[0] is None else np.stack([item[0]] * (length + 1))
        state = None if item[1] is None else np.stack([item[1]] * (length + 1)).astype(np.float32)
        segments.append(
            Segment(
                traj_id=f"p-{len(segments)}",
                env_id=len(segments),
                episode=0,
                index=0,
                task="profile",
                instruction=item[2],
                version=0,
                images=images,
                state=state,
                actions=rng.uniform(-1, 1, (length, chunk, action_dim)).astype(np.float32),
                logprob=np.full((length, chunk), -1.0, np.float32),
                value=np.zeros(length, np.float32),
                rewards=rng.random((length, chunk)).astype(np.float32),
                mask=np.ones((length, chunk), bool),
                step_ids=np.arange(length) * chunk,
                versions=np.zeros(length, np.int64),
                terminated=False,
                truncated=True,
                success=False,
                t_start=0.0,
                t_end=0.0,
            )
        )
        total += length * chunk
    return segments


def _measure_trainer(spec, dims, obs, device, budget_s: float) -> Dict[str, Any]:
    import torch

    from vlaslurm.algos.batch import collate
    from vlaslurm.algos.learners import DataParallel, make_learner

    policy = _policy(spec, dims, device).train()
    learner = make_learner(spec.algo, policy, DataParallel(None, 0, 1), spec.rollout.seed)
    spu = spec.algo.steps_per_update
    sizes, seconds, cpu, waits, memory = [], [], [], [], {}
    deadline = time.perf_counter() + budget_s
    for steps in sorted({max(1, spu // 4), max(1, spu // 2), spu}):
        segments = fake_segments(spec, obs, dims, steps)
        before = _rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def update(segments: List[Any] = segments) -> None:
            learner.update(collate(segments).to(device), 0)
            _sync(device)

        update()  # warm-up (optimizer state)
        times = np.asarray([_timed_cpu(update) for _ in range(2 if time.perf_counter() < deadline else 1)])
        sizes.append(sum(s.steps for s in segments))
        seconds.append(float(np.min(times[:, 0])))
        cpu.append(float(np.min(times[:, 1])))
        waits.append(float(times[:, 2].mean()))
        memory[str(sizes[-1])] = (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else max(0.0, _rss() - before)
        )
    opt = getattr(learner, "opt", None)
    opt_bytes = 0.0
    if opt is not None:
        opt_bytes = float(
            sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        )
    weights = float(sum(t.numel() * t.element_size() for t in policy.state_dict().values()))
    per_step = float(np.polyfit(sizes, [memory[str(s)] for s in sizes], 1)[0]) if len(sizes) > 1 else 0.0
    return {
        "update": {"sizes": sizes, "seconds": seconds, "cpu_seconds": cpu, "cpu_wait_mean_s": waits},
        "optimizer_bytes": opt_bytes,
        "memory": {"base": 2 * weights + opt_bytes, "per_step": max(0.0, per_step)},
    }


def _measure_weights(policy, device) -> Dict[str, Any]:
    from vlaslurm.runtime.weights import FilesystemPublisher, FilesystemSubscriber

    state = {k: v.detach() for k, v in policy.state_dict().items()}
    nbytes = float(sum(t.numel() * t.element_size() for t in state.values()))

    def clone_all() -> List[Any]:
        clones = [t.clone() for t in state.values()]
        _sync(device)
        return clones

    copies = [_timed(clone_all) for _ in range(5)]
    copy_bw = nbytes / max(np.median(copies), 1e-9)
    h2d_bw = copy_bw
    if device.type == "cuda":
        host = {k: v.cpu().pin_memory() for k, v in state.items()}

        def to_device() -> List[Any]:
            moved = [t.to(device, non_blocking=True) for t in host.values()]
            _sync(device)
            return moved

        times = [_timed(to_device) for _ in range(5)]
        h2d_bw = nbytes / max(np.median(times), 1e-9)
    with tempfile.TemporaryDirectory() as tmp:
        pub, sub = FilesystemPublisher(tmp), FilesystemSubscriber(tmp, device=device, check_interval_s=0.0)
        publish = _timed(lambda: pub.publish(0, state))
        install = _timed(lambda: sub.poll())
    return {
        "bytes": nbytes,
        "copy_bytes_per_s": float(copy_bw),
        "h2d_bytes_per_s": float(h2d_bw),
        "filesystem_publish_s": publish,
        "filesystem_install_s": install,
    }


def _measure_transport(spec, obs, dims) -> Dict[str, Any]:
    """One-way latency between two processes through the runtime's signed sockets, and the CPU each
    side spends per round trip (an observation out, an action chunk back).

    The echo process blocks in a poll between requests, as the roles do, so the
    latency includes waking a process: on a busy machine that is most of it. A
    second series sends bursts of `ECHO_BURST` requests, which the echo process
    drains in one wake-up as the generator drains a batch's requests: its CPU per
    request is the per-request share, the rest of a lone request's is the wake-up's.
    A third series waits `IDLE_GAPS_S` before each request: how much later a process
    answers after sleeping that long.
    """
    import subprocess
    import sys

    from vlaslurm.runtime import messages as msgs
    from vlaslurm.runtime.transport import Dealer

    key = os.urandom(32)
    echo = subprocess.Popen(
        [sys.executable, "-c", "from vlaslurm.placement.profile import _echo_server; _echo_server()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert echo.stdin is not None and echo.stdout is not None  # both are pipes
    try:
        echo.stdin.write(f"{key.hex()} {spec.model.action_chunk} {dims['action_dim']}\n")
        echo.stdin.flush()
        endpoint = echo.stdout.readline().strip()
        req = msgs.encode_obs(msgs.ObsRequest([0], [0], [0], [0], _tile_obs(obs, 1), 0, 0))
        with Dealer(key, name="profile") as dealer:
            dealer.connect(endpoint)
            times, send_cpu, recv_cpu = _echo_rounds(dealer, req, 1, ECHO_WARMUP + 200, ECHO_WARMUP)
            dealer.send(msgs.ctl(0, 0, False))  # the echo process reports its lone-request CPU, then bursts
            server_cpu = float(echo.stdout.readline())
            _, burst_send, burst_recv = _echo_rounds(dealer, req, ECHO_BURST, ECHO_WARMUP + 60, ECHO_WARMUP)
            dealer.send(msgs.ctl(0, 0, False))
            server_burst_cpu = float(echo.stdout.readline())
            idle = {
                gap: float(np.mean(_echo_rounds(dealer, req, 1, IDLE_WARMUP + IDLE_ROUNDS, IDLE_WARMUP, gap)[0]))
                for gap in IDLE_GAPS_S
            }
            dealer.send(msgs.ctl(0, 0, True))
            echo.stdout.readline()  # its CPU over the idle series: not used
    finally:
        try:
            echo.wait(10)
        except subprocess.TimeoutExpired:
            echo.kill()
    rtt = float(np.mean(times))
    return {
        "round_trip_s": rtt,
        "round_trip_p99_s": float(np.quantile(times, 0.99)),
        "hop_s": rtt / 2,
        "client_cpu_s": send_cpu + recv_cpu,
        "client_send_cpu_s": send_cpu,
        "client_recv_cpu_s": recv_cpu,
        "server_cpu_s": server_cpu,
        "client_burst_cpu_s": burst_send + burst_recv,
        "server_burst_cpu_s": server_burst_cpu,
        "burst": ECHO_BURST,
        "idle_s": list(idle),
        "idle_round_trip_s": list(idle.values()),
        "load_average": os.getloadavg()[0],
    }


def _echo_rounds(
    dealer, request, burst: int, rounds: int, warmup: int, idle_s: float = 0.002
) -> Tuple[List[float], float, float]:
    """`rounds` rounds of `burst` requests sent at once and their replies, each after `idle_s` of quiet;
    the round trips' wall times and the client's CPU seconds per request sending and receiving, all after
    the first `warmup` rounds."""
    times, send_cpu, recv_cpu = [], 0.0, 0.0
    for i in range(rounds):
        if idle_s:
            time.sleep(idle_s)  # the echo process falls back into its poll, and sleeps there this long
        start, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(burst):
            dealer.send(request)
        cpu1 = time.process_time()
        for _ in range(burst):
            if dealer.recv(5000) is None:
                raise TimeoutError("the transport echo process did not answer within 5 s")
        if i >= warmup:
            times.append(time.perf_counter() - start)
            send_cpu += cpu1 - cpu0
            recv_cpu += time.process_time() - cpu1
    n = max(1, len(times) * burst)
    return times, send_cpu / n, recv_cpu / n


ECHO_WARMUP = 30
ECHO_BURST = 8
# Round trips after these gaps of quiet: a process woken after a longer sleep answers later (on an idle
# host the cores drop into deeper sleep states), which a lock-step phase's long env steps pay each decision.
IDLE_GAPS_S = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
IDLE_WARMUP = 3
IDLE_ROUNDS = 20


def _echo_server() -> None:
    """The other end of `_measure_transport`: 'key chunk action_dim' on stdin, endpoint on stdout; answers
    each request with an action chunk, draining every request that is ready before it polls again; at
    each ctl message prints its CPU seconds per request since the last one (warm-up left out), and at a
    ctl message that says stop, returns."""
    import sys

    from vlaslurm.runtime import messages as msgs
    from vlaslurm.runtime.transport import Poller, Router

    hex_key, chunk, action_dim = sys.stdin.readline().split()
    reply = msgs.encode_act(_act_reply(int(chunk), int(action_dim)))
    served, start = -ECHO_WARMUP, time.process_time()
    with Router(bytes.fromhex(hex_key), name="echo") as router:
        print(router.bind("127.0.0.1"), flush=True)
        poller = Poller(router)
        while True:
            for sock in poller.poll(1000):
                while (got := sock.recv(0)) is not None:
                    peer, msg = got
                    if msg.kind == "ctl":
                        print((time.process_time() - start) / max(1, served), flush=True)
                        if msg.meta["stop"]:
                            return
                        served, start = -ECHO_WARMUP * ECHO_BURST, time.process_time()
                        continue
                    router.send(peer, reply)
                    served += 1
                    if served == 0:
                        start = time.process_time()
