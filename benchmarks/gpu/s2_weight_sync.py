"""Step 2, weight sync: the project's publishing paths (vlaslurm/runtime/weights.py) against the hardware's own.

Measured on one GPU, for state dicts of 0.5B, 3B and 7.5B bf16 parameters (Llama-shaped 4096 x 4096 tensors):
- `hardware`: device-to-device copy bandwidth (bytes copied per second; read + write is twice that), and pinned
  device->host / host->device bandwidth, each on one large buffer.
- `pinned`: the state dict device -> pinned host -> device, tensor by tensor; `fraction` = the time the pinned
  bandwidth allows / the time taken (goal >= 0.8).
- `pageable`: the same down to plain (pageable) host memory, as FilesystemPublisher's `.to("cpu")` does it.
- `nccl_packing`: the `nccl` publisher's bucket packing on the device (plan_buckets + one torch.cat per bucket), as
  a fraction of the device copy bandwidth; the broadcast itself needs a second GPU (`nccl_broadcast` says why not).
- `filesystem`: FilesystemPublisher.publish (device -> host, safetensors, fsync) then FilesystemSubscriber.poll
  onto the device, no goal. Sizes that would pass the budget are skipped with an estimate from the measured rate.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import common

SIZES = {"0.5B": 0.5e9, "3B": 3e9, "7.5B": 7.5e9}  # bf16 parameters
GOAL = 0.8
PATHS = ("pinned", "pageable", "nccl_packing", "filesystem")
NCCL_ONE_GPU = (
    "not measured: NCCL cannot put two ranks on one device, so the nccl publisher/subscriber pair needs 2+ GPUs; "
    "this script measures their bucket packing on the device and the host paths instead"
)


def scale(step: common.Step) -> Dict[str, Any]:
    if step.dry_run:  # toy sizes: 1/10,000 of the parameters, small tensors and buffers
        return {"factor": 1e-4, "chunk": 4096, "buffer_bytes": 2**22}
    return {"factor": 1.0, "chunk": 4096 * 4096, "buffer_bytes": 2**30}


def state_dict(n_params: int, chunk: int, device: Any) -> Dict[str, Any]:
    import torch

    sizes = [chunk] * (n_params // chunk) + ([n_params % chunk] if n_params % chunk else [])
    return {f"layer.{i}.weight": torch.empty(n, dtype=torch.bfloat16, device=device) for i, n in enumerate(sizes)}


def nbytes(tensors: Dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def hardware(step: common.Step, device: Any, buffer_bytes: int) -> Dict[str, float]:
    import torch

    pin = device.type == "cuda"
    src = torch.empty(buffer_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin)
    d2d = common.timed(lambda: dst.copy_(src), device, iters=5)
    d2h = common.timed(lambda: host.copy_(src, non_blocking=pin), device, iters=5)
    h2d = common.timed(lambda: src.copy_(host, non_blocking=pin), device, iters=5)
    return {
        "buffer_bytes": buffer_bytes,
        "pinned": pin,
        "d2d_GBps": buffer_bytes / d2d / 1e9,
        "d2h_GBps": buffer_bytes / d2h / 1e9,
        "h2d_GBps": buffer_bytes / h2d / 1e9,
    }


def host_round_trip(tensors: Dict[str, Any], device: Any, pinned: bool) -> Dict[str, float]:
    """Seconds down to host memory and back up, tensor by tensor (buffers allocated beforehand)."""
    import torch

    pin = pinned and device.type == "cuda"
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in tensors.items()}
    common.sync(device)
    start = time.perf_counter()
    for k, t in tensors.items():
        host[k].copy_(t, non_blocking=pin)
    common.sync(device)
    down = time.perf_counter()
    for k, t in tensors.items():
        t.copy_(host[k], non_blocking=pin)
    common.sync(device)
    return {"d2h_s": down - start, "h2d_s": time.perf_counter() - down}


def nccl_packing(tensors: Dict[str, Any], device: Any) -> float:
    """Seconds of BroadcastPublisher's packing: one flat buffer per bucket, on the device."""
    import torch

    from vlaslurm.runtime.weights import DEFAULT_BUCKET_BYTES, manifest_of, plan_buckets

    buckets = plan_buckets(manifest_of(tensors), DEFAULT_BUCKET_BYTES)
    common.sync(device)
    start = time.perf_counter()
    for bucket in buckets:
        torch.cat([tensors[n].reshape(-1) for n in bucket.names])
    common.sync(device)
    return time.perf_counter() - start


def filesystem(tensors: Dict[str, Any], device: Any, folder: Path) -> Dict[str, float]:
    from vlaslurm.runtime.weights import FilesystemPublisher, FilesystemSubscriber

    publisher = FilesystemPublisher(folder, keep=2)
    subscriber = FilesystemSubscriber(folder, device, check_interval_s=0.0)
    start = time.perf_counter()
    publisher.publish(0, tensors)
    published = time.perf_counter()
    got = subscriber.poll()
    common.sync(device)
    if got is None or len(got[1]) != len(tensors):
        raise RuntimeError("FilesystemSubscriber did not deliver the published version")
    return {"publish_s": published - start, "load_s": time.perf_counter() - published}


def body(step: common.Step, device: Any) -> None:
    import torch

    s = scale(step)
    step.set("devices", torch.cuda.device_count())
    step.set(
        "nccl_broadcast",
        NCCL_ONE_GPU
        if torch.cuda.device_count() < 2
        else "not measured: this script has no two-process broadcast yet (2+ GPUs present)",
    )
    hw = step.set("hardware", hardware(step, device, s["buffer_bytes"]))
    expected_pinned_s = lambda b: b / (hw["d2h_GBps"] * 1e9) + b / (hw["h2d_GBps"] * 1e9)  # noqa: E731
    rates: Dict[str, float] = {}  # path -> seconds per byte of the last size measured, for the budget estimates
    scratch = Path(tempfile.mkdtemp(prefix="gpu-weights-"))
    sizes: Dict[str, Any] = step.data.setdefault("sizes", {})
    try:
        for path in PATHS:  # path by path, so that the slow filesystem path cannot starve the others
            for label, params in SIZES.items():
                n = int(params * s["factor"])
                tensors = state_dict(n, s["chunk"], device)
                row: Dict[str, Any] = sizes.setdefault(label, {"params": n, "bytes": nbytes(tensors)})
                with step.part("_current") as figures:
                    estimate = rates.get(path, 0.0) * row["bytes"]
                    if estimate > step.left_s() - 3:
                        figures.update(status="skipped: budget", estimate_s=estimate)
                    else:
                        began = time.perf_counter()  # the estimate counts the buffers' allocation too
                        figures.update(measure(path, tensors, device, scratch, row["bytes"], hw, expected_pinned_s))
                        rates[path] = (time.perf_counter() - began) / row["bytes"]
                row[path] = step.data.pop("_current")
                step.flush()
                del tensors
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(
    path: str, tensors: Dict[str, Any], device: Any, scratch: Path, size: int, hw: Dict[str, float], expected: Any
) -> Dict[str, Any]:
    if path in ("pinned", "pageable"):
        times = host_round_trip(tensors, device, pinned=path == "pinned")
        seconds = times["d2h_s"] + times["h2d_s"]
        fraction = expected(size) / seconds
        row = {**times, "seconds": seconds, "GBps": 2 * size / seconds / 1e9, "fraction_of_pinned": fraction}
        return {**row, "goal": GOAL, "meets_goal": fraction >= GOAL} if path == "pinned" else row
    if path == "nccl_packing":
        seconds = nccl_packing(tensors, device)
        fraction = size / (hw["d2d_GBps"] * 1e9) / seconds
        return {"seconds": seconds, "GBps": size / seconds / 1e9, "fraction_of_d2d": fraction}
    folder = scratch / f"v{size}"
    try:
        times = filesystem(tensors, device, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = times["publish_s"] + times["load_s"]
    return {**times, "seconds": seconds, "GBps": size / seconds / 1e9, "goal": None}


if __name__ == "__main__":
    raise SystemExit(common.main("weight_sync", 60.0, body))
