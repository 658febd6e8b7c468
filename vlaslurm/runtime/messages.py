"""Every message of a run, encoded and decoded in one place.

The path of one sample: the simulator sends an `obs` request, the generator
answers with an `act` reply tagged with the policy version that produced it, and
the simulator ships finished `Segment`s (a trajectory, or a piece of one, of a
single behaviour version) to the trainer. The trainer's `ctl` announcements
carry its version, what it has consumed, the newest phase whose batch it took,
and when to stop. In the collocated layout every generator and trainer rank tells
trainer rank 0 when its state has left the GPU (`offloaded`), so that the next
role moves on only once the device is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from vlaslurm.envs.base import Observation
from vlaslurm.runtime.transport import Message

OBS, ACT, HELD, SEGMENT, PHASE_END, SIM_DONE, CTL = "obs", "act", "held", "segment", "phase_end", "sim_done", "ctl"
SIM_RESTART, OFFLOADED = "sim_restart", "offloaded"


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


def encode_obs(req: ObsRequest) -> Message:
    arrays = _obs_arrays(req.obs)
    meta = {
        "env_ids": req.env_ids,
        "episodes": req.episodes,
        "steps": req.steps,
        "seeds": req.seeds,
        "instructions": req.obs.instructions,
        "sub_group": req.sub_group,
        "min_version": req.min_version,
        "sent_at": req.sent_at,
        "sim_rank": req.sim_rank,
    }
    return Message(OBS, meta, arrays)


def decode_obs(msg: Message) -> ObsRequest:
    m = msg.meta
    obs = Observation(msg.arrays.get("images"), msg.arrays.get("state"), list(m["instructions"]))
    return ObsRequest(
        list(m["env_ids"]),
        list(m["episodes"]),
        list(m["steps"]),
        list(m["seeds"]),
        obs,
        int(m["sub_group"]),
        int(m["min_version"]),
        float(m["sent_at"]),
        int(m["sim_rank"]),
    )


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


def encode_act(rep: ActReply) -> Message:
    arrays = {"actions": rep.actions, "logprob": rep.logprob, "value": rep.value}
    if rep.token_logprob is not None:
        arrays["token_logprob"] = rep.token_logprob
    return Message(
        ACT,
        {"env_ids": rep.env_ids, "sub_group": rep.sub_group, "version": rep.version, "gen_rank": rep.gen_rank},
        arrays,
    )


def decode_act(msg: Message) -> ActReply:
    m = msg.meta
    return ActReply(
        list(m["env_ids"]),
        int(m["sub_group"]),
        int(m["version"]),
        msg.arrays["actions"],
        msg.arrays["logprob"],
        msg.arrays["value"],
        int(m["gen_rank"]),
        msg.arrays.get("token_logprob"),
    )


def held(env_ids: List[int], gen_rank: int) -> Message:
    """The generator holds this request (`stale_policy: hold`): ship what these environments have
    stepped so far, so that the trainer can consume it and lift the hold. Repeated while the hold lasts."""
    return Message(HELD, {"env_ids": list(env_ids), "gen_rank": gen_rank})


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
    meta: Dict[str, float] = field(default_factory=dict)
    token_logprob: Optional[np.ndarray] = None  # float32 [T, C, A], when every reply of the segment had one

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
)


def encode_segment(seg: Segment) -> Message:
    arrays = {k: getattr(seg, k) for k in _SEG_ARRAYS if getattr(seg, k) is not None}
    return Message(SEGMENT, {k: getattr(seg, k) for k in _SEG_META}, arrays)


def decode_segment(msg: Message) -> Segment:
    arrays: Dict[str, Any] = {k: msg.arrays.get(k) for k in _SEG_ARRAYS}
    return Segment(**{k: msg.meta[k] for k in _SEG_META}, **arrays)


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


def sim_restart(sim_rank: int, incarnation: int) -> Message:
    """A restarted simulator's first word: what its dead predecessor shipped of the current phase is void."""
    return Message(SIM_RESTART, {"sim_rank": sim_rank, "incarnation": incarnation})


def sim_done(sim_rank: int, segments: int, steps: int) -> Message:
    """A simulator's last message after a stop: it shipped `segments` segments of `steps` env steps in all."""
    return Message(SIM_DONE, {"sim_rank": sim_rank, "segments": segments, "steps": steps})


def ctl(version: int, consumed_steps: int, stop: bool, taken: int = -1, waiting: int = 0) -> Message:
    """The trainer's state, published repeatedly (late subscribers miss nothing that matters).
    `taken`: the newest version whose rollout phase is over (its batch taken); -1 before the first.
    `waiting`: slots the trainer holds but cannot use yet (GRPO groups not whole), credited to the hold
    budget for now only: unlike `consumed_steps` it can go down again, so receivers must not latch it."""
    return Message(
        CTL, {"version": version, "consumed_steps": consumed_steps, "stop": stop, "taken": taken, "waiting": waiting}
    )


def offloaded(version: int, role: str, rank: int) -> Message:
    """Collocated layout: this rank's model (and optimizer state) left the GPU at its phase boundary of
    `version`, so trainer rank 0 may let the other role onto the device (`vlaslurm.runtime.offload`)."""
    return Message(OFFLOADED, {"version": version, "role": role, "rank": rank})
