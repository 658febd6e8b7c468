"""Every message of a run, encoded and decoded in one place.

The path of one sample: the simulator sends an `obs` request, the generator
answers with an `act` reply tagged with the policy version that produced it, and
the simulator ships finished `Segment`s (a trajectory, or a piece of one, of a
single behaviour version) to the trainer. The trainer's `ctl` announcements
carry its version, what it has consumed, the newest phase whose batch it took,
and when to stop. In the collocated layout every generator and trainer rank tells
trainer rank 0 when its state has left the GPU (`offloaded`), so that the next
role moves on only once the device is free.

Each decoder checks what it reads (types, lengths, the arrays a kind must carry) and raises
`WireError` for anything else; the receiving sockets run them on every message they take
(`*_INTAKE`, `ANNOUNCEMENTS`, `REPLIES`), so a bad message is a counted rejection, never a rank's
crash, and a role's decoding of a message its socket took returns what that check decoded (`_kept`).
Channel names (`channel`) and the largest frame a run may send (`max_frame_bytes`) are here too.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

import numpy as np

from vlaslurm.envs.base import Observation
from vlaslurm.runtime.transport import Message, WireError
from vlaslurm.spec.env_types import EnvConfig

OBS, ACT, HELD, SEGMENT, PHASE_END, SIM_DONE, CTL = "obs", "act", "held", "segment", "phase_end", "sim_done", "ctl"
SIM_RESTART, OFFLOADED = "sim_restart", "offloaded"
MAX_SEGMENT_STEPS = 64  # decision steps in one segment at most (the simulator cuts longer ones)


# --------------------------------------------------------------------------- checks

_T = TypeVar("_T")


def _kept(decoder: Callable[[Message], _T]) -> Callable[[Message], _T]:
    """`decoder`, reading what a receiving socket's check by this same decoder kept on the message
    (`Message.decoded`) instead of decoding it a second time."""

    @functools.wraps(decoder)
    def decode(msg: Message) -> _T:
        return msg.decoded if msg.decoded_by is decode else decoder(msg)

    return decode


def _bad(kind: str, what: str) -> WireError:
    return WireError(f"{kind}: {what}", reason="content")


def _int(m: Mapping[str, Any], key: str, kind: str, default: Optional[int] = None) -> int:
    value = m.get(key, default)
    if not isinstance(value, int):  # bool is an int: msgpack gives True/False only where one was sent
        raise _bad(kind, f"{key!r} is {type(value).__name__}, not an integer")
    return int(value)


def _float(m: Mapping[str, Any], key: str, kind: str) -> float:
    value = m.get(key)
    if not isinstance(value, (int, float)):
        raise _bad(kind, f"{key!r} is {type(value).__name__}, not a number")
    return float(value)


def _bool(m: Mapping[str, Any], key: str, kind: str) -> bool:
    value = m.get(key)
    if not isinstance(value, (bool, int)):
        raise _bad(kind, f"{key!r} is {type(value).__name__}, not a boolean")
    return bool(value)


def _str(m: Mapping[str, Any], key: str, kind: str) -> str:
    value = m.get(key)
    if not isinstance(value, str):
        raise _bad(kind, f"{key!r} is {type(value).__name__}, not a string")
    return value


def _list(m: Mapping[str, Any], key: str, kind: str, of: type, n: Optional[int] = None) -> list:
    value = m.get(key)
    if not isinstance(value, list) or not all(isinstance(v, of) for v in value):
        raise _bad(kind, f"{key!r} is not a list of {of.__name__}")
    if n is not None and len(value) != n:
        raise _bad(kind, f"{key!r} has {len(value)} items, expected {n}")
    return list(value)


def _array(msg: Message, name: str, rows: Optional[int]) -> Optional[np.ndarray]:
    """Array `name` of `msg` (None if absent), with `rows` rows if given."""
    array = msg.arrays.get(name)
    if array is not None and rows is not None and (array.ndim == 0 or array.shape[0] != rows):
        raise _bad(msg.kind, f"array {name!r} has shape {array.shape}, expected {rows} rows")
    return array


def _required(msg: Message, name: str, rows: Optional[int]) -> np.ndarray:
    array = _array(msg, name, rows)
    if array is None:
        raise _bad(msg.kind, f"array {name!r} is missing")
    return array


# Several requests (or replies) in one message: their rows concatenated, `counts` saying how many each has.


def _joined(parts: List[Dict[str, np.ndarray]], what: str) -> Dict[str, np.ndarray]:
    """The arrays of several `what` in one message, rows concatenated (as they are for one)."""
    if any(p.keys() != parts[0].keys() for p in parts):
        raise ValueError(f"{what} in one message must carry the same arrays")
    return parts[0] if len(parts) == 1 else {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _row_slices(m: Mapping[str, Any], kind: str, n: int, what: str) -> List[slice]:
    """Each item's rows of a message's `n`, from its `counts`: non-empty, and all of them."""
    counts = _list(m, "counts", kind, int)
    if n == 0 or not counts or any(c < 1 for c in counts) or sum(counts) != n:
        raise _bad(kind, f"counts {counts} do not split {n} environments into non-empty {what}")
    starts = itertools.accumulate(counts, initial=0)
    return [slice(start, start + count) for start, count in zip(starts, counts)]


def _only(kind: str, items: List[_T], what: str) -> _T:
    if len(items) != 1:
        raise _bad(kind, f"{len(items)} {what} where one was expected")
    return items[0]


@dataclass
class ObsRequest:
    """Observations of some environments of one simulator, waiting for actions."""

    env_ids: List[int]  # global environment ids
    episodes: List[int]
    steps: List[int]  # env steps taken so far in each episode
    seeds: List[int]  # per-item sampling seeds: reproducible whatever the batch
    obs: Observation
    sub_group: int
    min_version: int  # the generator holds the request until it has at least this version
    sent_at: float = 0.0
    sim_rank: int = 0

    def __len__(self) -> int:
        return len(self.env_ids)


def encode_requests(reqs: List[ObsRequest]) -> Message:
    """Requests of one simulator, sent together, in one message (one send, one MAC, one wake-up for all of
    them: async environments whose steps end together); each keeps its own rows, sub-group and version."""
    first = reqs[0]
    if any(r.sim_rank != first.sim_rank for r in reqs):
        raise ValueError("requests in one message must come from one simulator rank")
    arrays = _joined([_obs_arrays(r.obs) for r in reqs], "requests")
    meta = {
        "env_ids": [e for r in reqs for e in r.env_ids],
        "episodes": [e for r in reqs for e in r.episodes],
        "steps": [s for r in reqs for s in r.steps],
        "seeds": [s for r in reqs for s in r.seeds],
        "instructions": [i for r in reqs for i in r.obs.instructions],
        "counts": [len(r) for r in reqs],
        "sub_groups": [r.sub_group for r in reqs],
        "min_versions": [r.min_version for r in reqs],
        "sent_at": first.sent_at,
        "sim_rank": first.sim_rank,
    }
    return Message(OBS, meta, arrays)


def encode_obs(req: ObsRequest) -> Message:
    return encode_requests([req])


@_kept
def decode_requests(msg: Message) -> List[ObsRequest]:
    """The requests in an `obs` message (`encode_requests`), each with its rows of the arrays (views)."""
    m, k = msg.meta, OBS
    env_ids = _list(m, "env_ids", k, int)
    n = len(env_ids)
    slices = _row_slices(m, k, n, "requests")
    groups, versions = (_list(m, key, k, int, len(slices)) for key in ("sub_groups", "min_versions"))
    episodes, steps, seeds = (_list(m, key, k, int, n) for key in ("episodes", "steps", "seeds"))
    images, state = _array(msg, "images", n), _array(msg, "state", n)
    instructions = _list(m, "instructions", k, str, n)
    sent_at, sim_rank = _float(m, "sent_at", k), _int(m, "sim_rank", k)
    return [
        ObsRequest(
            env_ids[rows],
            episodes[rows],
            steps[rows],
            seeds[rows],
            Observation(
                None if images is None else images[rows], None if state is None else state[rows], instructions[rows]
            ),
            group,
            version,
            sent_at,
            sim_rank,
        )
        for rows, group, version in zip(slices, groups, versions)
    ]


@_kept
def decode_obs(msg: Message) -> ObsRequest:
    """The request of an `obs` message that holds one (an evaluation's)."""
    return _only(OBS, decode_requests(msg), "requests")


@dataclass
class ActReply:
    """Actions for the environments of one request, from one policy version."""

    env_ids: List[int]
    sub_group: int
    version: int
    actions: np.ndarray  # float32 [n, C, A]
    logprob: np.ndarray  # float32 [n, C]
    value: np.ndarray  # float32 [n]
    gen_rank: int = 0
    token_logprob: Optional[np.ndarray] = None  # float32 [n, C, A], from policies whose actions factorise by token
    # What the policy needs again to evaluate these actions (PolicyOutput.replay; pi0: its denoising path), [n, ...]
    replay: Optional[Dict[str, np.ndarray]] = None
    received_at: float = 0.0  # run clock, when the simulator took it off its socket (not on the wire)


REPLAY = "replay."  # the prefix of a replay tensor's array name, in replies and segments


def replay_arrays(replay: Optional[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    return {REPLAY + k: v for k, v in (replay or {}).items()}


def decode_replay(msg: Message, rows: int) -> Optional[Dict[str, np.ndarray]]:
    """The replay tensors of `msg`, each with `rows` rows (None if it has none)."""
    names = [name for name in msg.arrays if name.startswith(REPLAY)]
    if not names:
        return None
    return {name[len(REPLAY) :]: _required(msg, name, rows) for name in names}


def _act_arrays(rep: ActReply) -> Dict[str, np.ndarray]:
    arrays = {"actions": rep.actions, "logprob": rep.logprob, "value": rep.value, **replay_arrays(rep.replay)}
    if rep.token_logprob is not None:
        arrays["token_logprob"] = rep.token_logprob
    return arrays


def encode_acts(replies: List[ActReply]) -> Message:
    """The replies of one forward to one simulator, in one message (one send, one MAC, one wake-up for all of
    them); they share the forward's version and generator."""
    first = replies[0]
    if any((r.version, r.gen_rank) != (first.version, first.gen_rank) for r in replies):
        raise ValueError("replies in one message must come from one forward (one version and generator)")
    arrays = _joined([_act_arrays(r) for r in replies], "replies")
    meta = {
        "env_ids": [e for r in replies for e in r.env_ids],
        "counts": [len(r.env_ids) for r in replies],
        "sub_groups": [r.sub_group for r in replies],
        "version": first.version,
        "gen_rank": first.gen_rank,
    }
    return Message(ACT, meta, arrays)


def encode_act(rep: ActReply) -> Message:
    return encode_acts([rep])


@_kept
def decode_acts(msg: Message) -> List[ActReply]:
    """The replies in an `act` message (`encode_acts`), each with its rows of the arrays (views)."""
    m, k = msg.meta, ACT
    env_ids = _list(m, "env_ids", k, int)
    n = len(env_ids)
    slices = _row_slices(m, k, n, "replies")
    groups = _list(m, "sub_groups", k, int, len(slices))
    version, gen_rank = _int(m, "version", k), _int(m, "gen_rank", k)
    actions, logprob, value = (_required(msg, name, n) for name in ("actions", "logprob", "value"))
    tokens, replay = _array(msg, "token_logprob", n), decode_replay(msg, n)
    return [
        ActReply(
            env_ids[rows],
            group,
            version,
            actions[rows],
            logprob[rows],
            value[rows],
            gen_rank,
            None if tokens is None else tokens[rows],
            None if replay is None else {name: v[rows] for name, v in replay.items()},
        )
        for rows, group in zip(slices, groups)
    ]


@_kept
def decode_act(msg: Message) -> ActReply:
    """The reply of an `act` message that holds one (an evaluation's)."""
    return _only(ACT, decode_acts(msg), "replies")


def held(env_ids: List[int], gen_rank: int) -> Message:
    """The generator holds this request (`stale_policy: hold`): ship what these environments have
    stepped so far, so that the trainer can consume it and lift the hold. Repeated while the hold lasts."""
    return Message(HELD, {"env_ids": list(env_ids), "gen_rank": gen_rank})


@_kept
def decode_held(msg: Message) -> Tuple[List[int], int]:
    """(env ids, generator rank) of a `held` notice."""
    return _list(msg.meta, "env_ids", HELD, int), _int(msg.meta, "gen_rank", HELD)


@dataclass
class Segment:
    """T decision steps of one environment, all acted by one policy version.

    `images`/`state` hold T+1 observations: the last one bootstraps the value
    unless the episode terminated there.
    """

    traj_id: str
    env_id: int
    episode: int
    index: int  # segment number within the episode
    task: str
    instruction: str
    version: int  # behaviour version (every step of a segment has it)
    images: Optional[np.ndarray]  # uint8 [T+1, cams, H, W, 3]
    state: Optional[np.ndarray]  # float32 [T+1, D]
    actions: np.ndarray  # float32 [T, C, A]
    logprob: np.ndarray  # float32 [T, C]
    value: np.ndarray  # float32 [T]
    rewards: np.ndarray  # float32 [T, C]
    mask: np.ndarray  # bool [T, C]: which actions of each chunk were executed
    step_ids: np.ndarray  # int64 [T]: env step of the episode at which each chunk started
    versions: np.ndarray  # int64 [T]: the version each reply was tagged with
    terminated: bool
    truncated: bool
    success: bool
    t_start: float
    t_end: float
    sim_rank: int = 0
    incarnation: int = 0  # which process of its simulator worker (0; k after the k-th restart)
    # Whether the episode's outcome counts in success rates: not for one begun mid-phase in a lock-step phase that
    # starts from reset, since only the short ones end inside it (mostly quick successes; the rest are cut).
    scored: bool = True
    meta: Dict[str, float] = field(default_factory=dict)
    token_logprob: Optional[np.ndarray] = None  # float32 [T, C, A], when every reply of the segment had one
    replay: Optional[Dict[str, np.ndarray]] = None  # [T, ...] each: the replies' replay tensors (ActReply.replay)

    @property
    def steps(self) -> int:
        """Env steps in the segment."""
        return int(self.mask.sum())

    @property
    def length(self) -> int:
        return int(self.actions.shape[0])

    @property
    def episode_done(self) -> bool:
        return self.terminated or self.truncated


_SEG_ARRAYS = (
    "images",
    "state",
    "actions",
    "logprob",
    "value",
    "rewards",
    "mask",
    "step_ids",
    "versions",
    "token_logprob",
)
_SEG_META = (
    "traj_id",
    "env_id",
    "episode",
    "index",
    "task",
    "instruction",
    "version",
    "terminated",
    "truncated",
    "success",
    "t_start",
    "t_end",
    "sim_rank",
    "incarnation",
    "scored",
)


def encode_segment(seg: Segment) -> Message:
    arrays = {k: getattr(seg, k) for k in _SEG_ARRAYS if getattr(seg, k) is not None}
    arrays.update(replay_arrays(seg.replay))
    return Message(SEGMENT, {k: getattr(seg, k) for k in _SEG_META}, arrays)


_SEG_META_TYPES: Dict[str, Callable[[Mapping[str, Any], str, str], Any]] = {
    "traj_id": _str,
    "env_id": _int,
    "episode": _int,
    "index": _int,
    "task": _str,
    "instruction": _str,
    "version": _int,
    "terminated": _bool,
    "truncated": _bool,
    "success": _bool,
    "t_start": _float,
    "t_end": _float,
    "sim_rank": _int,
    "incarnation": _int,
    "scored": _bool,
}
_SEG_OPTIONAL = {"images": 1, "state": 1, "token_logprob": 0}  # optional arrays, and their rows past T


@_kept
def decode_segment(msg: Message) -> Segment:
    actions = _required(msg, "actions", None)
    if actions.ndim == 0 or not 0 < actions.shape[0] <= MAX_SEGMENT_STEPS:
        raise _bad(SEGMENT, f"array 'actions' has shape {actions.shape}: 1 to {MAX_SEGMENT_STEPS} steps expected")
    steps = actions.shape[0]
    arrays: Dict[str, Any] = {
        k: (_array if k in _SEG_OPTIONAL else _required)(msg, k, steps + _SEG_OPTIONAL.get(k, 0)) for k in _SEG_ARRAYS
    }
    if arrays["mask"].dtype != np.bool_:
        raise _bad(SEGMENT, f"array 'mask' has dtype {arrays['mask'].dtype}, not bool")
    meta = {k: check(msg.meta, k, SEGMENT) for k, check in _SEG_META_TYPES.items()}
    return Segment(**meta, **arrays, replay=decode_replay(msg, steps))


def _obs_arrays(obs: Observation) -> Dict[str, np.ndarray]:
    arrays = {}
    if obs.images is not None:
        arrays["images"] = obs.images
    if obs.state is not None:
        arrays["state"] = obs.state
    return arrays


def phase_end(version: int, sim_rank: int, steps: int, segments: int, incarnation: int = 0) -> Message:
    """A simulator finished its rollout phase of `version` (sync and pipelined modes)."""
    return Message(
        PHASE_END,
        {"version": version, "sim_rank": sim_rank, "steps": steps, "segments": segments, "incarnation": incarnation},
    )


@dataclass(frozen=True)
class PhaseEnd:
    version: int
    sim_rank: int
    steps: int
    segments: int
    incarnation: int


@_kept
def decode_phase_end(msg: Message) -> PhaseEnd:
    m, k = msg.meta, PHASE_END
    return PhaseEnd(
        _int(m, "version", k),
        _int(m, "sim_rank", k),
        _int(m, "steps", k),
        _int(m, "segments", k),
        _int(m, "incarnation", k, 0),
    )


def sim_restart(sim_rank: int, incarnation: int) -> Message:
    """A restarted simulator's first word: what its dead predecessor shipped of the current phase is void."""
    return Message(SIM_RESTART, {"sim_rank": sim_rank, "incarnation": incarnation})


@_kept
def decode_sim_restart(msg: Message) -> Tuple[int, int]:
    """(simulator rank, incarnation) of a `sim_restart`."""
    return _int(msg.meta, "sim_rank", SIM_RESTART), _int(msg.meta, "incarnation", SIM_RESTART)


def sim_done(sim_rank: int, segments: int, steps: int) -> Message:
    """A simulator's last message after a stop: it shipped `segments` segments of `steps` env steps in all."""
    return Message(SIM_DONE, {"sim_rank": sim_rank, "segments": segments, "steps": steps})


@_kept
def decode_sim_done(msg: Message) -> Tuple[int, int, int]:
    """(simulator rank, segments, steps) of a `sim_done`."""
    m, k = msg.meta, SIM_DONE
    return _int(m, "sim_rank", k), _int(m, "segments", k), _int(m, "steps", k)


def ctl(
    version: int,
    consumed_steps: int,
    stop: bool,
    taken: int = -1,
    waiting: int = 0,
    published: int = -1,
    published_at: int = -1,
    dropped_steps: int = 0,
) -> Message:
    """The trainer's state, published repeatedly (late subscribers miss nothing that matters).
    `taken`: the newest version whose rollout phase is over (its batch taken); -1 before the first.
    `waiting`: slots the trainer holds but cannot use yet (GRPO groups not whole), credited to the hold
    budget for now only: unlike `consumed_steps` it can go down again, so receivers must not latch it.
    `published`: the newest version whose weights went out (`rollout.publish_every` skips some); -1: `version`.
    `published_at`: the slots used (consumed, not dropped) when `published` went out, the base of the hold budget
    of the generators that serve it (-1: not said); `dropped_steps`: of `consumed_steps`, the slots of stale
    segments, which no longer count as served (a drop frees budget)."""
    meta = {"version": version, "consumed_steps": consumed_steps, "stop": stop, "taken": taken, "waiting": waiting}
    return Message(CTL, {**meta, "published": published, "published_at": published_at, "dropped": dropped_steps})


@dataclass(frozen=True)
class Ctl:
    version: int
    consumed_steps: int
    stop: bool
    taken: int
    waiting: int
    published: int
    """The newest version with weights to fetch (`version` when the sender did not say)."""
    published_at: int = -1
    """Slots used when `published` went out (-1: not said)."""
    dropped: int = 0
    """Of `consumed_steps`, the slots of stale segments."""


@_kept
def decode_ctl(msg: Message) -> Ctl:
    m, k = msg.meta, CTL
    return Ctl(
        _int(m, "version", k),
        _int(m, "consumed_steps", k),
        _bool(m, "stop", k),
        _int(m, "taken", k, -1),
        _int(m, "waiting", k, 0),
        _published(m, k),
        _int(m, "published_at", k, -1),
        _int(m, "dropped", k, 0),
    )


def _published(m: Mapping[str, object], k: str) -> int:
    published = _int(m, "published", k, -1)
    return _int(m, "version", k) if published < 0 else published


def offloaded(version: int, role: str, rank: int) -> Message:
    """Collocated layout: this rank's model (and optimizer state) left the GPU at its phase boundary of
    `version`, so trainer rank 0 may let the other role onto the device (`vlaslurm.runtime.offload`)."""
    return Message(OFFLOADED, {"version": version, "role": role, "rank": rank})


@_kept
def decode_offloaded(msg: Message) -> Tuple[int, str, int]:
    """(version, role, rank) of an `offloaded` report."""
    m, k = msg.meta, OFFLOADED
    return _int(m, "version", k), _str(m, "role", k), _int(m, "rank", k)


# --------------------------------------------------------------------------- what each socket takes

Decoders = Mapping[str, Callable[[Message], object]]
GENERATOR_INTAKE: Decoders = {OBS: decode_requests}  # a generator's Router
EVAL_GENERATOR_INTAKE: Decoders = {OBS: decode_obs, SIM_DONE: decode_sim_done}  # an eval job's generator
REPLIES: Decoders = {ACT: decode_acts, HELD: decode_held}  # a simulator's Dealers
TRAINER_INTAKE: Decoders = {  # trainer rank 0's Pull
    SEGMENT: decode_segment,
    PHASE_END: decode_phase_end,
    SIM_DONE: decode_sim_done,
    SIM_RESTART: decode_sim_restart,
    OFFLOADED: decode_offloaded,
}
ANNOUNCEMENTS: Decoders = {CTL: decode_ctl}  # every Sub of the trainer's Pub


def channel(job_key: str, name: str, *owner: object) -> str:
    """A channel's name, which keys its messages (`transport.channel_key`): the job attempt (`job_key`,
    which a requeue changes), what it carries (`name`: obs, act, segments, ctl) and, for a channel into one
    of several receivers, which one (a generator's rank and pid). A message recorded on one channel is
    refused on every other: another generator, a restarted one, or the next attempt of the job."""
    return "/".join([job_key, name, *(str(part) for part in owner)])


FRAME_FLOOR_BYTES = 8 << 20  # no receiving socket refuses a frame smaller than this
ROW_BYTES = 16 << 10  # per environment or step: room for a state vector and an instruction
ACTION_BYTES = 4 << 10  # per action of a chunk: room for its dimensions and per-token log-probs


def max_frame_bytes(env: EnvConfig, action_chunk: int = 1) -> int:
    """A generous bound on the largest frame any message of a run carries, for `ZMQ_MAXMSGSIZE` on every
    receiving socket: twice the largest array (an observation request of every environment at once, or a
    segment of `MAX_SEGMENT_STEPS` + 1 observations), plus the floor."""
    rows = max(env.num_envs, MAX_SEGMENT_STEPS + 1)
    cameras = len(env.obs.cameras) if env.obs.image_size else 0
    images = rows * cameras * env.obs.image_size**2 * 3
    other = rows * (ROW_BYTES + max(1, action_chunk) * ACTION_BYTES)
    return 2 * max(images, other) + FRAME_FLOOR_BYTES


def generator_channels(job_key: str, rank: int, pid: int) -> Dict[str, str]:
    """The channels of generator `rank` (process `pid`): requests in, replies out (Router/Dealer kwargs)."""
    return {"channel": channel(job_key, OBS, rank, pid), "reply_channel": channel(job_key, ACT, rank, pid)}
