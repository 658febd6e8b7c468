"""What the steps of the GPU verification (benchmarks/gpu/run.sh) share: arguments, the results file, timers.

Each step is one script: `python benchmarks/gpu/<step>.py --out DIR [--dry-run] [--budget-s S]`. It records its
figures under `steps.<name>` of DIR/gpu.json as soon as it has them (read, merge, atomic replace), so a step killed
at its time limit keeps what it measured, and a failure is recorded as that step's `error` instead of stopping the
run. `--dry-run` runs the same code at toy size on the CPU.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # a step's budget counts from its start, the imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO, REPO / "benchmarks"):  # vlaslurm and gpu_vla_forward from a plain checkout (no install there)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

RESULTS = "gpu.json"
# Packages the GPU image lacks (they travel as wheels in .whl/, see README.md) or that are optional there; each
# step records which of them it imported.
WATCHED = ("omegaconf", "zmq", "cryptography", "mlflow", "submitit", "gymnasium", "timm", "mani_skill")
GIB = 2**30


def parse_args(default_budget_s: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="folder of gpu.json")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    parser.add_argument("--budget-s", type=float, default=default_budget_s, help="soft limit; run.sh kills later")
    return parser.parse_args()


def read_results(out: Path) -> Dict[str, Any]:
    try:
        return json.loads((out / RESULTS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_results(out: Path, results: Dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RESULTS}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    os.replace(tmp, out / RESULTS)


class Step:
    """One step's section of gpu.json, written again after every change."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.out, self.dry_run, self.budget_s = name, args.out, args.dry_run, args.budget_s
        self.data: Dict[str, Any] = {"status": "running", "dry_run": self.dry_run, "budget_s": self.budget_s}
        self.flush()

    def set(self, key: str, value: Any) -> Any:
        self.data[key] = value
        self.flush()
        return value

    def flush(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - T0, 2)
        self.data["imported"] = sorted(m for m in WATCHED if m in sys.modules)
        results = read_results(self.out)
        results.setdefault("steps", {})[self.name] = self.data
        write_results(self.out, results)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - T0)

    @contextlib.contextmanager
    def part(self, key: str) -> Iterator[Dict[str, Any]]:
        """A sub-measurement stored under `key`: an exception there is recorded as its `error`, the step goes on."""
        figures: Dict[str, Any] = {}
        self.data[key] = figures
        try:
            yield figures
        except Exception as err:  # noqa: BLE001  (recorded, never raised: the next part still runs)
            figures["error"] = describe_error(err)
        finally:
            self.flush()


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".strip()[:2000]


def main(name: str, default_budget_s: float, body: Callable[[Step, Any], None], needs_cuda: bool = True) -> int:
    """Run `body(step, device)`; record its status (ok / skipped / error) and never raise."""
    args = parse_args(default_budget_s)
    step = Step(name, args)
    try:
        body(step, pick_device(args.dry_run, needs_cuda))
        step.data["status"] = "ok"
    except Skip as why:
        step.data["status"] = "skipped"
        step.data["reason"] = str(why)
    except Exception as err:  # noqa: BLE001
        step.data["status"] = "error"
        step.data["error"] = describe_error(err)
        step.data["traceback"] = traceback.format_exc()[-4000:]
    step.flush()
    print(f"{name}: {step.data['status']} in {step.data['elapsed_s']:.1f} s", flush=True)
    return 0 if step.data["status"] in ("ok", "skipped") else 1


class Skip(Exception):
    """The step cannot run here (recorded as `skipped` with this reason)."""


# --- devices and timing -------------------------------------------------------------------------------------


def pick_device(dry_run: bool, needs_cuda: bool = True) -> Any:
    import torch

    if dry_run or (not needs_cuda and not torch.cuda.is_available()):
        torch.set_num_threads(1)  # toy sizes: a second thread only waits (seconds per op on a busy machine)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (run with --dry-run for the CPU rehearsal)")
    return torch.device("cuda", torch.cuda.current_device())


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any, iters: int = 3, warmup: int = 1) -> float:
    """Median seconds of `iters` calls of `fn` after `warmup` calls, device synchronised around each."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: List[float] = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: Any) -> Optional[float]:
    import torch

    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def allocated_gib(device: Any) -> Optional[float]:
    import torch

    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


# --- the ~1B-parameter VLA of the offload and trainer steps ---------------------------------------------------

# Full-width towers with fewer blocks, a TinyLlama-wide LLM: 1,075,802,672 parameters in all (the release's names).
VLA_1B_TOWERS = ({"depth": 6}, {"depth": 6})
VLA_1B_TEXT = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 14,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}


def vla_1b_config(dry_run: bool) -> Any:
    """The ~1B configuration (`--dry-run`: the tiny release config at 56 px, 16 patches) for build_vla."""
    import dataclasses

    from vlaslurm.models.prismatic.release import FUSED_TIMM_IDS, TINY_TEXT_CONFIG, ReleaseConfig, tiny_release_config

    if dry_run:
        return dataclasses.replace(tiny_release_config(), image_sizes=(56, 56))
    return ReleaseConfig(
        timm_model_ids=FUSED_TIMM_IDS,
        image_sizes=(224, 224),
        text_config={**TINY_TEXT_CONFIG, **VLA_1B_TEXT},
        tiny_timm_overrides=VLA_1B_TOWERS,
        source="benchmarks/gpu/common.py vla_1b_config()",
    )


def vla_batch(vla: Any, batch: int, tokens: int, device: Any) -> Dict[str, Any]:
    """Random pixel_values [B, 6, S, S] and input_ids [B, tokens] (starting with <bos>) for `vla`."""
    import torch

    size = vla.vision_backbone.featurizer.cfg.image_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(259, 29000, (batch, tokens), generator=generator)
    ids[:, 0] = 1
    pixels = torch.randn(batch, 6, size, size, generator=generator)
    return {"pixel_values": pixels.to(device, vla.dtype), "input_ids": ids.to(device)}


def count(module: Any) -> int:
    from vlaslurm.models.common import count_parameters  # lazily: the environment step imports no vlaslurm

    return count_parameters(module)
