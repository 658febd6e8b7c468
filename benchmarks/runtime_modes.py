"""Throughput of the rollout modes on the synthetic workload, against the bottleneck bound.

    python benchmarks/runtime_modes.py [--steps 12000] [--modes sync,async] [--out benchmarks/results]

A shorter run to compare before and after a change in one window (the results
of a loaded machine are noisy): `--steps 4000 --modes async --out /tmp/x`.

Workload (issue 3): 16 synthetic environments, step time lognormal with mean
10 ms and sigma 1.0, 25% of them 3x slower; policy forward 2 ms + 0.2 ms per
item; update 20 ms per 256 env steps. Actions come in chunks of C = 8 (an
OpenVLA-OFT-style chunk; the issue leaves C open, and with C = 1 no runtime can
reach the bound below, because every 10 ms step would wait for a >= 2.2 ms
forward). One rank per role, all on this machine, every mode run to the same
number of env steps.

Throughput = env steps in the ledger / (last simulator step end - first step
start), from the run's own event log. For async the results also say where an
environment's time goes between chunks (`decision_breakdown`), to tell the
runtime's latency from the machine's.

Bound = min(simulator, generator, trainer capacity), from the same parameters:
- simulator: sum over environments of 1 / E[step time] (every environment
  stepping on its own, never waiting): 12 / 10 ms + 4 / 30 ms = 1333 steps/s;
- generator: B * C / (base + per_item * B) steps/s at the best feasible batch B;
  B <= 16 because each environment has at most one request out, so
  16 * 8 / 5.2 ms = 24615 steps/s;
- trainer: steps_per_update / update time = 256 / 20 ms = 12800 steps/s.
Targets: async >= 1.85x sync and >= 0.92 of the bound; transport round trip
<= 5% of a 10 ms step (`vlaslurm.runtime.transport.benchmark`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import yaml

NUM_ENVS, STEP_MS, SIGMA, SLOW_FRACTION, SLOW_FACTOR = 16, 10.0, 1.0, 0.25, 3.0
FORWARD_BASE_MS, FORWARD_PER_ITEM_MS, CHUNK = 2.0, 0.2, 8
STEPS_PER_UPDATE, UPDATE_MS = 256, 20.0
MODES = {  # name -> rollout overrides
    "sync": {"mode": "sync"},
    "pipelined_k1": {"mode": "pipelined", "pipeline_depth": 1},
    "pipelined_k2": {"mode": "pipelined", "pipeline_depth": 2},
    "pipelined_k4": {"mode": "pipelined", "pipeline_depth": 4},
    "async": {"mode": "async", "max_staleness": 1, "stale_policy": "drop"},
}


def capacities() -> Dict[str, float]:
    """Steps per second each role could sustain alone (see the module docstring)."""
    slow = int(round(SLOW_FRACTION * NUM_ENVS))
    simulator = (NUM_ENVS - slow) / (STEP_MS / 1000) + slow / (STEP_MS * SLOW_FACTOR / 1000)
    generator = max(b * CHUNK / ((FORWARD_BASE_MS + FORWARD_PER_ITEM_MS * b) / 1000) for b in range(1, NUM_ENVS + 1))
    trainer = STEPS_PER_UPDATE / (UPDATE_MS / 1000)
    return {
        "simulator": simulator,
        "generator": generator,
        "trainer": trainer,
        "bound": min(simulator, generator, trainer),
    }


def spec(rollout: dict, steps: int, max_wait_ms: float) -> dict:
    return {
        "name": "bench",
        "env": {
            "type": "synthetic",
            "num_envs": NUM_ENVS,
            "episode_steps": 200,
            "max_episode_steps": 200,
            "step_ms": {"dist": "lognormal", "mean": STEP_MS, "sigma": SIGMA},
            "slow_fraction": SLOW_FRACTION,
            "slow_factor": SLOW_FACTOR,
        },
        "model": {
            "type": "synthetic",
            "action_chunk": CHUNK,
            "forward_ms": {"base": FORWARD_BASE_MS, "per_item": FORWARD_PER_ITEM_MS},
        },
        "algo": {"type": "synthetic", "steps_per_update": STEPS_PER_UPDATE, "update_ms": UPDATE_MS},
        "rollout": {
            "total_env_steps": steps,
            "weight_sync": "nccl",
            "batching": {"max_batch": 64, "max_wait_ms": max_wait_ms},
            **rollout,
        },
        "runtime": {
            "first_meeting_timeout_s": 120,
            "timeout_s": 60,
            "local_ranks": {"simulator": 1, "generator": 1, "trainer": 1},
        },
    }


def measure(name: str, rollout: dict, steps: int, max_wait_ms: float, root: Path) -> dict:
    from vlaslurm.rundir import read_events, read_ledger
    from vlaslurm.runtime.local import run_local
    from vlaslurm.spec import load_spec

    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec(rollout, steps, max_wait_ms)))
    run_dir = root / name
    rc = run_local(load_spec(path), root / "runs", run_dir, echo=False, timeout_s=900)
    if rc != 0:
        raise RuntimeError(f"{name}: run failed with exit code {rc}; logs in {run_dir}/logs")
    ledger = read_ledger(run_dir)
    events = read_events(run_dir)
    sim_steps = [e for e in events if e["ev"] == "step"]
    batches = [e for e in events if e["ev"] == "batch"]
    stops = [e["t"] for e in events if e["ev"] == "stop"]
    span = max(e["t1"] for e in sim_steps) - min(e["t0"] for e in sim_steps)
    counters = json.loads((run_dir / "counters" / "generator-0.json").read_text())
    out = {
        "env_steps": int(ledger.steps.sum()),
        "used_steps": int(ledger[ledger.used].steps.sum()),
        "dropped_segments": int(ledger.dropped.sum()),
        "seconds": span,
        "steps_per_s": ledger.steps.sum() / span,
        "mean_batch": float(np.mean([b["n"] for b in batches])),
        "request_latency_p50_ms": 1000 * counters.get("request_latency_s_p50", float("nan")),
        "env_busy": sum(e["t1"] - e["t0"] for e in sim_steps) / (NUM_ENVS * span),
        "steps_per_s_to_stop": to_stop(sim_steps, stops),
        "after_stop_ms": 1000 * (max(e["t1"] for e in sim_steps) - min(stops, default=float("nan"))),
        "run_dir": str(run_dir),
    }
    if rollout["mode"] == "async":
        out["decision_ms"] = decision_breakdown(sim_steps, batches)
    return out


def to_stop(steps: List[dict], stops: List[float]) -> float:
    """Env steps per second from the first chunk to the simulator's stop, counting only chunks that ended
    by then: the span above also holds the last chunks under way, and one heavy-tailed step can stretch
    it by a few 100 ms (NaN for runs whose simulator does not record its stop)."""
    if not stops or "steps" not in steps[0]:
        return float("nan")
    end = min(stops)
    done = sum(s["steps"] for s in steps if s["t1"] <= end)
    return done / (end - min(s["t0"] for s in steps))


def decision_breakdown(steps: List[dict], batches: List[dict]) -> Dict[str, float]:
    """Where an async environment's time goes between two chunks, mean ms per decision (one simulator rank):
    runtime_overhead.py's `breakdown`, whose docstring says what each part holds."""
    from runtime_overhead import breakdown  # beside this script

    return breakdown(steps, batches, lockstep=False)


def transport() -> dict:
    from vlaslurm.runtime.transport import benchmark

    image = benchmark(rounds=1000)
    state = benchmark(rounds=1000, image_shape=(1, 1, 1, 3))
    return {
        "image_224_round_trip_us": image["vlaslurm_us"],
        "image_224_raw_zmq_us": image["raw_zmq_us"],
        "state_only_round_trip_us": state["vlaslurm_us"],
        "overhead_of_10ms_step": image["vlaslurm_us"] / 10_000,
    }


def markdown(out: dict) -> str:
    """The results as a short table (benchmarks/results/runtime_modes.md)."""
    caps, w = out["capacity_steps_per_s"], out["workload"]
    m = out["machine"]
    lines = [
        f"# Runtime modes on the synthetic workload ({m['cpus']} CPUs, load average "
        f"{m.get('load_avg_1m_at_start', float('nan')):.1f} at the start, "
        f"{m['load_avg_1m_at_end']:.1f} at the end)",
        "",
        f"{w['num_envs']} envs, lognormal step mean {w['step_ms']} ms sigma {w['sigma']}, "
        f"{w['slow_fraction']:.0%} of them {w['slow_factor']:g}x slower; forward {w['forward_ms'][0]} ms + "
        f"{w['forward_ms'][1]} ms/item; chunk {w['action_chunk']}; update {w['update_ms']} ms per "
        f"{w['steps_per_update']} steps; {w['env_steps_per_mode']} env steps per mode.",
        "",
        f"Capacities (steps/s): simulator {caps['simulator']:.0f}, generator {caps['generator']:.0f}, "
        f"trainer {caps['trainer']:.0f}; bound {caps['bound']:.0f}.",
        "",
        "| mode | env steps/s | of bound | to the stop: of bound | mean batch | request p50 (ms) | dropped segments |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in out["modes"].items():
        lines.append(
            f"| {name} | {r['steps_per_s']:.0f} | {r['of_bound']:.2f} | {r['of_bound_to_stop']:.2f} | "
            f"{r['mean_batch']:.1f} | {r['request_latency_p50_ms']:.1f} | {r['dropped_segments']} |"
        )
    lines += [
        "",
        "(of bound: env steps in the ledger over the span of all chunks; to the stop: chunks that ended "
        "before the simulator learnt of the stop, over the time until then)",
    ]
    t, tr = out.get("targets"), out["transport"]
    lines.append("")
    if "async" in out["modes"]:
        r = out["modes"]["async"]
        d = r["decision_ms"]
        lines.append(
            f"- async: environments stepping {r['env_busy']:.0%} of the time; per decision (mean) "
            f"{d['request']:.1f} ms chunk end to batch start, {d['forward']:.1f} ms forward, "
            f"{d['reply']:.1f} ms batch end to chunk start, against {d['chunk']:.0f} ms per chunk; "
            f"chunks went on {r['after_stop_ms']:.0f} ms after the stop"
        )
    if t:
        lines.append(
            f"- async / sync = {t['async_over_sync']:.2f} (target >= 1.85): "
            f"{'met' if t['async_over_sync'] >= 1.85 else 'NOT met'}"
        )
        lines.append(
            f"- async / bound = {t['async_of_bound']:.2f} (target >= 0.92): "
            f"{'met' if t['async_of_bound'] >= 0.92 else 'NOT met'}"
        )
    lines.append(
        f"- transport round trip with a 224x224 image: {tr['image_224_round_trip_us']:.0f} us = "
        f"{tr['overhead_of_10ms_step']:.1%} of a 10 ms step (target <= 5%); state only: "
        f"{tr['state_only_round_trip_us']:.0f} us"
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12000, help="env steps per mode")
    parser.add_argument(
        "--max-wait-ms",
        type=float,
        default=0.0,
        help="rollout.batching.max_wait_ms (0: serve whatever waits once the generator is free)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("VLASLURM_TRACKING", "off")
    caps = capacities()
    load_at_start = os.getloadavg()[0]
    results: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vlaslurm-bench-") as tmp:
        if args.work_dir:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            tmp = str(args.work_dir)
        for name in args.modes.split(","):
            results[name] = measure(name, MODES[name], args.steps, args.max_wait_ms, Path(tmp))
            results[name]["of_bound"] = results[name]["steps_per_s"] / caps["bound"]
            results[name]["of_bound_to_stop"] = results[name]["steps_per_s_to_stop"] / caps["bound"]
            results[name].pop("run_dir")
            print(
                f"{name:>13}: {results[name]['steps_per_s']:7.0f} steps/s = {results[name]['of_bound']:.2f} "
                f"of the bound, mean batch {results[name]['mean_batch']:.1f}",
                flush=True,
            )
    out = {
        "workload": {
            "num_envs": NUM_ENVS,
            "step_ms": STEP_MS,
            "sigma": SIGMA,
            "slow_fraction": SLOW_FRACTION,
            "slow_factor": SLOW_FACTOR,
            "forward_ms": [FORWARD_BASE_MS, FORWARD_PER_ITEM_MS],
            "action_chunk": CHUNK,
            "steps_per_update": STEPS_PER_UPDATE,
            "update_ms": UPDATE_MS,
            "env_steps_per_mode": args.steps,
            "max_wait_ms": args.max_wait_ms,
        },
        "capacity_steps_per_s": caps,
        "modes": results,
        "transport": transport(),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m_at_end": os.getloadavg()[0],
            "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    if "async" in results and "sync" in results:
        out["targets"] = {
            "async_over_sync": results["async"]["steps_per_s"] / results["sync"]["steps_per_s"],
            "async_over_sync_target": 1.85,
            "async_of_bound": results["async"]["of_bound"],
            "async_of_bound_target": 0.92,
            "transport_of_step": out["transport"]["overhead_of_10ms_step"],
            "transport_of_step_target": 0.05,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime_modes.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / "runtime_modes.md").write_text(markdown(out))
    print(json.dumps(out.get("targets", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
