"""The typed profile: what a profiling job measured (`profile.measure`), as cached in JSON.

A profile is read only at the version this code measures (`PROFILE_VERSION`; what each version
added: docs/placement.md, "Profile versions"): every field below must be there, with its type.
Times are seconds, memory and sizes bytes; `samples` are raw measurements, the rest their summaries.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

PROFILE_VERSION = 8  # raise when what is measured changes; history: docs/placement.md


class ProfileError(ValueError):
    """A saved profile that cannot be read: another version, or a missing or mistyped field."""


class StaleProfile(ProfileError):
    """A profile of another version than `PROFILE_VERSION` (a cache miss: measure again)."""


@dataclass
class Summary:
    """Mean and quantiles of some samples (`costs.summarize`)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    n: int


@dataclass
class BatchSteps(Summary):
    """n instances stepped together in one call: each call's wall time."""

    samples: List[float]
    cpu_wait_mean_s: float  # time runnable but waiting for a CPU, per call (left out of the wall times)


@dataclass
class PerInstance:
    """Each instance stepped alone (from one thread per instance when the simulator is thread-safe)."""

    n: int
    threaded: bool
    dispatch_s: float  # threaded: handing a step to a thread and its result back, per step
    cpu_s: float  # CPU seconds of one step
    cpu_wait_mean_s: float
    samples: List[List[float]]  # [instance][sample] wall times
    summary: List[Summary]  # per instance


@dataclass
class SimulatorMemory:
    base: float
    per_env: float


@dataclass
class SimulatorProfile:
    counts: List[int]  # instance counts measured together
    batch: Dict[str, BatchSteps]  # by instance count (a JSON key, so a string)
    per_instance: PerInstance
    thread_safe: bool
    reset_s: float  # one instance's reset
    episode_len: List[int]  # env steps of episodes under random actions
    memory: SimulatorMemory
    run_chunk_cpu_s: float  # run_chunk's own CPU per instance and decision
    device_s_per_env: float  # of a call's step, seconds per instance on a device that concurrent calls queue for


@dataclass
class Timings:
    """A role's work per size (batch items, env steps): wall, CPU and CPU-wait seconds."""

    sizes: List[int]
    seconds: List[float]
    cpu_seconds: List[float]
    cpu_wait_mean_s: List[float]


@dataclass
class GeneratorMemory:
    base: float
    per_item: float


@dataclass
class GeneratorProfile:
    forward: Timings  # by batch size
    weights_bytes: float
    request_s: float  # wall time of decoding a request and encoding its reply
    memory: GeneratorMemory


@dataclass
class TrainerMemory:
    base: float  # weights, gradients and optimizer state
    per_step: float


@dataclass
class TrainerProfile:
    update: Timings  # by env steps
    optimizer_bytes: float
    memory: TrainerMemory


@dataclass
class WeightsProfile:
    bytes: float
    copy_bytes_per_s: float
    h2d_bytes_per_s: float
    filesystem_publish_s: float
    filesystem_install_s: float


@dataclass
class TransportProfile:
    """Round trips through the runtime's signed sockets to an echo process, and each side's CPU."""

    round_trip_s: float
    round_trip_p99_s: float
    hop_s: float  # half the round trip
    client_cpu_s: float  # per round trip: sending plus receiving
    client_send_cpu_s: float
    client_recv_cpu_s: float
    server_cpu_s: float  # per lone request, its wake-up included
    client_burst_cpu_s: float
    server_burst_cpu_s: float  # per request of a burst drained in one wake-up
    burst: int
    idle_s: List[float]  # gaps of quiet before a request
    idle_round_trip_s: List[float]  # the round trip after each gap
    load_average: float


@dataclass
class Overhead:
    """The runtime's own CPU seconds per decision, per role that pays it."""

    sim_request_cpu_s: float
    sim_reply_cpu_s: float
    record_cpu_s: float
    gen_serve_cpu_s: float
    gen_wake_cpu_s: float
    segment_cpu_s: float


@dataclass
class Profile:
    """One cached profile of a spec's roles (see `vlaslurm.placement.profile`)."""

    version: int
    key: str  # the cache key (`profile.cache_key`)
    spec: str  # the spec's name
    gpu: str  # GPU model, or 'cpu'
    local: bool  # measured on this machine: every role shares its cores
    created: float  # Unix time
    hosts: List[str]
    partitions: Dict[str, Optional[str]]  # by role
    capacity_bytes: float  # one GPU's memory, or the host's
    cpu_count: Optional[int]  # CPUs the job could use
    simulator: SimulatorProfile
    generator: GeneratorProfile
    trainer: TrainerProfile
    weights: WeightsProfile
    transport: TransportProfile
    overhead: Overhead

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> Profile:
        """Type plain (JSON) data; StaleProfile for another version, ProfileError for a missing or mistyped field."""
        version = data.get("version") if isinstance(data, dict) else None
        if version != PROFILE_VERSION:
            raise StaleProfile(
                f"{source} is version {version}, this vlaslurm reads version {PROFILE_VERSION} "
                f"(docs/placement.md, Profile versions): measure again (vlaslurm profile --force)"
            )
        return _typed(cls, data, "", source)

    def to_dict(self) -> Dict[str, Any]:
        """Plain data, as saved."""
        return dataclasses.asdict(self)


_SCALARS = {float: (int, float), int: (int,), bool: (bool,), str: (str,)}


def _typed(typ: Any, value: Any, key: str, source: str) -> Any:
    def fail(what: str) -> ProfileError:
        return ProfileError(
            f"{source}: {key or 'the profile'} {what} (version {PROFILE_VERSION}); measure again "
            f"(vlaslurm profile --force)"
        )

    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if isinstance(typ, type) and dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise fail(f"must be a mapping, not {type(value).__name__}")
        hints = typing.get_type_hints(typ)
        names = [f.name for f in dataclasses.fields(typ)]
        missing = [n for n in names if n not in value]
        if missing:
            raise fail(f"lacks {', '.join(missing)}")
        extra = [str(n) for n in value if n not in names]
        if extra:
            raise fail(f"has unknown fields {', '.join(extra)}")
        return typ(**{n: _typed(hints[n], value[n], f"{key}.{n}" if key else n, source) for n in names})
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        return _typed(next(a for a in args if a is not type(None)), value, key, source)
    if origin is list:
        if not isinstance(value, list):
            raise fail(f"must be a list, not {type(value).__name__}")
        return [_typed(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise fail(f"must be a mapping, not {type(value).__name__}")
        return {k: _typed(args[1], v, f"{key}.{k}", source) for k, v in value.items()}
    ok = _SCALARS[typ]
    if not isinstance(value, ok) or (typ is not bool and isinstance(value, bool)):
        raise fail(f"must be {typ.__name__}, not {type(value).__name__}")
    return value
