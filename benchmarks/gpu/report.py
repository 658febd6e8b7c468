"""gpu.json's header and gpu.md, for benchmarks/gpu/run.sh.

python report.py init --out DIR --commit SHA [--dry-run]   # a fresh gpu.json: date, commit, machine
python report.py mark --out DIR STEP RC BUDGET             # a step that died without saying how (timeout, crash)
python report.py md --out DIR                              # gpu.md from gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import common

BASE_KEYS = {"status", "dry_run", "budget_s", "elapsed_s", "imported", "error", "traceback", "reason"}
STEPS = ("environment", "weight_sync", "offload", "models", "trainer", "maniskill", "pi0")


def init(out: Path, commit: str, dry_run: bool) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"date": now, "commit": commit, "host": platform.node(), "dry_run": dry_run}
    common.write_results(out, {"meta": meta, "steps": {}})


def mark(out: Path, step: str, rc: int, budget: str) -> None:
    results = common.read_results(out)
    data = results.setdefault("steps", {}).setdefault(step, {})
    if data.get("status") in (None, "running"):
        data["status"] = f"timeout after {budget} s" if rc in (124, 137) else f"crashed (exit {rc})"
        common.write_results(out, results)


def f(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def table(header: List[str], rows: List[List[Any]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def environment(d: Dict[str, Any]) -> List[str]:
    t, nvml, smi = d.get("torch", {}), d.get("nvml", {}), d.get("nvidia_smi", {})
    return table(
        ["what", "value"],
        [
            [
                "GPU",
                f"{t.get('gpu') or nvml.get('name') or '–'} (capability {t.get('capability', '–')}, "
                f"{t.get('multiprocessors', '–')} SMs), {t.get('device_count')} visible",
            ],
            ["driver", nvml.get("driver") or smi.get("driver_version") or "–"],
            [
                "torch / CUDA build / NCCL / cuDNN",
                f"{t.get('torch')} / {t.get('cuda_build')} / {t.get('nccl', '–')} / {t.get('cudnn')}",
            ],
            ["memory free / total (GiB)", f"{f(t.get('free_gib'))} / {f(t.get('total_gib'))}"],
            ["nvidia-smi", ", ".join(f"{k} {v}" for k, v in smi.items()) or "–"],
            ["NVML", nvml.get("error") or ", ".join(f"{k} {f(v)}" for k, v in nvml.items() if k != "name")],
        ],
    )


def weight_sync(d: Dict[str, Any]) -> List[str]:
    hw = d.get("hardware", {})
    lines = [
        f"Hardware (one {hw.get('buffer_bytes', 0) / 2**20:.0f} MiB buffer; pinned: {hw.get('pinned')}): "
        f"device copy {f(hw.get('d2d_GBps'), '.1f')} GB/s (bytes copied; read + write is twice), "
        f"device->host {f(hw.get('d2h_GBps'), '.1f')} GB/s, host->device {f(hw.get('h2d_GBps'), '.1f')} GB/s. "
        f"nccl broadcast: {d.get('nccl_broadcast', '–')}.",
        "",
    ]
    rows = []
    for label, row in d.get("sizes", {}).items():
        for path, key in (
            ("pinned", "fraction_of_pinned"),
            ("pageable", "fraction_of_pinned"),
            ("nccl_packing", "fraction_of_d2d"),
            ("filesystem", None),
        ):
            p = row.get(path, {})
            status = p.get("error") or p.get("status") or "ok"
            goal = f"{p['goal']:.0%}: {'met' if p.get('meets_goal') else 'NOT met'}" if p.get("goal") else "–"
            fraction = f(p.get(key), ".0%") if key else "–"
            rows.append(
                [
                    label,
                    f(row.get("bytes", 0) / 1e9, ".2f"),
                    path,
                    f(p.get("seconds"), ".3f"),
                    f(p.get("GBps"), ".1f"),
                    fraction,
                    goal,
                    status,
                ]
            )
    return lines + table(["params", "GB", "path", "sync s", "GB/s", "of its bandwidth", "goal", "status"], rows)


def offload(d: Dict[str, Any]) -> List[str]:
    after = d.get("after_trainer_offload_gib", {})
    lines = table(
        ["what", "GiB"],
        [
            ["trainer resident (weights + AdamW state)", f(d.get("trainer_resident_gib"))],
            ["peak without offload (both roles resident)", f(d.get("peak_without_gib"))],
            ["peak with offload (taking turns)", f(d.get("peak_with_gib"))],
            ["saved", f(d.get("saved_gib"))],
            [
                "after the trainer's offload: allocated / reserved",
                f"{f(after.get('allocated'))} / {f(after.get('reserved'))}",
            ],
        ],
    )
    moves = [
        [m["role"], m["kind"], "+".join(m["what"]), f(m["bytes"] / 1e9), f(m["s"], ".3f"), f(m["GBps"], ".1f")]
        for m in d.get("moves", [])
    ]
    return (
        [f"{d.get('parameters', 0):,} parameters.", ""]
        + lines
        + table(["role", "move", "what", "GB", "s", "GB/s"], moves)
    )


def models(d: Dict[str, Any]) -> List[str]:
    towers, fwd = d.get("towers", {}), d.get("forward", {})
    lines: List[str] = []
    if "skipped" in towers or "error" in towers:
        lines += [f"ViT towers vs timm: {towers.get('skipped') or towers.get('error')}", ""]
    else:
        lines += [
            f"ViT towers vs timm {towers.get('timm')} ({towers.get('dtype')}, TF32 off, batch "
            f"{towers.get('batch')}, rtol = atol = {towers.get('rtol')}):",
            "",
        ]
        rows = [
            [
                k,
                f"{v.get('parameters', 0):,}",
                f(v.get("max_abs_diff"), ".2e"),
                f(v.get("max_abs_value"), ".2f"),
                v.get("equal"),
                v.get("error", ""),
            ]
            for k, v in towers.items()
            if isinstance(v, dict)
        ]
        lines += table(["tower", "params", "max abs diff", "max abs value", "equal", "error"], rows)
    if "error" in fwd:
        return lines + [f"Forward benchmark: {fwd['error']}", ""]
    rows = [
        [
            r["model"],
            r["batch"],
            f(r.get("prefill_ms"), ".1f"),
            f(r.get("decision_ms"), ".1f"),
            f(r.get("decisions_per_s"), ".1f"),
            f(r.get("llm_tflops"), ".1f"),
            f(r.get("peak_gib"), ".1f"),
            r["status"],
        ]
        for r in fwd.get("rows", [])
    ]
    params = ", ".join(f"{k} {v:,}" for k, v in fwd.get("parameters", {}).items() if k.startswith("openvla"))
    return (
        lines
        + [
            f"Forward ({params} parameters; built in {f(fwd.get('build_s'), '.1f')} s; "
            f"{fwd.get('pi0', '')}; details in {', '.join(fwd.get('files', []))}):",
            "",
        ]
        + table(
            ["model", "batch", "prefill ms", "decision ms", "decisions/s", "LLM TFLOP/s", "peak GiB", "status"], rows
        )
    )


def trainer(d: Dict[str, Any]) -> List[str]:
    rows = []
    for key in ("checkpointing_off", "checkpointing_on"):
        r = d.get(key, {})
        rows.append(
            [
                key.split("_")[1],
                r.get("batch"),
                r.get("seq_len"),
                f"{r.get('parameters') or 0:,}",
                f(r.get("update_s"), ".3f"),
                f(r.get("samples_per_s"), ".1f"),
                f(r.get("peak_gib")),
                r.get("error", "ok"),
            ]
        )
    group = d.get("group", {})
    return [f"FSDP2 over {group.get('world_size')} rank ({group.get('backend')}), {d.get('mixed_precision')}.", ""] + (
        table(["checkpointing", "batch", "seq", "params", "update s", "samples/s", "peak GiB", "status"], rows)
    )


def maniskill(d: Dict[str, Any]) -> List[str]:
    if d.get("status") == "skipped":
        return [f"Skipped: {d.get('reason')}", ""]
    rows = [
        [
            r.get("num_envs"),
            r.get("obs_mode"),
            f(r.get("env_steps_per_s"), ".0f"),
            f(r.get("make_reset_s"), ".1f"),
            r.get("error") or r.get("status") or "ok",
        ]
        for r in d.get("rows", [])
    ]
    note = d.get("dry_run_note") or d.get("vlaslurm_run", "")
    return [f"mani_skill {d.get('mani_skill')}. {note}", ""] + table(
        ["envs", "obs", "env steps/s", "make+reset s", "status"], rows
    )


def pi0(d: Dict[str, Any]) -> List[str]:
    if d.get("status") == "skipped":
        return [f"Skipped: {d.get('reason')}", ""]
    rows = [
        [r.get("batch"), f(r.get("chunk_ms"), ".1f"), f(r.get("chunks_per_s"), ".1f"), f(r.get("peak_gib"))]
        + [r.get("status")]
        for r in d.get("rows", [])
    ]
    head = (
        f"π0 ({d.get('parameters', 0):,} parameters, bf16, transformers {d.get('transformers')}), one chunk of `act` "
        f"with {d.get('denoise_steps')} denoising steps (built in {f(d.get('build_s'), '.1f')} s):"
    )
    return [head, ""] + table(["batch", "chunk ms", "chunks/s", "peak GiB", "status"], rows)


RENDER: Dict[str, Callable[[Dict[str, Any]], List[str]]] = {
    "environment": environment,
    "weight_sync": weight_sync,
    "offload": offload,
    "models": models,
    "trainer": trainer,
    "maniskill": maniskill,
    "pi0": pi0,
}


def markdown(results: Dict[str, Any]) -> str:
    meta, steps = results.get("meta", {}), results.get("steps", {})
    env = steps.get("environment", {}).get("torch", {})
    machine = env.get("gpu") or ("CPU rehearsal (--dry-run)" if meta.get("dry_run") else "no GPU seen")
    lines = [
        "# GPU verification" + (" (DRY RUN on the CPU: toy sizes, not results)" if meta.get("dry_run") else ""),
        "",
        f"Machine: {machine} on {meta.get('host')}; date: {meta.get('date')}; commit: {meta.get('commit')}. "
        "Made by benchmarks/gpu/run.sh (every figure below comes from this one run; raw figures in gpu.json).",
        "",
    ]
    for name in STEPS:
        d: Optional[Dict[str, Any]] = steps.get(name)
        if d is None:
            lines += [f"## {name}", "", "not run", ""]
            continue
        lines += [
            f"## {name}: {d.get('status')} ({f(d.get('elapsed_s'), '.1f')} s of {f(d.get('budget_s'), '.0f')})",
            "",
        ]
        if d.get("error"):
            lines += [f"Error: `{d['error']}`", ""]
        if not set(d) - BASE_KEYS:
            continue
        try:
            lines += RENDER[name](d)
        except Exception as err:  # noqa: BLE001  (a figure missing from a failed step must not lose the report)
            lines += [f"(figures incomplete: {common.describe_error(err)})", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("init", "mark", "md"))
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_intermixed_args()
    if args.command == "init":
        init(args.out, args.commit, args.dry_run)
    elif args.command == "mark":
        step, rc, budget = args.rest
        mark(args.out, step, int(rc), budget)
    else:
        (args.out / "gpu.md").write_text(markdown(common.read_results(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
