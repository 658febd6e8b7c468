"""Real 2-rank fsdp runs of a LoRA-adapted tiny release (issue 16's trainer scale, on issue 15's models): what a
publication carries (the adapters and heads, or their merged weights), what a sharded checkpoint holds, and a
resume from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from runtime_helpers import run_spec
from test_released_runs import spec, toy_env
from tiny_checkpoints import RUNTIME_IMAGE_SIZE, write_tiny_release


@pytest.fixture(scope="module")
def toy_openvla(tmp_path_factory) -> Path:
    return write_tiny_release(tmp_path_factory.mktemp("toy-openvla"), action_dim=2, image_size=RUNTIME_IMAGE_SIZE)


def test_lora_under_fsdp_can_publish_merged_weights(tmp_path, toy_openvla):
    """`model.lora.publish: merged` with 2 fsdp trainer ranks: every publication the generators load holds the
    adapted layers' merged weights and the heads (no factor, no other frozen weight), folded on rank 0 from what
    both ranks gathered; the generator runs plain layers."""
    from safetensors import safe_open

    from vlaslurm.rundir import RunDir

    lora = {"rank": 4, "publish": "merged"}
    model = {"type": "openvla", "path": str(toy_openvla), "action_chunk": 1, "action_dim": 2, "lora": lora}
    run_spec_ = spec(toy_env(state=False), model, {"type": "ppo", "steps_per_update": 16}, "sync", 16 * 3)
    run_spec_["rollout"]["weight_sync"] = "filesystem"
    run_spec_["trainer"] = {"strategy": "fsdp"}
    ranks = ["runtime.local_ranks={simulator: 1, generator: 1, trainer: 2}"]
    run = run_spec(tmp_path, run_spec_, ranks, name="merged", timeout_s=240)
    assert run.rc == 0, run.log("trainer", 0)[-3000:] + run.log("trainer", 1)[-2000:]
    assert run.ledger["behavior_version"].max() >= 1  # segments played by a published merged version
    published = sorted(RunDir(run.run_dir).weights.glob("v*.safetensors"))
    assert published
    with safe_open(str(published[-1]), "pt") as f:
        names = list(f.keys())
    assert not any(".lora_" in n or ".base_layer." in n for n in names), names
    assert any(n.startswith("vla.language_model.") for n in names) and "value_head.weight" in names
    assert not any(n.startswith("vla.vision_backbone.") for n in names)  # not adapted: the generator has it
    assert re.search(r"serving [1-9]\d* adapted layers as plain layers", run.log("generator", 0))


def test_lora_under_fsdp_publishes_and_checkpoints_only_what_trains_and_resumes(tmp_path, toy_openvla):
    """LoRA over a release with 2 fsdp trainer ranks: the generators get the adapters and the heads only (they hold
    the release's frozen base), a sharded checkpoint holds no frozen tensor, and the run resumes from it."""
    import signal

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from test_checkpoint_resume import run_interrupted

    from vlaslurm.rundir import RunDir, read_info
    from vlaslurm.runtime import checkpoint as ckpt
    from vlaslurm.runtime.local import resume_local
    from vlaslurm.runtime.signals import REQUEUE_EXIT

    model = {"type": "openvla", "path": str(toy_openvla), "action_chunk": 1, "action_dim": 2, "lora": {"rank": 4}}
    algo = {"type": "ppo", "steps_per_update": 16, "logprob_level": "token"}
    run_spec_ = spec(toy_env(state=False), model, algo, "sync", 16 * 6)
    run_spec_["rollout"]["weight_sync"] = "filesystem"
    run_spec_["trainer"] = {"strategy": "fsdp"}
    ranks = ["runtime.local_ranks={simulator: 1, generator: 1, trainer: 2}"]
    cut = run_interrupted(tmp_path, run_spec_, ranks, after_version=2, sig=signal.SIGUSR2)
    assert cut.rc == REQUEUE_EXIT, cut.log("trainer", 0)[-3000:]

    def trains(name: str) -> bool:  # adapters and everything outside the VLA (heads)
        return ".lora_" in name or not name.startswith("vla.")

    published = sorted(RunDir(cut.run_dir).weights.glob("v*.safetensors"))
    assert published
    with safe_open(str(published[-1]), "pt") as f:
        names = list(f.keys())
    assert any(".lora_" in n for n in names) and all(trains(n) for n in names), names

    saved = ckpt.latest(cut.run_dir)
    assert saved is not None and ckpt.is_sharded(saved)
    keys = [k.removeprefix("model.") for k in dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata]
    model_keys = [k for k in keys if not k.startswith("optim.")]
    assert any(".lora_" in k for k in model_keys) and all(trains(k) for k in model_keys), model_keys

    assert resume_local(read_info(cut.run_dir), echo=False, timeout_s=240) == 0, cut.log("trainer", 0)[-3000:]
    assert f"resumed from checkpoint {saved}" in cut.log("trainer", 1)
    assert (cut.run_dir / "final_model").is_dir()
