"""The placement model's trainer memory (vlaslurm/placement/trainer_memory.py): a 7.5B OpenVLA with AdamW fits 8 x 80
GiB trainer GPUs with `trainer.strategy: fsdp` (bf16), and with `replicate` is rejected with the numbers.

The 7B model is built on the meta device from a full-size release config (nothing is allocated or downloaded); the
spec is experiments/libero.yaml with model.path at that config. About 15 s (the meta build imports transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from vlaslurm.models.prismatic.release import FUSED_TIMM_IDS, ReleaseConfig, release_config_json
from vlaslurm.placement.costs import Costs, Curve, Memory, estimated_trainer
from vlaslurm.placement.search import memory_check
from vlaslurm.placement.simulate import Candidate, Workload
from vlaslurm.placement.trainer_memory import (
    GiB,
    ModelShape,
    Stack,
    TrainerBytes,
    activation_bytes,
    trainer_bytes,
    trainer_memory_problem,
    vla_shape,
)
from vlaslurm.spec import load_spec
from vlaslurm.spec.trainer_types import TrainerSpec

OPENVLA_7B = ReleaseConfig(
    timm_model_ids=FUSED_TIMM_IDS,
    image_sizes=(224, 224),
    text_config={"model_type": "llama", "pad_token_id": 32000, "vocab_size": 32064},
)
REPLICATE = ["trainer.strategy=replicate", "trainer.mixed_precision=fp32", "trainer.activation_checkpointing=false"]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("openvla-7b")
    (folder / "config.json").write_text(json.dumps(release_config_json(OPENVLA_7B, "bfloat16")))
    return folder


@pytest.fixture(scope="module")
def shape(release: Path) -> ModelShape:
    return vla_shape(OPENVLA_7B)


def libero(release: Path, *overrides: str):
    return load_spec(REPO / "experiments" / "libero.yaml", [f"model.path={release}", *overrides]).spec


def test_the_7b_shape_is_openvla(shape: ModelShape) -> None:
    assert 7.4e9 < shape.parameters < 7.7e9  # OpenVLA: 7.54B (Llama-2 7B, DINOv2-L, SigLIP-So400m, projector)
    assert shape.largest_block == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # a Llama-2 7B layer and its 2 norms
    assert [s.layers for s in shape.stacks] == [24, 27, 32]


def test_7b_fits_8_gpus_of_80_gib_with_fsdp_not_with_replicate(release: Path, shape: ModelShape) -> None:
    fsdp = libero(release)
    assert fsdp.trainer.strategy == "fsdp" and fsdp.trainer.mixed_precision == "bf16"
    assert trainer_memory_problem(fsdp, shape, 8, 80 * GiB) is None
    why = trainer_memory_problem(libero(release, *REPLICATE), shape, 8, 80 * GiB)
    assert why is not None and "(replicate)" in why and "> 80.0 GiB per GPU" in why
    # 16 bytes per parameter on every rank: 4 + 4 + 8 of 7.54e9 parameters
    for part in ("parameters 28.1", "gradients 28.1", "Adam state 56.2", "activations (estimate)"):
        assert part in why, why
    assert "use trainer.strategy: fsdp" in why


def test_placement_memory_check_reads_the_strategy_from_the_spec(release: Path) -> None:
    """The candidate's trainer ranks divide fsdp's state; a replicated trainer is refused with what takes its bytes."""
    work = Workload(192, 8, 1024)  # envs, chunk, steps per update
    cand = Candidate("sync", "disaggregated", 1, 1, 8)  # 8 trainer GPUs
    for overrides, fits in (((), True), (REPLICATE, False)):
        at = estimated_trainer(libero(release, *overrides))
        assert at is not None
        costs = _costs(Memory(capacity=80 * GiB, trainer_at=at))
        why = memory_check(cand, work, costs)
        assert (why == "") is fits, why
        if not fits:
            assert why.startswith("trainer needs ") and "Adam state 56.2" in why and "replicate" in why
    sharded = estimated_trainer(libero(release))
    assert sharded is not None
    assert sharded(8, 128).total < sharded(4, 256).total < sharded(2, 512).total  # fewer ranks, bigger shards


def test_fsdp_state_is_one_shard_group_share() -> None:
    shape = ModelShape(1_000_000, 10_000, (Stack(2, 8, 4),))
    replicated = trainer_bytes(shape, TrainerSpec(), 8, 1)
    assert (replicated.params, replicated.grads, replicated.adam, replicated.gathered) == (4e6, 4e6, 8e6, 0.0)
    fsdp = trainer_bytes(shape, TrainerSpec(strategy="fsdp"), 8, 1)
    assert (fsdp.params, fsdp.adam) == (4e6 / 8, 8e6 / 8)
    assert fsdp.gathered == 2 * 10_000 * 4  # this block and the prefetched one, float32
    hybrid = trainer_bytes(shape, TrainerSpec(strategy="fsdp", replicas=2), 8, 1)
    assert hybrid.params == 4e6 / 4  # a 2 x 4 mesh: sharded over 4
    offload = trainer_bytes(shape, TrainerSpec(strategy="fsdp", cpu_offload=True), 8, 1)
    assert offload.params == offload.grads == offload.adam == 0.0


def test_checkpointing_keeps_layer_inputs_and_one_layer() -> None:
    stacks = (Stack(layers=10, width=100, tokens=50),)
    full = activation_bytes(stacks, 2, False, 2)
    assert full == 34 * 50 * 100 * 2 * 10
    assert activation_bytes(stacks, 2, True, 2) == 2 * 50 * 100 * 2 * 10 + 34 * 50 * 100 * 2
    assert activation_bytes(stacks, 2, False, 4) == 2 * full  # float32 values


def test_describe_lists_what_takes_the_bytes() -> None:
    text = TrainerBytes(GiB, GiB, 2 * GiB, 0.0, 0.5 * GiB, "replicate").describe()
    assert text == (
        "4.5 GiB per trainer rank (replicate): parameters 1.0, gradients 1.0, Adam state 2.0, "
        "activations (estimate) 0.5 GiB"
    )


def _costs(memory: Memory) -> Costs:
    """Costs whose times do not matter here: only the memory is checked."""
    return Costs(
        step_samples=np.full((1, 8), 0.01),
        step_rule="max",
        forward_s=Curve.constant(0.002),
        update_s=Curve.constant(0.02),
        publish_s=0.0,
        install_s=0.0,
        hop_s=0.0,
        memory=memory,
        episode_len=np.asarray([10**6]),
        on_gpu=True,
    )
