"""Step 3, collocated offload: peak GPU memory with and without offload, offload and onload times.

The runtime's own mechanism (vlaslurm/runtime/offload.py `Offloader`, as the roles build it: the trainer's policy
and AdamW state with gradients dropped, the generator's policy) moves a ~1B-parameter VLA (common.vla_1b_config)
trained in float32 with AdamW state (16 bytes a parameter) and its bf16 generator copy. One rollout phase (a
generator forward at batch 8) and one update (a trainer step), first both roles resident (`peak_without_gib`),
then taking turns (`peak_with_gib`: trainer off, generator forward, generator off, trainer on, trainer step).
Move times and bytes come from the Offloader's own `offload` / `onload` events.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Dict

import common

TOKENS = 16  # prompt length of the toy batches (the 256 patches come on top)


def build(step: common.Step, device: Any) -> Dict[str, Any]:
    import torch

    from vlaslurm.models.prismatic.release import build_vla

    torch.manual_seed(0)
    config = common.vla_1b_config(step.dry_run)
    generator = build_vla(config, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    trainer = build_vla(config, device=device, dtype=torch.float32)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    gen_batch = common.vla_batch(generator.eval(), 2 if step.dry_run else 8, TOKENS, device)
    train_batch = common.vla_batch(trainer, 2, TOKENS, device)

    def rollout() -> None:
        with torch.inference_mode():
            generator(**gen_batch)

    def update() -> None:
        opt.zero_grad(set_to_none=True)
        trainer(**train_batch).float().logsumexp(-1).mean().backward()
        opt.step()

    return {"generator": generator, "trainer": trainer, "opt": opt, "rollout": rollout, "update": update}


def body(step: common.Step, device: Any) -> None:
    from vlaslurm.rundir import EventLog, read_events
    from vlaslurm.runtime.offload import Offloader

    parts = build(step, device)
    rollout: Callable[[], None] = parts["rollout"]
    update: Callable[[], None] = parts["update"]
    step.set("parameters", common.count(parts["trainer"]))
    update()  # AdamW's state exists from here on
    common.sync(device)
    step.set("trainer_resident_gib", common.allocated_gib(device))

    common.reset_peak(device)
    rollout()
    update()
    step.set("peak_without_gib", common.peak_gib(device))

    run_dir = Path(tempfile.mkdtemp(prefix="gpu-offload-"))
    trainer_events, generator_events = EventLog(run_dir, "trainer", 0), EventLog(run_dir, "generator", 0)
    clock = lambda: 0.0  # noqa: E731  (the events' own `s` holds the measured seconds)
    trainer = Offloader(
        True, device, trainer_events, clock, module=parts["trainer"], optimizer=parts["opt"], drop_grads=True
    )
    generator = Offloader(True, device, generator_events, clock, module=parts["generator"])
    common.reset_peak(device)
    trainer.offload(1)
    step.set("after_trainer_offload_gib", allocated_gib_and_reserved(device))
    rollout()
    generator.offload(1)
    trainer.onload(2)
    update()
    generator.onload(2)
    step.set("peak_with_gib", common.peak_gib(device))
    step.set("moves", [move(e) for e in read_events(run_dir)])
    without, with_ = step.data["peak_without_gib"], step.data["peak_with_gib"]
    if without and with_:
        step.set("saved_gib", without - with_)


def allocated_gib_and_reserved(device: Any) -> Dict[str, Any]:
    import torch

    reserved = torch.cuda.memory_reserved(device) / common.GIB if device.type == "cuda" else None
    return {"allocated": common.allocated_gib(device), "reserved": reserved}


def move(event: Dict[str, Any]) -> Dict[str, Any]:
    role = Path(str(event.get("role", ""))).name or None
    seconds, size = event["s"], event["bytes"]
    return {
        "role": role,
        "kind": event["ev"],
        "what": event["what"],
        "bytes": size,
        "s": seconds,
        "GBps": size / seconds / 1e9 if seconds else None,
        "to": event["to"],
    }


if __name__ == "__main__":
    raise SystemExit(common.main("offload", 45.0, body))
