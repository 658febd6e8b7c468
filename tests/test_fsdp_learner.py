"""FSDP2 (vlaslurm/algos/sharding.py): on 2 and 3 gloo ranks, and on 4 ranks as a 2x2 hybrid mesh, a sharded update
leaves the same parameters as one replicated rank on the same global batch, for PPO and GRPO, with and without
micro-batches and activation checkpointing; each rank holds its share of the parameters and of Adam's state.
With `mixed_precision: bf16` (2 ranks, PPO and GRPO, a random-init policy and a tiny released OFT policy) the update
runs, the master parameters and Adam's state stay float32, and the step is close to a float32 replicated one. LoRA over
a tiny release (frozen base sharded beside the adapters) and a tiny π0 (its Gemma layers in the root unit) on 2 ranks
equal one replicated rank too.

Real torch.distributed, no fakes: one spawn of 4 gloo ranks runs every world size on a group of its first ranks (as
the runtime's trainers are a group of the job), about 60 s in all on 2 shared cores, most of it the spawn (+25 s bf16).
Tolerance: rtol 1e-4, atol 2e-6 (float32; the ranks sum the gradient in another order than one rank does). bf16: see
`test_a_bf16_step_is_close_to_a_float32_replicated_step`.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import replace
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, cast

import pytest
import torch
import torch.distributed as dist
from learner_helpers import CHUNK, algo_config, assert_same_update, rollout_segments, tiny_policy
from process_helpers import start_ranks
from tiny_checkpoints import write_tiny_release
from torch.distributed.fsdp import FSDPModule

from vlaslurm.algos.batch import collate
from vlaslurm.algos.learners import DataParallel, GRPOLearner, PPOLearner, make_learner
from vlaslurm.algos.sharding import ShardedDataParallel, full_state_dict, local_numel, shard_policy
from vlaslurm.models import publication_state
from vlaslurm.models.vla.build import build_released
from vlaslurm.runtime.sharded import gather_full_state
from vlaslurm.spec.model_types import LoraSpec, OpenVLAOFTConfig
from vlaslurm.spec.trainer_types import OptimizerConfig, TrainerSpec


class Case(NamedTuple):
    kind: str
    level: str
    micro: Optional[int]  # trainer.micro_batch_size
    checkpointing: bool

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.level}-micro{self.micro}-ac{int(self.checkpointing)}"


# Each algorithm with and without micro-batches and with and without checkpointing (not every product: each spawn
# pays for every case it runs). The 2x2 mesh runs three: PPO plain and with both, GRPO with micro-batches.
CASES = [
    Case("ppo", "action", None, False),
    Case("ppo", "action", 3, True),
    Case("grpo", "token", 3, False),
    Case("grpo", "token", None, True),
]
# world size -> (replicas, the cases it runs)
WORLDS: Dict[int, tuple] = {2: (1, CASES), 3: (1, CASES), 4: (2, [CASES[0], CASES[1], CASES[2]])}
# bf16 on the 2-rank group: each algorithm on each policy, "random" a random init (the film stem), "release" a tiny
# released OpenVLA-OFT (L1 head, proprio).
BF16_CASES = [
    (model, kind, level) for model in ("random", "release") for kind, level in (("ppo", "action"), ("grpo", "token"))
]
# One step (1 epoch, 1 minibatch) with Adam's eps far above the gradients' elements, so that the step is about
# -lr * gradient: with the default eps Adam divides each element by its own size, and a comparison would count the
# sign flips of near-zero elements (bf16 noise) as full-size differences.
BF16_TRAINER = TrainerSpec(optimizer=OptimizerConfig(eps=1.0))


def release_policy(folder: str, precision: str = "fp32", lora: Optional[LoraSpec] = None):
    cfg = OpenVLAOFTConfig(type="openvla-oft", path=folder, action_chunk=CHUNK, precision=precision, lora=lora)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the learned std and the value head are initialised here, not read from the release
        return build_released(cfg, action_dim=2, state_dim=2, image_size=32, num_cameras=1)


def bf16_policy(model: str, tmp: str):
    return tiny_policy(seed=3) if model == "random" else release_policy(f"{tmp}/release")


def bf16_algo(kind: str, level: str):
    cfg = algo_config(kind, level, minibatches=1)
    cfg.epochs = 1
    return cfg


def _algo(kind: str, level: str):
    """The learner tests' config, GRPO keeping every group on the chunk advantage: the default filter and outcome
    advantage leave the tiny rollout's groups (mostly all-fail) without any advantage, hence no update to compare."""
    cfg = algo_config(kind, level)
    return replace(cfg, success_filter=[0.0, 1.0], advantage="chunk") if kind == "grpo" else cfg


def _optim_numel(opt: torch.optim.Optimizer) -> int:
    return sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.ndim > 0
    )


def _rank(rank: int, tmp: str) -> None:
    """One process of the 4: every world size runs on the first `world` ranks, a group of the job as the runtime's
    trainers are (the 4-rank world on all of them, as a 2x2 mesh)."""
    torch.set_num_threads(1)
    # FSDP2 warns of every unit's view output that an in-place op on it would skip a gather; the policies make none
    # (and the comparisons below would catch a missing gather).
    warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=max(WORLDS))
    try:
        batch = torch.load(f"{tmp}/batch.pt", weights_only=False)
        groups = {world: dist.new_group(ranks=list(range(world))) for world in sorted(WORLDS)}  # all ranks call
        for world, group in groups.items():
            if rank < world:
                _run_cases(rank, world, group, batch, Path(tmp) / f"world{world}")
        if rank < 3:
            _run_tiny(rank, groups[3], tmp)
        if rank < 2:
            _run_bf16(rank, groups[2], tmp)
            _run_sharded(rank, groups[2], tmp, release_policy(f"{tmp}/release", lora=LORA), "release", "lora")
            _run_sharded(rank, groups[2], tmp, pi0_policy(), "pi0", "pi0")
        dist.barrier()  # the other ranks wait for the bf16 cases before the group goes
    finally:
        dist.destroy_process_group()


def _run_cases(rank: int, world: int, group: dist.ProcessGroup, batch, out: Path) -> None:
    replicas, cases = WORLDS[world]
    out.mkdir(exist_ok=True)
    for case in cases:
        policy = shard_policy(
            tiny_policy(seed=3), group, activation_checkpointing=case.checkpointing, replicas=replicas
        )
        dp = ShardedDataParallel(group, rank, world)
        trainer = TrainerSpec(micro_batch_size=case.micro)
        learner = make_learner(_algo(case.kind, case.level), policy, dp, 7, trainer)
        assert isinstance(learner, (PPOLearner, GRPOLearner))
        learner.update(batch, version=5)
        full = full_state_dict(policy)
        if rank == 0:
            torch.save(full, out / f"params-{case.name}.pt")
        torch.save(
            {"params": local_numel(policy), "trained": _trained_numel(policy), "optim": _optim_numel(learner.opt)},
            out / f"sizes-{case.name}-{rank}.pt",
        )


def _run_tiny(rank: int, group: dist.ProcessGroup, tmp: str) -> None:
    """PPO on a batch of one decision step, fewer rows than the 3 ranks (an async batch can be that small)."""
    policy = shard_policy(tiny_policy(seed=3), group)
    learner = make_learner(_algo("ppo", "action"), policy, ShardedDataParallel(group, rank, 3), 7, TrainerSpec())
    learner.update(torch.load(f"{tmp}/batch-tiny.pt", weights_only=False), version=5)
    full = full_state_dict(policy)
    if rank == 0:
        torch.save(full, Path(tmp) / "params-tiny.pt")


def _run_bf16(rank: int, group: dist.ProcessGroup, tmp: str) -> None:
    out = Path(tmp) / "bf16"
    out.mkdir(exist_ok=True)
    for model, kind, level in BF16_CASES:
        batch = torch.load(f"{tmp}/batch-{model}.pt", weights_only=False)
        policy = shard_policy(bf16_policy(model, tmp), group, mixed_precision="bf16")
        computed = _watch_dtypes(policy)
        learner = make_learner(bf16_algo(kind, level), policy, ShardedDataParallel(group, rank, 2), 7, BF16_TRAINER)
        assert isinstance(learner, (PPOLearner, GRPOLearner))
        learner.update(batch, version=5)
        full = full_state_dict(policy)
        masters = _shard_dtypes(policy) | _optim_dtypes(learner.opt)
        if rank == 0:
            torch.save({"params": full, "masters": masters, "computed": computed}, out / f"{model}-{kind}.pt")
    # A release loaded in bf16 (model.precision: bf16) gets float32 master shards too.
    loaded = shard_policy(release_policy(f"{tmp}/release", "bf16"), group, mixed_precision="bf16")
    if rank == 0:
        torch.save(_shard_dtypes(loaded), out / "bf16-release-masters.pt")


LORA = LoraSpec(rank=4, publish="merged")  # the update is the same either way; the publication is merged


def _run_sharded(rank: int, group: dist.ProcessGroup, tmp: str, policy, batch: str, name: str) -> None:
    """One PPO update of `policy` sharded over the 2-rank `group` on batch-<batch>.pt; rank 0 saves params-<name>.pt."""
    sharded = shard_policy(policy, group)
    learner = make_learner(_algo("ppo", "action"), sharded, ShardedDataParallel(group, rank, 2), 7, TrainerSpec())
    learner.update(torch.load(f"{tmp}/batch-{batch}.pt", weights_only=False), version=5)
    full = full_state_dict(sharded)
    if name == "lora":  # the weight publication gathered from the shards (small buckets: several per layer group)
        published = gather_full_state(sharded, 1 << 12, keep=rank == 0, publication=True)
        if rank == 0:
            torch.save(published, Path(tmp) / "published-lora.pt")
    if rank == 0:
        torch.save(full, Path(tmp) / f"params-{name}.pt")
        units = [n for n, m in sharded.named_modules() if isinstance(m, FSDPModule) and m is not sharded]
        torch.save(units, Path(tmp) / f"units-{name}.pt")


def _replicated_update(policy, batch: Path) -> tuple:
    """(the parameters after one PPO update of `policy` on one replicated rank, the names it moved)."""
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    learner = make_learner(_algo("ppo", "action"), policy, DataParallel(None, 0, 1), 7)
    learner.update(torch.load(batch, weights_only=False), version=5)
    after = policy.state_dict()
    return after, {n for n, v in after.items() if not torch.equal(v, before[n])}


def test_a_lora_policy_under_fsdp_updates_as_one_replicated_rank(spawned: Path) -> None:
    """LoRA over the tiny release on 2 ranks: the frozen base sharded with the adapters (FSDP2 reduces gradients only
    for the parameters that have them)."""
    policy = release_policy(str(spawned / "release"), lora=LORA)
    reference, moved = _replicated_update(policy, spawned / "batch-release.pt")
    assert any(".lora_" in n for n in moved) and not any(n.startswith("vla.") and ".lora_" not in n for n in moved)
    assert_same_update(torch.load(spawned / "params-lora.pt"), reference, "lora")
    # lora.publish merged: the shards' publication (each adapted layer's W + scale B A, folded on rank 0 from the
    # gathered base weight and factors) is the replicated trainer's
    published = torch.load(spawned / "published-lora.pt")
    assert not any(".lora_" in n or ".base_layer." in n for n in published)
    assert_same_update(published, publication_state(policy), "lora merged publication")


def pi0_policy():
    from vlaslurm.models.pi0.build import tiny_pi0
    from vlaslurm.models.pi0.flow import FlowSettings

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tiny_pi0(CHUNK, 2, 2, FlowSettings(denoise_steps=3, noise_method="flow_noise"), "expert", 0)


def test_a_pi0_policy_under_fsdp_updates_as_one_replicated_rank(spawned: Path) -> None:
    """π0 on 2 ranks: its SigLIP layers and the Gemma layers of its prefix and its action expert are units (the
    Gemma ones gathered from forward to backward: the expert runs once per denoising step)."""
    units = torch.load(spawned / "units-pi0.pt")
    assert any("vision_tower" in u for u in units) and any(".language_model.layers." in u for u in units)
    assert any(".dit.layers." in u for u in units)
    reference, moved = _replicated_update(pi0_policy(), spawned / "batch-pi0.pt")
    assert any(".dit." in n for n in moved) and any(".language_model." in n for n in moved)  # expert and prefix
    assert any("vision_tower" in n for n in moved) and "noise_head.weight" in moved
    assert_same_update(torch.load(spawned / "params-pi0.pt"), reference, "pi0")


def _watch_dtypes(policy: torch.nn.Module) -> Dict[str, set]:
    """Records, for the policy's float32 units and its Llama layers, the (parameter, input) dtypes each forward
    computes with (the hooks run after FSDP's own: parameters gathered and inputs cast)."""
    seen: Dict[str, set] = {}

    def hook(name: str):
        def record(module, args, kwargs) -> None:
            inputs = {a.dtype for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()}
            seen.setdefault(name, set()).add((next(module.parameters()).dtype, frozenset(inputs)))

        return record

    layers = {
        name for name, m in policy.named_modules() if type(m).__name__.endswith("LlamaDecoderLayer")
    }  # FSDP's subclass
    for name, module in policy.named_modules():
        if name in layers or name.rsplit(".", 1)[-1] in (
            "value_head",
            "action_head",
            "proprio_projector",
            "vision_backbone",
        ):
            module.register_forward_pre_hook(hook(name), with_kwargs=True)
    return seen


def _shard_dtypes(policy: torch.nn.Module) -> set:
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in policy.parameters())  # every parameter sharded
    return {cast(DTensor, p).to_local().dtype for p in policy.parameters()}


def _optim_dtypes(opt: torch.optim.Optimizer) -> set:
    return {
        (v.to_local() if hasattr(v, "to_local") else v).dtype
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.ndim > 0
    }


@pytest.fixture(scope="module")
def batch():
    segments = rollout_segments(tiny_policy(seed=1), num_envs=8, chunks=9, group_size=4, version_every=3)
    return collate(segments)


@pytest.fixture(scope="module")
def single(batch) -> Dict[str, Dict[str, torch.Tensor]]:
    """One replicated rank's parameters after the update, per algorithm (no micro-batches, no checkpointing)."""
    out = {}
    for kind, level in {(c.kind, c.level) for c in CASES}:
        policy = tiny_policy(seed=3)
        make_learner(_algo(kind, level), policy, DataParallel(None, 0, 1), 7).update(batch, version=5)
        out[kind] = policy.state_dict()
        moved = [n for n, v in tiny_policy(seed=3).state_dict().items() if not torch.equal(v, out[kind][n])]
        assert len(moved) > 10, f"{kind}: the update left the policy as it was, there is nothing to compare"
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory, batch) -> Path:
    tmp = tmp_path_factory.mktemp("fsdp")
    torch.save(batch, tmp / "batch.pt")
    torch.save(batch, tmp / "batch-random.pt")
    torch.save(tiny_batch(), tmp / "batch-tiny.pt")
    write_tiny_release(tmp / "release", oft=True, action_dim=2, proprio_dim=2)
    segments = rollout_segments(release_policy(str(tmp / "release")), num_envs=8, chunks=6, group_size=4)
    torch.save(collate(segments), tmp / "batch-release.pt")
    torch.save(collate(rollout_segments(pi0_policy(), num_envs=4, chunks=4)), tmp / "batch-pi0.pt")
    start_ranks(_rank, (str(tmp),), max(WORLDS))
    return tmp


def tiny_batch():
    return collate(rollout_segments(tiny_policy(seed=1), num_envs=1, chunks=1))


def test_a_batch_smaller_than_the_ranks_updates_as_one_rank_does(spawned: Path) -> None:
    """One decision step on 3 ranks: its owner runs it, the two others join each forward and backward with a zero
    loss on their spare row; its advantage, alone, is only centred (a spread of one value is undefined, and the NaN
    would reach every parameter)."""
    policy = tiny_policy(seed=3)
    make_learner(_algo("ppo", "action"), policy, DataParallel(None, 0, 1), 7).update(tiny_batch(), version=5)
    reference, sharded = policy.state_dict(), torch.load(spawned / "params-tiny.pt")
    assert all(torch.isfinite(v).all() for v in reference.values())
    moved = [n for n, v in tiny_policy(seed=3).state_dict().items() if not torch.equal(v, reference[n])]
    assert moved, "the value loss of the one step moved nothing"
    assert_same_update(sharded, reference)


@pytest.fixture(params=sorted(WORLDS), ids=lambda w: f"world{w}")
def ranked(request, spawned: Path) -> tuple:
    return request.param, spawned / f"world{request.param}"


def test_sharded_update_equals_one_replicated_rank(ranked: tuple, single) -> None:
    world, tmp = ranked
    for case in WORLDS[world][1]:
        sharded = torch.load(tmp / f"params-{case.name}.pt")
        reference = single[case.kind]
        assert_same_update(sharded, reference, case.name)


def test_each_rank_holds_its_share(ranked: tuple) -> None:
    """1/N of everything on N ranks; 1/2 on the 2x2 mesh (sharded over 2, replicated twice)."""
    world, tmp = ranked
    replicas, cases = WORLDS[world]
    total = sum(p.numel() for p in tiny_policy(seed=3).parameters())
    shard = world // replicas
    for case in cases:
        sizes: List[dict] = [torch.load(tmp / f"sizes-{case.name}-{rank}.pt") for rank in range(world)]
        assert sum(s["params"] for s in sizes) == total * replicas  # each row of the mesh partitions the model
        for s in sizes:
            assert s["params"] <= 1.1 * total / shard, case.name  # dim-0 shards of uneven sizes: about 1/shard
            # Adam's two moments of this rank's trained shards only (not of the frozen embeddings; GRPO never steps
            # the unused value head: no state)
            assert 1.9 * s["trained"] <= s["optim"] <= 2 * s["trained"] < s["params"], case.name


def _trained_numel(policy: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    trained = [p for p in policy.parameters() if p.requires_grad]
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trained)


def _step(after: Dict[str, torch.Tensor], before: Dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[name].float() - value.float()).flatten() for name, value in before.items()])


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: "-".join(c[:2]))
def test_a_bf16_step_is_close_to_a_float32_replicated_step(case: tuple, spawned: Path) -> None:
    """Cosine similarity > 0.98 and relative error < 0.2 between the parameter changes (measured, deterministic:
    cosine 0.9953 / 0.9892 and relative error 0.097 / 0.147 for the random init's PPO / GRPO step, whose token-level
    log-probs go through every bf16 layer; 0.9976 and 0.069 for the release's, where the CPU's bf16 LayerNorm
    backward sums its bias gradient over every patch in bf16, about 0.6 of float32's in the ViTs)."""
    model, kind, level = case
    before = bf16_policy(model, str(spawned)).state_dict()
    reference = bf16_policy(model, str(spawned))
    batch = torch.load(spawned / f"batch-{model}.pt", weights_only=False)
    make_learner(bf16_algo(kind, level), reference, DataParallel(None, 0, 1), 7, BF16_TRAINER).update(batch, 5)
    saved = torch.load(spawned / "bf16" / f"{model}-{kind}.pt", weights_only=False)
    assert saved["masters"] == {torch.float32}  # the shards and Adam's moments; bf16 exists only in compute
    float32_parts = {"value_head", "action_head", "proprio_projector", *(["vla.vision_backbone"] * (model == "random"))}
    computed = saved["computed"]
    assert float32_parts <= set(computed) and any(".layers." in f"{name}." for name in computed)
    for name, dtypes in computed.items():
        # the Llama layers compute in bf16, the float32 parts in float32 on float32 inputs
        compute = torch.float32 if name in float32_parts else torch.bfloat16
        assert dtypes == {(compute, frozenset({compute}))}, name
    assert set(saved["params"]) == set(before)
    expected, got = _step(reference.state_dict(), before), _step(saved["params"], before)
    assert torch.isfinite(got).all() and expected.norm() > 0
    cosine = float(torch.nn.functional.cosine_similarity(expected, got, dim=0))
    relative = float((got - expected).norm() / expected.norm())
    assert cosine > 0.98 and relative < 0.2, (cosine, relative)


def test_a_release_loaded_in_bf16_gets_float32_master_shards(spawned: Path) -> None:
    assert {p.dtype for p in release_policy(str(spawned / "release"), "bf16").vla.parameters()} == {torch.bfloat16}
    assert torch.load(spawned / "bf16" / "bf16-release-masters.pt") == {torch.float32}
