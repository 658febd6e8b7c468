"""Step 7, π0: chunk sampling latency of the full-size π0 (transformers' `PI0Config()` defaults: 3,501,372,176
parameters, chunks of 50 x 32) as vlaslurm's policy samples it (`PI0Policy.act`: the PaliGemma prefix once, then
K = 10 denoising passes of the action expert over its KV cache with one Flow-SDE step stochastic, then the critic's
expert pass), randomly initialised in bf16 on the GPU, at batches 1, 8 and 32 (2 cameras of 224 px and an 8-dim
state, LIBERO's shapes). Medians of 3 timed calls after 1 warm-up; larger batches are skipped when the time left
would not cover them. Skipped, with the reason, where the installed transformers has no PI0 (it came in 5.4.0;
the GPU image's 5.17 has it).
`--dry-run`: the tiny test configuration on the CPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List

import common

BATCHES = (1, 8, 32)
DENOISE_STEPS = 10  # π0's num_inference_steps
CAMERAS, IMAGE_SIZE, STATE_DIM, ACTION_DIM = 2, 224, 8, 7
WARMUP, ITERS = 1, 3


def build(device: Any, dry_run: bool) -> Any:
    import torch
    from transformers import PI0Config, PI0ForConditionalGeneration

    from vlaslurm.models.pi0.build import tiny_config
    from vlaslurm.models.pi0.flow import FlowSettings
    from vlaslurm.models.pi0.inputs import HashedWords
    from vlaslurm.models.pi0.policy import PI0Policy

    config = tiny_config(4, ACTION_DIM, STATE_DIM, DENOISE_STEPS) if dry_run else PI0Config()
    dtype = torch.float32 if dry_run else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        pi0 = PI0ForConditionalGeneration(config).to(dtype).eval()
    text = HashedWords(int(config.vlm_config.text_config.vocab_size))
    return PI0Policy(pi0, text, FlowSettings(denoise_steps=DENOISE_STEPS), ACTION_DIM, "expert")


def observations(batch: int, device: Any) -> Any:
    import torch

    from vlaslurm.models.base import PolicyInput

    generator = torch.Generator().manual_seed(batch)
    images = torch.randint(0, 256, (batch, CAMERAS, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, generator=generator)
    state = torch.rand(batch, STATE_DIM, generator=generator) * 2 - 1
    words = ["put the black bowl on the plate"] * batch
    return PolicyInput(images.to(device), state.to(device), words, seeds=torch.arange(batch))


def sample(policy: Any, batch: int, device: Any) -> Dict[str, Any]:
    import torch

    inp = observations(batch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def once() -> float:
        start = time.perf_counter()
        out = policy.act(inp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert out.actions.shape == (batch, policy.action_chunk, ACTION_DIM)
        return time.perf_counter() - start

    for _ in range(WARMUP):
        once()
    seconds = statistics.median(once() for _ in range(ITERS))
    return {
        "batch": batch,
        "status": "ok",
        "chunk_ms": 1000 * seconds,
        "chunks_per_s": batch / seconds,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def body(step: common.Step, device: Any) -> None:
    try:
        import transformers
        from transformers import PI0Config  # noqa: F401
    except ImportError as err:
        raise common.Skip(f"this transformers has no PI0 ({err}); carry transformers >= 5.4 in .whl/") from err
    began = time.monotonic()
    policy = build(device, step.dry_run)
    step.set("transformers", transformers.__version__)
    step.set("parameters", sum(p.numel() for p in policy.pi0.parameters()))
    step.set("build_s", time.monotonic() - began)
    step.set("denoise_steps", DENOISE_STEPS)
    rows: List[Dict[str, Any]] = []
    last_s = 0.0
    for batch in BATCHES:
        estimate = last_s * (WARMUP + ITERS) * batch / max(rows[-1]["batch"], 1) if rows else 0.0
        if rows and estimate > step.left_s():
            rows.append({"batch": batch, "status": f"skipped: about {estimate:.0f} s, {step.left_s():.0f} s left"})
            continue
        try:
            rows.append(sample(policy, batch, device))
            last_s = rows[-1]["chunk_ms"] / 1000
        except RuntimeError as err:  # out of memory: the larger batches would be too
            rows.append({"batch": batch, "status": f"error: {common.describe_error(err)}"})
            break
        step.set("rows", rows)
        step.flush()
    step.set("rows", rows)


if __name__ == "__main__":
    raise SystemExit(common.main("pi0", 45.0, body))
