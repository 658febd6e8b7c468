"""What one PPO minibatch step of the quickstart's random-init policy costs, with its token embeddings frozen (the
default) and trained (`build_tiny(..., train_embeddings=True)`), in one process, one thread, measured in one run.

The step is what the learners do per minibatch: `evaluate` of 128 stored decisions (quickstart shapes: one 32-px
camera, state 10, chunk 4, 2-dim actions), backward of a log-prob and value loss, gradient clipping, Adam.

    python benchmarks/tiny_update_cost.py [--batch 128] [--steps 20]

Writes benchmarks/results/tiny_update_cost.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from vlaslurm.models import PolicyInput
from vlaslurm.models.vla.tiny import build_tiny
from vlaslurm.spec.model_types import BackboneConfig

RESULTS = Path(__file__).resolve().parent / "results" / "tiny_update_cost.md"
WORDS = ("red", "blue", "green", "yellow", "purple")


def step_ms(train_embeddings: bool, batch: int, steps: int) -> Dict[str, float]:
    policy = build_tiny(
        "openvla-oft",
        BackboneConfig(),
        action_chunk=4,
        action_dim=2,
        state_dim=10,
        image_size=32,
        num_cameras=1,
        seed=0,
        train_embeddings=train_embeddings,
    )
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=3e-4, eps=1e-5)
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (batch, 1, 32, 32, 3), dtype=np.uint8))
    state = torch.from_numpy(rng.standard_normal((batch, 10)).astype(np.float32))
    inp = PolicyInput(images, state, [f"reach the {WORDS[i % 5]} square" for i in range(batch)])
    actions = torch.randn(batch, 4, 2)
    times = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        ev = policy.evaluate(inp, actions)
        loss = -ev.logprob.mean() + ev.value.pow(2).mean()
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        t3 = time.perf_counter()
        if i >= 2:
            for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key] += seconds * 1e3 / steps
    return {**times, "total": sum(times.values()), "trained_params": float(sum(p.numel() for p in params))}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {name: step_ms(flag, args.batch, args.steps) for name, flag in (("frozen", False), ("trained", True))}
    lines = [
        "# One PPO minibatch step of the random-init openvla-oft: token embeddings frozen vs trained",
        "",
        f"Written by `benchmarks/tiny_update_cost.py` (batch {args.batch}, mean of {args.steps} steps after 2 "
        "warm-up steps, 1 thread, both in one run; a shared 2-core machine).",
        "",
        "| embeddings | trained parameters | forward ms | backward ms | clip + Adam ms | total ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['trained_params']:,.0f} | {r['forward']:.1f} | {r['backward']:.1f} | "
            f"{r['optimizer']:.1f} | {r['total']:.1f} |"
        )
    ratio = rows["frozen"]["total"] / rows["trained"]["total"]
    lines += ["", f"Frozen / trained step time: {ratio:.2f}."]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
