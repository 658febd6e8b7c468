"""Batched forward latency, throughput and peak memory of the full-size OpenVLA and OpenVLA-OFT, on one GPU.

    python benchmarks/gpu_vla_forward.py [--batches 1 8 32 64] [--budget-s 75] [--out benchmarks/results]
    python benchmarks/gpu_vla_forward.py --tiny --batches 1 2 --out /tmp/x    # the same code on CPU, tiny config

The models are the classes a released checkpoint loads into (vlaslurm/models/prismatic), at openvla-7b's
configuration (config.json fields below; 7,541,237,184 parameters), randomly initialised directly in bf16 on the
GPU (`build_vla(config, device="cuda")`: nothing is materialised on the CPU). OpenVLA-OFT is the same VLA (the
OFT releases fine-tune openvla-7b, the architecture is unchanged) plus the L1 regression head and the proprio
projector at LIBERO's shapes (chunk 8 x 7 dims, proprio 8, 2 cameras); the benchmark builds the VLA once and
adds the heads, so both fit in one build (7,709,173,191 parameters in all).

What one policy decision costs, per model, at each batch size (all samples the same length, no padding):
- openvla: the multimodal prefill (towers, projector, Llama over <bos> + 256 patches + the prompt, KV cache on)
  and then the 7-token greedy decode with that cache (one token per step, batched): `prefill_ms` and
  `decision_ms` (prefill + decode). One decision = one 7-dim action.
- openvla-oft: the one parallel pass (2 cameras through the towers, the proprio token, the 56 zeroed action
  placeholders, bidirectional attention: prismatic/oft.py `oft_embeddings` + `bidirectional_hidden_states`) and
  the L1 head: `decision_ms`. One decision = a chunk of 8 actions.
Latencies are medians over `--iters` timed iterations after `--warmup` (CUDA synchronised around each phase,
under torch.inference_mode, SDPA attention). `peak_gib` is torch.cuda.max_memory_allocated over that batch's
iterations (weights included). Batches run smallest first, the two models interleaved; before each one the time
it would take is estimated from the previous batch, and it is skipped (`skipped: budget`) when it would end past
`--budget-s` from the script's start, so the script stops early rather than overrun (the GPU verification issue
gives it 90 s on one H200). A batch that runs out of memory is recorded as `oom` and the larger ones skipped.

Results: <out>/gpu_vla_forward.{json,md} (`--tiny`: gpu_vla_forward_tiny.*); the table is printed as well.
Without CUDA (and without --tiny) the script exits with code 2: the 7B models never run on a CPU. Code 3: a
Python package vlaslurm imports is missing (it runs from a plain checkout; torch, transformers, accelerate,
safetensors, tokenizers, Pillow, numpy, PyYAML and omegaconf are needed).
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here, before the heavy imports

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a plain checkout (the GPU machine has no editable install)
    sys.path.insert(0, str(REPO))

NAME = "gpu_vla_forward"
EXIT_NO_CUDA = 2
EXIT_MISSING_PACKAGE = 3
DEFAULT_BATCHES = (1, 8, 32, 64)
DEFAULT_BUDGET_S = 75.0  # of the 90 s the GPU verification issue allows: imports and CUDA start come first
PROMPT_TOKENS = 32  # `<bos> In: What action should the robot take to {a LIBERO instruction}?\nOut: ▁`
OFT_CHUNK, OFT_ACTION_DIM, OFT_PROPRIO_DIM, OFT_CAMERAS = 8, 7, 8, 2  # LIBERO's constants
OPENVLA_ACTION_DIM = 7
# openvla-7b's config.json fields that decide the architecture (facts sheet section 2); norm_stats are not needed.
OPENVLA_7B_CONFIG: Dict[str, Any] = {
    "arch_specifier": "no-align+fused-gelu-mlp",
    "image_sizes": [224, 224],
    "model_type": "openvla",
    "n_action_bins": 256,
    "pad_to_multiple_of": 64,
    "text_config": {"model_type": "llama", "pad_token_id": 32000, "torch_dtype": "bfloat16", "vocab_size": 32064},
    "timm_model_ids": ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
    "timm_override_act_layers": [None, None],
    "use_fused_vision_backbone": True,
    "vision_backbone_id": "dinosiglip-vit-so-224px",
}
MODELS = ("openvla", "openvla-oft")


class BudgetSkip(Exception):
    """A batch that would end past the time budget."""


# --- the models ----------------------------------------------------------------------------------------------


def build_models(tiny: bool, device: torch.device, dtype: torch.dtype) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    """(vla, l1 head, proprio projector, facts) built randomly initialised on `device` in `dtype`."""
    from vlaslurm.models.common import count_parameters as count
    from vlaslurm.models.prismatic.oft import L1RegressionActionHead, ProprioProjector
    from vlaslurm.models.prismatic.release import build_vla, default_dtype, parse_release_config, tiny_release_config

    config = tiny_release_config() if tiny else parse_release_config(OPENVLA_7B_CONFIG, "openvla-7b config.json")
    vla = build_vla(config, device=device, dtype=dtype).eval()
    llm_dim = vla.language_model.config.hidden_size
    with default_dtype(dtype), device:  # created where they run, in their dtype, as the VLA
        head = L1RegressionActionHead(llm_dim, OFT_ACTION_DIM).eval()
        projector = ProprioProjector(llm_dim, OFT_PROPRIO_DIM).eval()
    vla_params = count(vla)
    llm_params = count(vla.language_model)
    facts = {
        "config": config.source,
        "parameters": {
            "openvla": vla_params,
            "openvla-oft": vla_params + count(head) + count(projector),
            "language_model": llm_params,
            "l1_head": count(head),
            "proprio_projector": count(projector),
        },
        "attn_implementation": getattr(vla.language_model.config, "_attn_implementation", None),
    }
    return vla, head, projector, facts


def prompt_ids(batch: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """[B, PROMPT_TOKENS] ids shaped as the release's prompt: <bos>, ordinary Llama-2 ids, then `▁` (29871)."""
    from vlaslurm.models.prismatic.preprocess import BOS_ID, EMPTY_TOKEN_ID

    body = torch.randint(259, 29000, (batch, PROMPT_TOKENS - 2), generator=generator)
    ids = torch.cat([torch.full((batch, 1), BOS_ID), body, torch.full((batch, 1), EMPTY_TOKEN_ID)], dim=1)
    return ids.to(device)


def logits_kwargs(language_model: torch.nn.Module) -> Dict[str, int]:
    """Compute the prefill's logits at the last position only, where this transformers can (`generate` does)."""
    parameters = inspect.signature(language_model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return {name: 1}
    return {}


def openvla_step(vla: Any, batch: int, device: torch.device, generator: torch.Generator) -> Callable[[], List[float]]:
    """One batched decision of OpenVLA: (prefill seconds, decision seconds)."""
    from vlaslurm.models.prismatic.vla import CACHE_ARG

    size = vla.vision_backbone.featurizer.cfg.image_size
    pixels = torch.randn(batch, 6, size, size, generator=generator).to(device, vla.dtype)
    ids = prompt_ids(batch, device, generator)
    keep = logits_kwargs(vla.language_model)

    def step() -> List[float]:
        start = now(device)
        embeddings, _ = vla.multimodal_inputs(pixels, ids)
        out = vla.language_model(inputs_embeds=embeddings, use_cache=True, **keep)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        prefill = now(device)
        for _ in range(OPENVLA_ACTION_DIM - 1):  # the release decodes 7 tokens: 1 from the prefill + 6 steps
            out = vla.language_model(input_ids=token, use_cache=True, **{CACHE_ARG: getattr(out, CACHE_ARG)})
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        end = now(device)
        return [prefill - start, end - start]

    return step


def oft_step(
    vla: Any, head: Any, projector: Any, batch: int, device: torch.device, generator: torch.Generator
) -> Callable[[], List[float]]:
    """One batched decision of OpenVLA-OFT (parallel pass + L1 head): (decision seconds,)."""
    from vlaslurm.models.prismatic.oft import action_hidden_states, bidirectional_hidden_states, oft_embeddings
    from vlaslurm.models.prismatic.preprocess import oft_query_ids

    size = vla.vision_backbone.featurizer.cfg.image_size
    pixels = torch.randn(batch, 6 * OFT_CAMERAS, size, size, generator=generator).to(device, vla.dtype)
    proprio = (torch.rand(batch, OFT_PROPRIO_DIM, generator=generator) * 2 - 1).to(device, vla.dtype)
    prompt = prompt_ids(1, torch.device("cpu"), generator)[0].tolist()
    query, num_prompt_tokens = oft_query_ids(prompt, OFT_ACTION_DIM, OFT_CHUNK)
    ids = torch.tensor([query] * batch, dtype=torch.long, device=device)
    slots = OFT_CHUNK * OFT_ACTION_DIM

    def step() -> List[float]:
        start = now(device)
        embeddings, num_patches = oft_embeddings(vla, pixels, ids, slots, projector(proprio))
        hidden = bidirectional_hidden_states(vla, embeddings)
        actions = head(action_hidden_states(hidden, num_patches, num_prompt_tokens, slots))
        end = now(device)
        assert actions.shape == (batch, OFT_CHUNK, OFT_ACTION_DIM)
        return [end - start]

    return step


def sequence_length(model: str) -> int:
    """Positions the LLM attends over in one prefill / parallel pass."""
    patches = 256
    if model == "openvla":
        return PROMPT_TOKENS + patches
    return PROMPT_TOKENS + OFT_CAMERAS * patches + 1 + OFT_CHUNK * OFT_ACTION_DIM + 1  # + proprio, slots, </s>


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- measuring -----------------------------------------------------------------------------------------------


def measure(
    model: str,
    batch: int,
    step: Callable[[], List[float]],
    args: argparse.Namespace,
    device: torch.device,
    llm_params: int,
    estimate_s: Optional[float],
) -> Dict[str, Any]:
    """Warm up, time `args.iters` calls of `step`, and summarise them as one result row."""
    elapsed = time.monotonic() - T0
    if elapsed + (estimate_s or 0.0) > args.budget_s:
        raise BudgetSkip(
            f"{elapsed:.1f} s spent, about {estimate_s or 0.0:.1f} s more would pass the {args.budget_s:.0f} s budget"
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.monotonic()
    with torch.inference_mode():
        for _ in range(args.warmup):
            step()
        timings = [step() for _ in range(args.iters)]
    wall = time.monotonic() - began
    decision_s = statistics.median(t[-1] for t in timings)
    seq = sequence_length(model)
    actions_per_decision = 1 if model == "openvla" else OFT_CHUNK
    row: Dict[str, Any] = {
        "model": model,
        "batch": batch,
        "status": "ok",
        "seq_len": seq,
        "decision_ms": 1000 * decision_s,
        "decision_ms_all": [1000 * t[-1] for t in timings],
        "decisions_per_s": batch / decision_s,
        "env_actions_per_s": batch * actions_per_decision / decision_s,
        "wall_s": wall,
    }
    prefill_s = statistics.median(t[0] for t in timings) if model == "openvla" else decision_s
    row["prefill_ms"] = 1000 * prefill_s
    row["prefill_tokens_per_s"] = batch * seq / prefill_s
    # Dense LLM matmul work of the prefill / parallel pass (2 x parameters x tokens; towers and attention aside).
    row["llm_tflops"] = 2 * llm_params * batch * seq / prefill_s / 1e12
    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return row


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    build_began = time.monotonic()
    vla, head, projector, facts = build_models(args.tiny, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.monotonic() - build_began
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(f"built {facts['parameters']['openvla-oft']:,} parameters in {build_s:.1f} s", flush=True)
    llm_params = facts["parameters"]["language_model"]
    rows: List[Dict[str, Any]] = []
    last: Dict[str, Tuple[int, float]] = {}  # model -> (batch, seconds per iteration) of its last measured batch
    stopped: Dict[str, str] = {}  # model -> why its larger batches are not measured
    for batch in args.batches:
        for model in args.models:
            if model in stopped:
                rows.append({"model": model, "batch": batch, "status": stopped[model]})
                continue
            estimate = None
            if model in last:
                prev_batch, per_iter = last[model]
                estimate = per_iter * max(1.0, batch / prev_batch) * (args.warmup + args.iters)
            oom: Optional[str] = None
            step: Optional[Callable[[], List[float]]] = None
            try:
                if model == "openvla":
                    step = openvla_step(vla, batch, device, generator)
                else:
                    step = oft_step(vla, head, projector, batch, device, generator)
                row = measure(model, batch, step, args, device, llm_params, estimate)
            except BudgetSkip as why:
                stopped[model] = "skipped: budget"
                rows.append({"model": model, "batch": batch, "status": "skipped: budget", "why": str(why)})
                continue
            except torch.cuda.OutOfMemoryError as err:
                oom = str(err).splitlines()[0] if str(err) else "out of memory"
            finally:
                step = None  # drop this batch's inputs before the next one is built
            if oom is not None:
                stopped[model] = "skipped: oom at a smaller batch"
                rows.append({"model": model, "batch": batch, "status": "oom", "why": oom})
                torch.cuda.empty_cache()
                continue
            last[model] = (batch, row["wall_s"] / (args.warmup + args.iters))
            rows.append(row)
            print(describe(row), flush=True)
    return {
        "meta": meta(args, device, dtype, facts, build_s, weights_gib),
        "rows": rows,
        "total_s": time.monotonic() - T0,
        "stopped_early": any(r["status"] != "ok" for r in rows),
    }


def describe(row: Dict[str, Any]) -> str:
    return (
        f"{row['model']} batch {row['batch']}: {row['decision_ms']:.1f} ms per decision, "
        f"{row['decisions_per_s']:.1f} decisions/s, peak {fmt(row['peak_gib'], '.1f')} GiB"
    )


def meta(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    facts: Dict[str, Any],
    build_s: float,
    weights_gib: Optional[float],
) -> Dict[str, Any]:
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "tiny": args.tiny,
        "device": str(device),
        "gpu": gpu,
        "host": platform.node(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batches": list(args.batches),
        "warmup": args.warmup,
        "iters": args.iters,
        "budget_s": args.budget_s,
        "prompt_tokens": PROMPT_TOKENS,
        "oft_shape": {"chunk": OFT_CHUNK, "action_dim": OFT_ACTION_DIM, "proprio_dim": OFT_PROPRIO_DIM},
        "oft_cameras": OFT_CAMERAS,
        "build_s": build_s,
        "weights_gib": weights_gib,
        **facts,
    }


# --- the report ----------------------------------------------------------------------------------------------


def fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(results: Dict[str, Any]) -> str:
    m = results["meta"]
    where = m["gpu"] or m["device"]
    params = ", ".join(f"{k} {v:,}" for k, v in m["parameters"].items() if k in MODELS)
    lines = [
        f"# Batched VLA forward ({'tiny config' if m['tiny'] else 'full size'}, {where}, {m['dtype']})",
        "",
        f"Random-initialised {params} parameters, built in {m['build_s']:.1f} s "
        f"(weights {fmt(m['weights_gib'], '.1f')} GiB); torch {m['torch']}, transformers {m['transformers']}, "
        f"attention {m['attn_implementation']}. Prompt {m['prompt_tokens']} tokens; OFT: chunk "
        f"{m['oft_shape']['chunk']} x {m['oft_shape']['action_dim']}, proprio {m['oft_shape']['proprio_dim']}, "
        f"{m['oft_cameras']} cameras. Medians of {m['iters']} iterations after {m['warmup']} warm-up; "
        f"{results['total_s']:.0f} s in all (budget {m['budget_s']:.0f} s).",
        "",
        "| model | batch | seq | prefill (ms) | decision (ms) | decisions/s | env actions/s | LLM TFLOP/s "
        "| peak (GiB) | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['batch']} | | | | | | | | {r['status']} |")
            continue
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['seq_len']} | {r['prefill_ms']:.1f} | {r['decision_ms']:.1f} "
            f"| {r['decisions_per_s']:.1f} | {r['env_actions_per_s']:.1f} | {r['llm_tflops']:.1f} "
            f"| {fmt(r['peak_gib'], '.1f')} | ok |"
        )
    lines += [
        "",
        "(openvla: prefill = towers + projector + Llama over the prompt with KV cache; decision = prefill + the "
        "6 further greedy decode steps of a 7-dim action. openvla-oft: decision = the one bidirectional pass + L1 "
        "head, a chunk of 8 actions. LLM TFLOP/s = 2 x LLM parameters x batch x seq / prefill time.)",
    ]
    return "\n".join(lines) + "\n"


def write(results: Dict[str, Any], out: Path, tiny: bool) -> Tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{NAME}_tiny" if tiny else NAME
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(table(results))
    return json_path, md_path


# --- the command ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or NAME).splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES))
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per batch")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per batch (the median counts)")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="skip batches that would end later than this"
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny release config, on the CPU in float32")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder for the results")
    args = parser.parse_args(argv)
    if any(b <= 0 for b in args.batches) or args.iters <= 0 or args.warmup < 0:
        parser.error("batches and --iters must be positive, --warmup non-negative")
    args.batches = sorted(set(args.batches))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import vlaslurm.models.prismatic.oft  # noqa: F401  (vlaslurm's package imports, e.g. omegaconf via spec)
    except ModuleNotFoundError as err:
        print(
            f"gpu_vla_forward: Python package {err.name!r} is missing; install vlaslurm's dependencies "
            "(pip install -e .), or on a machine without network bring their wheels (a GPU image with torch and "
            "transformers typically lacks omegaconf and antlr4-python3-runtime).",
            file=sys.stderr,
        )
        return EXIT_MISSING_PACKAGE
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print(
            "gpu_vla_forward: no CUDA device. This benchmark builds the full-size 7.5B OpenVLA / OpenVLA-OFT in bf16 "
            "on a GPU and never runs them on the CPU; run it on a GPU machine, or pass --tiny to test the script "
            "here with the tiny release config.",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    else:
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    results = run(args, device, dtype)
    json_path, md_path = write(results, args.out, args.tiny)
    print()
    print(table(results), end="")
    print(f"\nwrote {json_path} and {md_path} ({results['total_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
