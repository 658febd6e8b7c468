"""The experiment spec: one typed dataclass per section.

`env`, `model` and `algo` are typed by their registered `type` (see
`env_types.py`, `model_types.py`, `algo_types.py`); the loader picks the class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional, get_args

from vlaslurm.spec.algo_types import AlgoConfig
from vlaslurm.spec.env_types import EnvConfig
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.registry import doc
from vlaslurm.spec.trainer_types import TrainerSpec

# The choices of enum-like fields: the loader checks them (and names them in its errors) from the type.
Mode = Literal["sync", "pipelined", "async"]
StalePolicy = Literal["drop", "hold"]
WeightSync = Literal["nccl", "filesystem"]
Layout = Literal["collocated", "disaggregated", "hybrid"]
Placement = Literal["manual", "auto"]
Role = Literal["simulator", "generator", "trainer"]
ContainerRuntime = Literal["pyxis", "apptainer"]
MODES: tuple = get_args(Mode)
STALE_POLICIES: tuple = get_args(StalePolicy)
WEIGHT_SYNCS: tuple = get_args(WeightSync)
LAYOUTS: tuple = get_args(Layout)
PLACEMENTS: tuple = get_args(Placement)
ROLES: tuple = get_args(Role)
CONTAINER_RUNTIMES: tuple = get_args(ContainerRuntime)


@dataclass
class BatchingConfig:
    """Dynamic batching of observation requests in the generator."""

    max_batch: int = doc(64, "Most requests served by one forward pass.")
    max_wait_ms: float = doc(20.0, "Longest a ready request waits for the batch to fill.")


@dataclass
class RolloutConfig:
    """How simulators, generators and trainer run together."""

    mode: Mode = doc("sync", "sync | pipelined | async.")
    pipeline_depth: int = doc(1, "Sub-groups per simulator pipelined against the generator (pipelined mode).")
    max_staleness: int = doc(0, "Largest policy-version lag a used sample may have (0 = on-policy).")
    stale_policy: StalePolicy = doc("drop", "Past max_staleness: drop the sample, or hold the generator.")
    weight_sync: WeightSync = doc("nccl", "How weights reach generators: nccl (a process group) or filesystem.")
    publish_every: int = doc(
        1,
        "Publish weights to the generators every this many policy updates (RL-VLA3 syncs once per global step); "
        "above 1 only in async mode, and at most max_staleness + 1, so that samples of a published version stay "
        "usable until the next one.",
    )
    total_env_steps: int = doc(100_000, "Env steps after which the run ends.")
    stop_at_success: Optional[float] = doc(
        None,
        "End the run sooner, once the success rate over the episodes of the last stop_window progress reports "
        "(those with finished episodes) reaches this, in (0, 1]; None = run to total_env_steps.",
    )
    stop_window: int = doc(3, "Progress reports with finished episodes that stop_at_success's rate spans.")
    seed: int = doc(0, "Seed of environments, models and sampling.")
    batching: BatchingConfig = field(default_factory=BatchingConfig, metadata={"doc": "Dynamic batching."})

    @property
    def depth(self) -> int:
        """Sub-groups per simulator rank: pipeline_depth in pipelined mode, else 1."""
        return self.pipeline_depth if self.mode == "pipelined" else 1


@dataclass
class ContainerConfig:
    """The container a role's ranks run in (pyxis/enroot or Apptainer); no image = no container.

    The run directory (with its rendezvous) and the code are always mounted at their own paths;
    the image must hold vlaslurm's dependencies, the code comes from the mount."""

    image: Optional[str] = doc(
        None,
        "Image: pyxis takes docker://..., a registry name or a .sqsh file; "
        "Apptainer a .sif file or docker://...; None = no container.",
    )
    runtime: Optional[ContainerRuntime] = doc(
        None, "pyxis | apptainer; None = the site's container.runtime, else pyxis."
    )
    mounts: List[str] = doc([], "Further mounts SRC[:DST[:FLAGS]] (DST defaults to SRC).")
    python: str = doc("python3", "Python interpreter inside the image.")
    options: List[str] = doc([], "Further flags of the runtime, e.g. --container-remap-root or --writable-tmpfs.")


@dataclass
class RoleResources:
    """Slurm resources of one role (one hetjob component unless `group` shares one)."""

    nodes: int = doc(1, "Nodes for this role.")
    gpus_per_node: int = doc(0, "GPUs per node for this role.")
    tasks_per_node: int = doc(1, "Ranks (srun tasks) per node.")
    cpus_per_task: int = doc(1, "CPUs per rank.")
    mem: Optional[str] = doc(None, "Memory per node, Slurm syntax (e.g. 200G); None = Slurm default.")
    partition: Optional[str] = doc(None, "Partition; None = slurm.partition.")
    constraint: Optional[str] = doc(None, "Slurm --constraint, e.g. h100.")
    gpu_type: Optional[str] = doc(
        None, "Portable GPU type (e.g. h100); the site profile spells it as --constraint and/or a typed --gres."
    )
    group: Optional[str] = doc(
        None,
        "Roles with the same group share one component's nodes as parallel steps; "
        "a role with more nodes than the others gets the rest as its own component.",
    )
    max_restarts: Optional[int] = doc(
        None,
        "Times a dead worker of this role is restarted, with back-off (0 = fail fast); None = the role's "
        "default (`default_max_restarts`): simulator 3, generator 3 with rollout.weight_sync filesystem "
        "else 0, trainer 0.",
    )
    container: ContainerConfig = field(default_factory=ContainerConfig, metadata={"doc": "Container of the role."})


@dataclass
class AutoPlacementConfig:
    """Limits for the auto-placement profiler."""

    modes: List[Mode] = doc([], "Rollout modes the profiler may choose (empty = only rollout.mode).")


@dataclass
class ResourcesConfig:
    """Where each role runs."""

    placement: Placement = doc("manual", "manual | auto (the profiler decides).")
    layout: Layout = doc("disaggregated", "collocated | disaggregated | hybrid GPU layout.")
    simulator: RoleResources = field(default_factory=RoleResources, metadata={"doc": "Simulator resources."})
    generator: RoleResources = field(default_factory=RoleResources, metadata={"doc": "Generator resources."})
    trainer: RoleResources = field(default_factory=RoleResources, metadata={"doc": "Trainer resources."})
    auto: AutoPlacementConfig = field(default_factory=AutoPlacementConfig, metadata={"doc": "Auto placement."})


@dataclass
class SlurmConfig:
    """Job-wide Slurm settings."""

    partition: Optional[str] = doc(None, "Default partition of every component.")
    account: Optional[str] = doc(None, "Slurm --account.")
    time: str = doc("01:00:00", "Wall-time limit, Slurm syntax.")
    setup: List[str] = doc([], "Shell lines run before the steps (module load ...); never interpolated.")
    extra: Dict[str, str] = doc({}, "Further #SBATCH options of the leader component, e.g. {qos: high}.")
    signal_seconds: int = doc(120, "Seconds before the time limit at which USR2 asks the job to checkpoint.")


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    uri: Optional[str] = doc(None, "MLflow tracking URI; None = SQLite database under the runs root.")
    experiment: str = doc("vlaslurm", "MLflow experiment name.")
    failures_per_task: int = doc(
        3,
        "Failed episodes kept per task as animated GIFs (failures/<task>/, logged to "
        "MLflow) when the env has images; 0 = none.",
    )


@dataclass
class CheckpointConfig:
    """Trainer checkpoints."""

    every_versions: int = doc(50, "Save every this many policy versions.")
    keep: int = doc(3, "Checkpoints kept.")


@dataclass
class PeriodicEvalConfig:
    """Frozen-policy evaluation while training: every `every_versions` versions trainer rank 0 hands the weights to
    a low-priority process beside it, which plays `episodes` episodes from fixed seeds; rollouts do not stop."""

    every_versions: int = doc(0, "Evaluate the weights of every this many policy versions (0: never).")
    episodes: int = doc(16, "Episodes per evaluation, over every task (the same seeds at every version).")
    keep_failed: int = doc(2, "Failed episodes kept per task and evaluation, as GIFs of the whole episode.")
    deterministic: bool = doc(True, "Play the policy's mean action; false samples, seeded per episode and step.")


@dataclass
class RuntimeConfig:
    """Networking and deadlines of the running job."""

    bind_address: Optional[str] = doc(None, "Address roles bind to; None = what the hostname resolves to.")
    allow_all_interfaces: bool = doc(
        False,
        "Let bind_address be an all-interfaces address (0.0.0.0, ::): anyone who reaches the node reaches the job.",
    )
    first_meeting_timeout_s: float = doc(600.0, "Deadline of the first rendezvous (generous: queues, imports).")
    timeout_s: float = doc(120.0, "Deadline of every later wait, once running.")
    local_ranks: Dict[str, int] = doc({}, "Ranks per role for `vlaslurm run` (local); default: the Slurm shape.")


@dataclass
class ExperimentSpec:
    """One declarative experiment: what to train, how to roll out, where to run."""

    name: str = doc("experiment", "Run name; used for run directories and MLflow.")
    env: EnvConfig = field(default_factory=EnvConfig, metadata={"doc": "Simulator."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Policy."})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"doc": "RL algorithm."})
    trainer: TrainerSpec = field(default_factory=TrainerSpec, metadata={"doc": "How the trainer computes an update."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"doc": "Execution mode."})
    resources: ResourcesConfig = field(default_factory=ResourcesConfig, metadata={"doc": "Placement."})
    slurm: SlurmConfig = field(default_factory=SlurmConfig, metadata={"doc": "Slurm."})
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"doc": "MLflow."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoints."})
    eval: PeriodicEvalConfig = field(default_factory=PeriodicEvalConfig, metadata={"doc": "Evaluation while training."})
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"doc": "Runtime."})

    def role_resources(self, role: str) -> RoleResources:
        """Resources of one role by name."""
        return getattr(self.resources, role)

    def max_restarts(self, role: str) -> int:
        """`resources.<role>.max_restarts` as set, else the role's default (the loader writes it in)."""
        value = self.role_resources(role).max_restarts
        return default_max_restarts(role, self.rollout.weight_sync) if value is None else value


# What `vlaslurm resume RUN KEY=VALUE ...` may change (a field or everything below it): how the trainer is laid out
# and paced, the deadlines, and how long the run lasts. Everything else (model, algorithm, environments, seeds,
# modes) shaped the checkpoint and the samples behind it.
RESUMABLE = (
    "resources.trainer",
    "runtime.local_ranks.trainer",
    "trainer.micro_batch_size",
    "trainer.activation_checkpointing",
    "trainer.cpu_offload",
    "trainer.replicas",
    "runtime.timeout_s",
    "runtime.first_meeting_timeout_s",
    "rollout.total_env_steps",
    "slurm.time",
)


def resumable(key: str) -> bool:
    """Whether the dotted field `key` may change when a run resumes (`RESUMABLE`)."""
    return any(key == field or key.startswith(f"{field}.") for field in RESUMABLE)


def default_max_restarts(role: str, weight_sync: str) -> int:
    """The one place a role's restart default is decided. Simulators are stateless and stay outside the
    torch.distributed world, so they come back; so do generators whose weights come from files (a restarted
    process cannot rejoin an NCCL broadcast group); the trainer holds the run's state (resume from a
    checkpoint instead)."""
    if role == "simulator" or (role == "generator" and weight_sync == "filesystem"):
        return DEFAULT_RESTARTS
    return 0


DEFAULT_RESTARTS = 3  # restarts of a stateless role unless the spec says otherwise


def resolve_restarts(spec: ExperimentSpec) -> None:
    """Write each role's resolved max_restarts into `spec` (at load, so `plan` and the run's spec show it)."""
    for role in ROLES:
        spec.role_resources(role).max_restarts = spec.max_restarts(role)
