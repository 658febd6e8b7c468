"""One schedule per rollout mode: the scheduling decisions that the roles and the placement model share.

`Sync` and `Pipelined` run lock-step phases of one policy version (pipelined: `depth` sub-groups per
simulator rank); `Async` lets every environment run on its own, within `max_staleness`. The generator's
batching, the hold budget, the trainer's take and staleness, GRPO's whole groups: decided here, pure and
deterministic, and called alike by `runtime/roles` and `placement/simulate.py`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Deque, Dict, Generic, Iterable, List, Optional, Protocol, Sequence, Tuple, Type, TypeVar

from vlaslurm.spec.schema import ExperimentSpec, RolloutConfig

TIME_EPS = 1e-12  # a batch's max_wait is over at its due time, whatever the float rounding of now - arrival
# The longest a trainer with a full batch waits for GRPO groups still in play (`awaits_groups`): they end within
# an episode, unless a member is lost (its simulator restarted), which no wait mends.
GROUP_WAIT_S = 5.0
# The wait ends sooner once nothing has arrived for SILENCE_GAPS usual gaps between arrivals (`ArrivalGaps`), and
# at least SILENCE_FLOOR_S (a loaded machine's scheduling hiccup): then every generator holds (its budget spent on
# what the trainer's batch already has), so the groups in play cannot end before the update; waiting out
# GROUP_WAIT_S left async GRPO's trainer idle 40% of a run (docs/runtime.md).
SILENCE_GAPS = 20
SILENCE_FLOOR_S = 0.5


class ArrivalGaps:
    """The trainer's recent gaps between arrivals of data, whose median is the usual gap (one long gap, an update
    the trainer spent away from its inbox, does not move it)."""

    def __init__(self, keep: int = 63) -> None:
        self.gaps: Deque[float] = deque(maxlen=keep)
        self.last: Optional[float] = None
        self._silence_s = GROUP_WAIT_S  # `silence_s`, recomputed only when a gap comes (it is asked far more often)

    def arrived(self, now: float) -> None:
        """Data arrived at `now`; what arrives at one instant (the simulation's events) is one arrival, as what
        the trainer role takes from its inbox in one turn."""
        if self.last is not None and now > self.last:
            self.gaps.append(now - self.last)
            usual = statistics.median(self.gaps)
            self._silence_s = min(GROUP_WAIT_S, max(SILENCE_FLOOR_S, SILENCE_GAPS * usual))
        self.last = now

    def silence_s(self) -> float:
        """How long a silence ends a wait for groups in play: SILENCE_GAPS usual gaps, within
        [SILENCE_FLOOR_S, GROUP_WAIT_S]; GROUP_WAIT_S until gaps are known."""
        return self._silence_s


class SegmentFacts(Protocol):
    """What the schedule reads of a segment (`messages.Segment`, or the simulation's stand-in)."""

    env_id: int
    episode: int
    index: int  # segment number within its episode
    version: int  # behaviour version

    @property
    def steps(self) -> int: ...

    @property
    def episode_done(self) -> bool: ...


S = TypeVar("S", bound=SegmentFacts)


@dataclass
class Take(Generic[S]):
    """The trainer's next batch: what leaves the buffer (in order), of which `used`; `rest` stays buffered."""

    consumed: List[S] = field(default_factory=list)
    used: List[S] = field(default_factory=list)
    rest: List[S] = field(default_factory=list)


@dataclass(frozen=True)
class Schedule:
    """What every mode shares; build one with `Schedule.of` (or `from_spec`)."""

    steps_per_update: int = 0
    max_staleness: int = 0
    stale_policy: str = "drop"
    group_size: int = 1  # GRPO: episodes of one group (environments env_id // group_size); 1 = no groups
    max_batch: int = 64
    max_wait_s: float = 0.02

    mode: ClassVar[str] = ""
    lockstep: ClassVar[bool] = True  # phases of one version: fixed routing, the trainer waits for phase ends

    @staticmethod
    def kind(mode: str) -> Type[Schedule]:
        """The schedule class of `rollout.mode`."""
        return _KINDS[mode]

    @staticmethod
    def of(rollout: RolloutConfig, steps_per_update: int = 0, group_size: int = 1) -> Schedule:
        """From a `RolloutConfig` and the algorithm's batch size (`algo.steps_per_update`) and group size."""
        b = rollout.batching
        facts = (
            steps_per_update,
            rollout.max_staleness,
            rollout.stale_policy,
            group_size,
            b.max_batch,
            b.max_wait_ms / 1000.0,
        )
        kind = Schedule.kind(rollout.mode)
        return Pipelined(*facts, depth=rollout.depth) if kind is Pipelined else kind(*facts)

    @staticmethod
    def from_spec(spec: ExperimentSpec) -> Schedule:
        return Schedule.of(spec.rollout, spec.algo.steps_per_update, spec.algo.episodes_per_group)

    # ---------------------------------------------------------------- simulator
    @property
    def depth(self) -> int:
        """Sub-groups per simulator rank."""
        return 1

    @property
    def resets_each_phase(self) -> bool:
        """Every phase starts every instance from reset (lock-step with one sub-group)."""
        return self.lockstep and self.depth == 1

    @property
    def whole_groups(self) -> bool:
        """GRPO in async mode: a group's episodes start together and train together, whole."""
        return not self.lockstep and self.group_size > 1

    def sub_groups(self, instances: int) -> List[List[int]]:
        """The local instances of each sub-group that requests as one (async: each instance alone)."""
        if not self.lockstep:
            return [[i] for i in range(instances)]
        q, r = divmod(instances, self.depth)  # as np.array_split: the first r sub-groups one larger
        sizes = [q + 1 if g < r else q for g in range(self.depth)]
        starts = [sum(sizes[:g]) for g in range(self.depth)]
        return [list(range(s, s + n)) for s, n in zip(starts, sizes) if n]

    def step_threads(self, instances: int, thread_safe: bool) -> int:
        """Worker threads that step a rank's chunks: one per sub-group (or instance); 0 = on the main thread."""
        return len(self.sub_groups(instances)) if thread_safe else 0

    def phase_chunks(self, num_envs: int, chunk: int, episode_limit: int = 0) -> int:
        """Decisions (action chunks) each sub-group takes in one lock-step phase: enough for the update's env
        steps; a phase that starts from reset also enough for an episode of `episode_limit` env steps to end."""
        chunks = math.ceil(self.steps_per_update / (num_envs * chunk))
        if self.resets_each_phase:
            chunks = max(chunks, math.ceil(episode_limit / chunk))
        return chunks

    def route(self, sim_rank: int, outstanding: Sequence[int]) -> int:
        """The generator a simulator's next request goes to: fixed by rank (lock-step), else the least busy."""
        if self.lockstep:
            return sim_rank % len(outstanding)
        return min(range(len(outstanding)), key=outstanding.__getitem__)

    def released(self, waiting: Iterable[int]) -> List[int]:
        """Of the finished instances `waiting` for their group (`whole_groups`), those that start now: members
        of groups that have all finished. Without whole groups every finished instance starts at once."""
        waiting = set(waiting)
        if not self.whole_groups:
            return sorted(waiting)
        g = self.group_size
        return [i for i in sorted(waiting) if all(m in waiting for m in range(i - i % g, i - i % g + g))]

    # ---------------------------------------------------------------- generator
    def clients(self, gen_rank: int, simulators: int, generators: int) -> int:
        """Simulators whose requests all come to generator `gen_rank` (lock-step routing); 0 = any may (async)."""
        return len(range(gen_rank, simulators, generators)) if self.lockstep else 0

    @staticmethod
    def servable(min_version: int, version: int) -> bool:
        """A request asking for a newer version than the generator has waits for it (lock-step phases)."""
        return min_version <= version

    def batch_ready(self, sizes: Sequence[int], senders: int, clients: int, waited_s: float) -> bool:
        """Whether to serve now the servable requests, oldest first, of `sizes` items from `senders` distinct
        simulators, the oldest of which has waited `waited_s`: `max_batch` items wait, the wait is over, or
        every simulator routed here (`clients`) has asked (nothing more can come)."""
        if not sizes:
            return False
        everyone = clients > 0 and senders >= clients
        return everyone or sum(sizes) >= self.max_batch or waited_s >= self.max_wait_s - TIME_EPS

    def batch_size(self, sizes: Sequence[int], room: Optional[int] = None) -> int:
        """How many of the servable requests (oldest first) one forward serves: up to `max_batch` items, and up
        to `room` (what the hold budget leaves: `hold_room`, in items); a larger single request alone."""
        limit = self.max_batch if room is None else min(self.max_batch, room)
        count, items = 0, 0
        for n in sizes:
            if count and items + n > limit:
                break
            count, items = count + 1, items + n
        return count

    def hold_room(self, served: int, consumed: int, waiting: int, generators: int, chunk: int) -> Optional[int]:
        """Async `hold`: how many more items (environments' chunks) a generator may serve now (`holds`' budget;
        a forward must not overshoot it, or what it serves past the budget may be dropped). None: no budget."""
        if self.lockstep or self.stale_policy != "hold":
            return None
        return max(0, math.ceil((self._hold_budget(consumed, waiting, generators) - served) / chunk))

    def _hold_budget(self, consumed: int, waiting: int, generators: int) -> float:
        return (consumed + waiting + (self.max_staleness + 1) * self.steps_per_update) / generators

    @staticmethod
    def hold_base(bases: Dict[int, int], version: int, dropped: int, live_consumed: int) -> int:
        """The `consumed` of the hold budget for weights `version`: the slots the trainer had used when they went
        out (`bases`, heard per version) plus all it dropped since (never used, so no longer served in effect).
        Unheard (an announcement lost, weights found by polling), an older version's base stands in: smaller, so
        never too generous; with none heard, the trainer's live consumed count."""
        known = [v for v in bases if v <= version]
        return bases[max(known)] + dropped if known else live_consumed

    def holds(self, served: int, consumed: int, waiting: int, generators: int) -> bool:
        """Async `hold`: a generator stops serving once its share of the slots (env steps in whole chunks)
        served exceeds `consumed` (plus the slots the trainer holds but cannot use yet, `waiting`) by
        `max_staleness + 1` updates. `consumed` is the slots the trainer had used when the weights being served
        went out, plus every slot it dropped as stale (AReaL's rule: a version serves only what the trainer will
        use from it): each update uses at least `steps_per_update`, so updates v .. v + max_staleness use all
        of it, oldest version first."""
        if self.lockstep or self.stale_policy != "hold":
            return False
        return served >= self._hold_budget(consumed, waiting, generators)

    # ---------------------------------------------------------------- trainer
    def stale(self, version: int, behaviour: int) -> bool:
        """A segment acted by `behaviour` is past the staleness bound for an update of `version`."""
        return version - behaviour > self.max_staleness

    def update_ready(
        self, buffer: Sequence[SegmentFacts], buffered_steps: int, phase_ends: int, simulators: int
    ) -> bool:
        """Whether the trainer can take its next batch: every simulator ended the phase (lock-step), else
        `steps_per_update` env steps are buffered (in whole groups, with `whole_groups`)."""
        if self.lockstep:
            return phase_ends >= simulators
        if buffered_steps < self.steps_per_update:
            return False
        if self.whole_groups:
            whole, _ = complete_groups(buffer, self.group_size)
            return sum(s.steps for s in whole) >= self.steps_per_update
        return True

    def awaits_groups(
        self,
        buffer: Sequence[SegmentFacts],
        version: int,
        held_s: float,
        silent_s: float = 0.0,
        silence_s: float = GROUP_WAIT_S,
    ) -> bool:
        """Whole groups, a full batch buffered for the update of `version`: whether to wait (for at most
        GROUP_WAIT_S, `held_s` so far; and until nothing has arrived for `silence_s`, `ArrivalGaps.silence_s`,
        `silent_s` so far) for the groups still in play whose oldest segment this update may use and the next may
        not (a group is used whole). Their episodes span version changes: taken now such a group is used; taken by
        the next update it is dropped (12-14% of env steps in the quickstart's GRPO)."""
        if not self.whole_groups or held_s >= GROUP_WAIT_S or silent_s >= silence_s:
            return False
        _, in_play = complete_groups(buffer, self.group_size)
        oldest = [min(s.version for s in members) for members in by_group(in_play, self.group_size)]
        return any(self.stale(version + 1, v) and not self.stale(version, v) for v in oldest)

    def credited(self, buffer: Sequence[S], full: bool) -> List[S]:
        """Whole groups, the trainer waiting: the buffered segments whose slots count as consumed for the
        generators' hold budget (`holds`' `waiting`). Short of a full batch, all of them; with one, waiting for
        groups in play (`awaits_groups`), only theirs: crediting the batch too let each version serve about two
        batches, which the next update then had to take at once (17 updates in 70k env steps instead of 34)."""
        return list(buffer) if not full else complete_groups(buffer, self.group_size)[1]

    def _group_batch(self, whole: Sequence[S], version: int) -> Tuple[List[S], List[S]]:
        """Of the complete groups (oldest behaviour version first): those the next update may not use, then the
        others until `steps_per_update` env steps are used; the rest wait for the next update. Taking every
        complete group instead made async GRPO's batches about twice as large, with half the updates."""
        batch: List[S] = []
        held: List[S] = []
        steps = 0
        groups = by_group(whole, self.group_size)
        for members in sorted(groups, key=lambda g: min(s.version for s in g)):  # stable: arrival order
            oldest = min(s.version for s in members)
            if self.stale(version + 1, oldest) or steps < self.steps_per_update:
                batch += members
                steps += 0 if self.stale(version, oldest) else sum(s.steps for s in members)
            else:
                held += members
        return batch, held

    def take(self, buffer: Sequence[S], version: int) -> Take[S]:
        """The next batch, oldest first: lock-step the whole phase, in one order whatever the arrival order
        (the update is reproducible); whole groups up to `steps_per_update` (`_group_batch`), none split; else up to
        `steps_per_update` used env steps. Segments past the staleness bound are consumed, not used."""
        rest: List[S] = []
        if self.lockstep:
            queue = sorted(buffer, key=lambda s: (s.env_id, s.episode, s.index))
        elif self.whole_groups:
            whole, rest = complete_groups(buffer, self.group_size)
            queue, held = self._group_batch(whole, version)
            rest = held + rest
        else:  # a segment ships when its episode ends or its version changes: one served early may arrive late
            queue = sorted(buffer, key=lambda s: s.version)
        out: Take[S] = Take()
        steps, i = 0, 0
        while i < len(queue) and (self.lockstep or self.whole_groups or steps < self.steps_per_update):
            seg = queue[i]
            i += 1
            out.consumed.append(seg)
            if not self.stale(version, seg.version):
                out.used.append(seg)
                steps += seg.steps
        out.rest = queue[i:] + rest
        return out


@dataclass(frozen=True)
class Sync(Schedule):
    """Lock-step phases of one version, each simulator rank's instances as one request."""

    mode: ClassVar[str] = "sync"


@dataclass(frozen=True)
class Pipelined(Schedule):
    """Lock-step phases with `depth` sub-groups per simulator rank: one steps while another is served."""

    depth: int = 2  # a field here, the base's property (1) elsewhere

    mode: ClassVar[str] = "pipelined"


@dataclass(frozen=True)
class Async(Schedule):
    """Every environment requests and steps on its own; the trainer takes every `steps_per_update` steps."""

    mode: ClassVar[str] = "async"
    lockstep: ClassVar[bool] = False


_KINDS: Dict[str, Type[Schedule]] = {cls.mode: cls for cls in (Sync, Pipelined, Async)}


def group_key(seg: SegmentFacts, group_size: int) -> Tuple[int, int]:
    """A GRPO group: the episodes with one episode number of environments env_id // group_size."""
    return seg.env_id // group_size, seg.episode


def by_group(segments: Sequence[S], group_size: int) -> List[List[S]]:
    """The segments of each group, groups in the order of their first segment."""
    groups: Dict[Tuple[int, int], List[S]] = {}
    for seg in segments:
        groups.setdefault(group_key(seg, group_size), []).append(seg)
    return list(groups.values())


def complete_groups(segments: Sequence[S], group_size: int) -> Tuple[List[S], List[S]]:
    """Split segments into those whose whole group has ended and the rest, each in the given order.

    A group is `group_size` episodes, one per environment `env_id // group_size`, with the same episode
    number; it is complete when each of its episodes has all of its segments (numbered 0..k, the last one
    ending the episode).
    """
    parts: Dict[tuple, List[int]] = {}  # (env_id, episode) -> [segments seen, index of the ending segment]
    for seg in segments:
        seen = parts.setdefault((seg.env_id, seg.episode), [0, -1])
        seen[0] += 1
        if seg.episode_done:
            seen[1] = seg.index
    ended: Dict[tuple, int] = {}
    for (env_id, episode), (count, last) in parts.items():
        if last >= 0 and count == last + 1:
            key = (env_id // group_size, episode)
            ended[key] = ended.get(key, 0) + 1
    whole: List[S] = []
    rest: List[S] = []
    for seg in segments:
        (whole if ended.get(group_key(seg, group_size), 0) == group_size else rest).append(seg)
    return whole, rest
