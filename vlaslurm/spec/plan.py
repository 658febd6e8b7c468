"""From a spec to a hetjob plan: which nodes form each component, and which `srun` steps run on them.

A component is one group of nodes with one partition and node shape; roles that share a
`resources.<role>.group` run as parallel `--exact` steps in it. The layout decides the rest
(disaggregated, collocated, hybrid); an eval job is the same plan without the trainer. A step over
several components is one `srun` in colon form, one part per component.
Details: docs/slurm.md
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, List, Optional, Tuple

from vlaslurm.spec.loader import LoadedSpec
from vlaslurm.spec.schema import RoleResources

ROLE_ORDER = ("simulator", "generator", "trainer")
JOB_ROLES = {"train": ROLE_ORDER, "eval": ("simulator", "generator")}  # the roles each kind of job runs


@dataclass(frozen=True)
class StepPart:
    """The share of one step on one component."""

    het_group: int
    nodes: int
    tasks_per_node: int
    gpus_per_node: int  # GPUs this step's tasks share on each node

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class Step:
    """One `srun` step: all ranks of one role, over one or more components."""

    role: str
    parts: Tuple[StepPart, ...]
    cpus_per_task: int
    overlap: bool  # runs over resources that other steps hold too

    @property
    def het_groups(self) -> Tuple[int, ...]:
        return tuple(p.het_group for p in self.parts)

    @property
    def ntasks(self) -> int:
        return sum(p.ntasks for p in self.parts)


@dataclass(frozen=True)
class Component:
    """One hetjob component: a group of nodes of one shape."""

    index: int
    name: str
    roles: Tuple[str, ...]
    nodes: int
    partition: Optional[str]
    constraint: Optional[str]
    gpus_per_node: int
    cpus_per_node: int
    mem: Optional[str]
    gres_type: Optional[str] = None  # typed gres (--gres=gpu:<type>:N), from the site's spelling of gpu_type
    exclusive: bool = False  # #SBATCH --exclusive (the site's policy)


@dataclass(frozen=True)
class HetjobPlan:
    """Components and steps of one job, plus the rank count of each role."""

    name: str
    layout: str
    components: Tuple[Component, ...]
    steps: Tuple[Step, ...]
    kind: str = "train"  # "train", or "eval": no trainer (see JOB_ROLES)

    def ranks(self) -> Dict[str, int]:
        """Ranks per role (the rendezvous expects exactly these)."""
        return {step.role: step.ntasks for step in self.steps}

    def step(self, role: str) -> Step:
        return next(step for step in self.steps if step.role == role)


def job_run_name(spec_name: str, kind: str = "train") -> str:
    """The run name of a job of `kind`: the spec's name, or `<name>-eval` (local evals take the same name)."""
    return spec_name if kind == "train" else f"{spec_name}-{kind}"


def build_plan(loaded: LoadedSpec, kind: str = "train") -> HetjobPlan:
    """The hetjob plan of a validated spec: a training job, or (`kind="eval"`) the same without the trainer."""
    spec = loaded.spec
    layout = spec.resources.layout
    roles_of_job = JOB_ROLES[kind]
    placed = {"collocated": ("simulator",), "hybrid": ("simulator", "generator")}.get(layout, roles_of_job)
    components: List[Component] = []
    holders: Dict[str, List[Component]] = {role: [] for role in placed}
    for name, roles in _groups(spec, placed).items():
        shared = min(spec.role_resources(r).nodes for r in roles)
        shown = roles_of_job if layout == "collocated" else roles
        name = "collocated" if layout == "collocated" else name
        comp = _component(loaded, len(components), name, roles, shown, shared)
        components.append(comp)
        for role in roles:
            holders[role].append(comp)
        for role in roles:
            extra = spec.role_resources(role).nodes - shared
            if extra > 0:
                comp = _component(loaded, len(components), f"{role} (extra nodes)", [role], (role,), extra)
                components.append(comp)
                holders[role].append(comp)
    steps = [_exclusive_step(spec, role, comps) for role, comps in holders.items()]
    if layout == "collocated":
        steps += [_overlap_step(spec, role, components[:1], per_gpu=False) for role in roles_of_job[1:]]
    elif layout == "hybrid" and "trainer" in roles_of_job:
        with_gpus = [c for c in components if c.gpus_per_node] or components
        steps.append(_overlap_step(spec, "trainer", with_gpus, per_gpu=True))
    steps.sort(key=lambda s: ROLE_ORDER.index(s.role))
    return HetjobPlan(spec.name, layout, tuple(_room_for_overlap(components, steps)), tuple(steps), kind)


def _room_for_overlap(components: List[Component], steps: List[Step]) -> List[Component]:
    """Overlap steps share CPUs but cannot use more than the component holds: ask for enough."""
    need = {c.index: c.cpus_per_node for c in components}
    for step in steps:
        for part in step.parts:
            need[part.het_group] = max(need[part.het_group], part.tasks_per_node * step.cpus_per_task)
    return [replace(c, cpus_per_node=need[c.index]) for c in components]


def _groups(spec, roles) -> Dict[str, List[str]]:
    groups: Dict[str, List[str]] = {}
    for role in roles:
        res: RoleResources = spec.role_resources(role)
        groups.setdefault(res.group or role, []).append(role)
    return groups


def _component(loaded: LoadedSpec, index: int, name: str, holders: List[str], shown, nodes: int) -> Component:
    spec = loaded.spec
    first: RoleResources = spec.role_resources(holders[0])
    held = [spec.role_resources(role) for role in holders]
    gpus = sum(r.gpus_per_node for r in held)
    constraint, gres_type = _gpu_spelling(loaded, first) if gpus else (first.constraint, None)
    policy = loaded.site.config.exclusive if loaded.site else "never"
    return Component(
        index=index,
        name=name,
        roles=tuple(shown),
        nodes=nodes,
        partition=first.partition or spec.slurm.partition,
        constraint=constraint,
        gpus_per_node=gpus,
        cpus_per_node=sum(r.tasks_per_node * r.cpus_per_task for r in held),
        mem=_total_mem([r.mem for r in held]),
        gres_type=gres_type if gpus else None,
        exclusive=policy == "always" or (policy == "gpu" and gpus > 0),
    )


def _gpu_spelling(loaded: LoadedSpec, res: RoleResources) -> Tuple[Optional[str], Optional[str]]:
    """--constraint and gres type of a role: its own constraint AND what the site says its gpu_type is
    (without a site, the gpu_type itself is the constraint)."""
    if not res.gpu_type:
        return res.constraint, None
    spelling = loaded.site.gpu_spelling(res.gpu_type) if loaded.site else None
    type_constraint = spelling.constraint if spelling else res.gpu_type
    parts = [c for c in (res.constraint, type_constraint) if c]
    return ("&".join(parts) or None), (spelling.gres if spelling else None)


def _exclusive_step(spec, role: str, comps: List[Component]) -> Step:
    res: RoleResources = spec.role_resources(role)
    parts = tuple(StepPart(c.index, c.nodes, res.tasks_per_node, res.gpus_per_node) for c in comps)
    return Step(role, parts, res.cpus_per_task, False)


def _overlap_step(spec, role: str, comps: List[Component], per_gpu: bool) -> Step:
    """A step over every GPU of `comps`: one rank per GPU (hybrid trainer) or the role's tasks_per_node."""
    res: RoleResources = spec.role_resources(role)
    parts = tuple(
        StepPart(
            c.index,
            c.nodes,
            (c.gpus_per_node or res.tasks_per_node) if per_gpu else res.tasks_per_node,
            c.gpus_per_node,
        )
        for c in comps
    )
    return Step(role, parts, res.cpus_per_task, True)


def _total_mem(values: List[Optional[str]]) -> Optional[str]:
    """Memory of a node shared by several roles: the sum of what they ask (steps run with --mem=0)."""
    sized = [v for v in values if v]
    if len(sized) <= 1:
        return sized[0] if sized else None
    return f"{int(sum(_mem_mb(v) for v in sized))}M"


# Whether a plan can ever start on some nodes. Slurm starts a hetjob only when every component can have its
# own free nodes at once, even if two components could share one; so the check assigns distinct nodes.


@dataclass(frozen=True)
class Node:
    """One node as sinfo reports it."""

    name: str
    partitions: FrozenSet[str]
    cpus: int
    mem_mb: int
    gpus: int
    features: FrozenSet[str]


def check_fits(loaded: LoadedSpec, plan: HetjobPlan, nodes: List[Node], default: Optional[str]) -> None:
    """Raise SpecError, naming the role's fields, when some component can never be scheduled."""
    taken: set = set()
    # Most demanding components first, so a greedy choice rarely blocks a later one.
    for comp in sorted(plan.components, key=lambda c: (-c.gpus_per_node, -c.cpus_per_node)):
        fitting = [n for n in nodes if _fits(comp, n, default)]
        free = [n for n in fitting if n.name not in taken]
        role = comp.roles[0]
        if len(fitting) < comp.nodes:
            raise loaded.error(f"resources.{role}", _why_not(comp, nodes, fitting, default))
        if len(free) < comp.nodes:
            raise loaded.error(
                f"resources.{role}",
                f"component {comp.index} ({'+'.join(comp.roles)}) needs {comp.nodes} node(s) of its own, but the "
                f"other components already take {len(fitting) - len(free)} of the {len(fitting)} that fit: a hetjob "
                f"starts only when each component has its own free nodes ({len(plan.components)} components need "
                f"{sum(c.nodes for c in plan.components)} nodes)",
            )
        taken.update(n.name for n in free[: comp.nodes])


def _fits(comp: Component, node: Node, default: Optional[str]) -> bool:
    partition = comp.partition or default
    return (
        (partition is None or partition in node.partitions)
        and node.cpus >= comp.cpus_per_node
        and node.gpus >= comp.gpus_per_node
        and (not comp.mem or node.mem_mb >= _mem_mb(comp.mem))
        and (not comp.constraint or _constraint_ok(comp.constraint, node.features))
    )


def _constraint_ok(constraint: str, features: FrozenSet[str]) -> bool:
    # Slurm's syntax: '&' and ',' both mean AND, '|' OR; brackets and counts are left to Slurm.
    if re.search(r"[\[\]*]", constraint):
        return True
    return all(any(alt in features for alt in part.split("|")) for part in re.split(r"[&,]", constraint))


def _mem_mb(value: str) -> int:
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    unit = value[-1].upper()
    return int(float(value[:-1]) * units[unit]) if unit in units else int(value)


def _why_not(comp: Component, nodes: List[Node], fitting: List[Node], default: Optional[str]) -> str:
    partition = comp.partition or default
    in_partition = [n for n in nodes if partition is None or partition in n.partitions]
    need = (
        f"{comp.nodes} node(s) with {comp.cpus_per_node} CPUs, {comp.gpus_per_node} GPUs"
        + (f", {comp.mem}" if comp.mem else "")
        + (f", constraint {comp.constraint}" if comp.constraint else "")
    )
    if not in_partition:
        known = sorted({p for n in nodes for p in n.partitions})
        return f"partition {partition!r} does not exist; partitions: {', '.join(known)}"
    best = max(in_partition, key=lambda n: (n.gpus, n.cpus))
    return (
        f"component {comp.index} ({'+'.join(comp.roles)}) needs {need} in partition {partition!r}, but only "
        f"{len(fitting)} node(s) there fit (largest: {best.name} with {best.cpus} CPUs, {best.gpus} GPUs, "
        f"{best.mem_mb} MB, features {','.join(sorted(best.features)) or 'none'})"
    )
