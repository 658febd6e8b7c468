"""Step 1, environment: GPU model, driver, CUDA, NCCL, the torch build, free memory (torch, NVML, nvidia-smi)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from typing import Any, Dict

import common

SMI_FIELDS = "name,driver_version,memory.total,memory.used,memory.free,utilization.gpu,clocks.sm,clocks.max.sm"


def torch_facts(device: Any) -> Dict[str, Any]:
    import torch

    facts: Dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "debug_build": torch.version.debug,
        "nccl_available": torch.distributed.is_nccl_available(),
    }
    if facts["nccl_available"] and torch.cuda.is_available():
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        facts.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            total_gib=total / common.GIB,
            free_gib=free / common.GIB,
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return facts


def nvml_facts() -> Dict[str, Any]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return {
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_api": pynvml.nvmlSystemGetCudaDriverVersion(),
            "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "memory_total_gib": memory.total / common.GIB,
            "memory_used_gib": memory.used / common.GIB,
            "sm_util_percent": util.gpu,
            "memory_util_percent": util.memory,
        }
    finally:
        pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def smi_facts() -> Dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        raise common.Skip("nvidia-smi is not on the PATH")
    query = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"]
    line = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True).stdout.splitlines()[0]
    return dict(zip(SMI_FIELDS.split(","), (v.strip() for v in line.split(","))))


def body(step: common.Step, device: Any) -> None:
    step.set("host", {"python": platform.python_version(), "machine": platform.machine(), "node": platform.node()})
    step.set("torch", torch_facts(device))
    with step.part("nvml") as figures:
        figures.update(nvml_facts())
    with step.part("nvidia_smi") as figures:
        try:
            figures.update(smi_facts())
        except common.Skip as why:
            figures["skipped"] = str(why)


if __name__ == "__main__":
    raise SystemExit(common.main("environment", 20.0, body, needs_cuda=False))
