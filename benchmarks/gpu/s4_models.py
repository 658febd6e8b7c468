"""Step 4, models: the plain-torch ViT towers against timm's on the same weights, then the batched forward benchmark.

- `towers`: each tower of vlaslurm/models/prismatic/vit.py (full size; `--dry-run`: the tiny overrides) randomly
  initialised in float32 (TF32 off), its weights loaded into `timm.create_model(id, pretrained=False,
  num_classes=0, img_size=224, act_layer=None)` (LayerScale's `scale_factor` renamed back to timm's `gamma`), and
  the features compared with timm's `get_intermediate_layers(n=[depth - 2])`, the release's call: equal when
  `torch.allclose(ours, timm's, rtol=RTOL, atol=ATOL)`. Skipped, with the reason, where timm is not importable.
- `forward`: benchmarks/gpu_vla_forward.py's own code (full-size OpenVLA and OpenVLA-OFT, bf16, batches 1, 8, 32,
  64, within what is left of this step's budget); it also writes gpu_vla_forward.{json,md} beside gpu.json.
  π0 is measured by its own step (s7_pi0.py).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import common

RTOL = ATOL = 1e-4
BATCH = 2
WRITE_MARGIN_S = 8.0  # of the step's budget, kept for writing after the forward benchmark's last batch


def compare_tower(cfg: Any, overrides: Dict[str, Any], device: Any) -> Dict[str, Any]:
    import timm
    import torch

    from vlaslurm.models.prismatic.vit import VisionTower

    torch.manual_seed(0)
    with torch.device(device):
        ours = VisionTower(cfg).eval()
        for name, param in ours.named_parameters():  # LayerScale near 1 (not 1e-5), so that every block counts
            if name.endswith("scale_factor"):
                param.data.uniform_(0.5, 1.5)
        theirs = timm.create_model(
            cfg.timm_id, pretrained=False, num_classes=0, img_size=cfg.image_size, act_layer=None, **overrides
        ).eval()
    state = {k.replace(".scale_factor", ".gamma"): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    images = torch.randn(BATCH, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(1))
    images = images.to(device)
    with torch.inference_mode():
        a = ours(images)
        b = theirs.get_intermediate_layers(images, n=[cfg.feature_block])[0]
    diff = (a - b).abs().max().item() if a.shape == b.shape else None
    return {
        "timm_id": cfg.timm_id,
        "parameters": common.count(ours),
        "shape": list(a.shape),
        "timm_shape": list(b.shape),
        "missing_in_timm": list(missing),
        "unexpected_for_timm": list(unexpected),
        "max_abs_diff": diff,
        "max_abs_value": a.abs().max().item(),
        "equal": bool(
            a.shape == b.shape and not missing and not unexpected and torch.allclose(a, b, rtol=RTOL, atol=ATOL)
        ),
    }


def towers(step: common.Step, device: Any) -> None:
    import torch

    from vlaslurm.models.prismatic.release import TINY_TIMM_OVERRIDES
    from vlaslurm.models.prismatic.vit import DinoV2Config, SigLIPConfig

    with step.part("towers") as figures:
        try:
            import timm
        except ImportError as err:
            figures["skipped"] = f"timm is not importable here ({err}); the GPU image has it"
            return
        figures.update(timm=timm.__version__, rtol=RTOL, atol=ATOL, dtype="float32", tf32=False, batch=BATCH)
        matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            for cls, tiny in zip((DinoV2Config, SigLIPConfig), TINY_TIMM_OVERRIDES):
                overrides = dict(tiny) if step.dry_run else {}
                with step.part("_tower") as tower:
                    tower.update(compare_tower(cls.with_overrides(overrides), overrides, device))
                figures[cls.timm_id] = step.data.pop("_tower")
                step.flush()
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
            if device.type == "cuda":
                torch.cuda.empty_cache()
        figures["equal"] = all(figures[c.timm_id].get("equal") for c in (DinoV2Config, SigLIPConfig))


def forward(step: common.Step, device: Any) -> None:
    import gpu_vla_forward as bench
    import torch

    with step.part("forward") as figures:
        bench.T0 = common.T0  # its budget counts from this step's start
        argv = ["--out", str(step.out), "--budget-s", str(step.budget_s - WRITE_MARGIN_S)]
        if step.dry_run:
            argv += ["--tiny", "--batches", "1", "2", "--iters", "1", "--warmup", "0"]
        args: argparse.Namespace = bench.parse_args(argv)
        dtype = torch.float32 if step.dry_run else torch.bfloat16
        results = bench.run(args, device, dtype)
        json_path, md_path = bench.write(results, args.out, args.tiny)
        rows = [{k: v for k, v in row.items() if k != "decision_ms_all"} for row in results["rows"]]
        meta = results["meta"]
        figures.update(
            files=[json_path.name, md_path.name],
            parameters=meta["parameters"],
            build_s=meta["build_s"],
            weights_gib=meta["weights_gib"],
            attn_implementation=meta["attn_implementation"],
            rows=rows,
            stopped_early=results["stopped_early"],
            pi0="measured by the pi0 step",
        )


def body(step: common.Step, device: Any) -> None:
    towers(step, device)
    forward(step, device)
    errors = [k for k in ("towers", "forward") if "error" in step.data.get(k, {})]
    if errors:
        raise RuntimeError(f"failed: {', '.join(errors)} (see their `error`)")


if __name__ == "__main__":
    raise SystemExit(common.main("models", 90.0, body))
