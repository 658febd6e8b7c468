"""Site profiles: what belongs to the cluster, not to the experiment.

A site is a YAML file chosen by `--site NAME` (or `$VLASLURM_SITE`), looked up in
`$XDG_CONFIG_HOME/vlaslurm/sites/` and then `vlaslurm/sites/` (a path works too; `none`: no site).
It holds spec `defaults` (merged under the spec), the `container` defaults, `partitions` and
`gpu_types`, `exclusive`, `setup`, `scratch` and `runs_root`.
Details: docs/slurm.md
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Tuple, get_args

from vlaslurm.spec.compose import Locations, _read_yaml
from vlaslurm.spec.errors import COMMAND_LINE, Location, SpecError, close_names
from vlaslurm.spec.registry import doc
from vlaslurm.spec.schema import ContainerRuntime

if TYPE_CHECKING:
    from vlaslurm.spec.loader import LoadedSpec
    from vlaslurm.spec.plan import HetjobPlan, Node

SITE_ENV = "VLASLURM_SITE"
PACKAGE_SITES = Path(__file__).resolve().parent.parent / "sites"
Exclusive = Literal["never", "gpu", "always"]
EXCLUSIVE: Tuple[str, ...] = get_args(Exclusive)
ROLES = ("simulator", "generator", "trainer")


@dataclass
class PartitionShape:
    """One partition and the shape of its nodes."""

    nodes: int = doc(1, "Nodes in the partition.")
    cpus: int = doc(1, "CPUs per node.")
    mem: Optional[str] = doc(None, "Memory per node, Slurm syntax (e.g. 500G).")
    gpus: int = doc(0, "GPUs per node.")
    gpu_type: Optional[str] = doc(None, "GPU type of its nodes (a key of gpu_types).")
    default: bool = doc(False, "Slurm's default partition.")


@dataclass
class GpuType:
    """How one GPU type is asked for on this site."""

    constraint: Optional[str] = doc(None, "--constraint value, e.g. h100 or 'gpu80g&h100'.")
    gres: Optional[str] = doc(None, "Typed gres name: h100 gives --gres=gpu:h100:N; None = untyped gpu:N.")


@dataclass
class SiteContainer:
    """Container settings every role starts from (defaults under resources.<role>.container)."""

    runtime: Optional[ContainerRuntime] = doc(None, "pyxis | apptainer.")
    image: Optional[str] = doc(None, "A site-wide image; None = no container unless the spec names one.")
    mounts: List[str] = doc([], "Mounts SRC[:DST[:FLAGS]] of every container.")
    python: Optional[str] = doc(None, "Python inside the image.")
    options: List[str] = doc([], "Further flags of the runtime.")


@dataclass
class SiteConfig:
    """The typed site file (`defaults` stays a plain partial spec, typed with the spec)."""

    description: str = doc("", "What cluster this is.")
    partitions: Dict[str, PartitionShape] = doc({}, "Partitions and their node shapes.")
    gpu_types: Dict[str, GpuType] = doc({}, "GPU types and their --constraint/--gres spelling.")
    exclusive: Exclusive = doc("never", "never | gpu (components with GPUs) | always: #SBATCH --exclusive.")
    setup: List[str] = doc([], "Shell lines run before the spec's slurm.setup (module load ...).")
    scratch: Optional[str] = doc(None, "Scratch folder; $VARS and ~ expand at load. Exported as VLASLURM_SCRATCH.")
    runs_root: Optional[str] = doc(None, "Default runs root with this site; $VARS and ~ expand at load.")
    container: SiteContainer = field(default_factory=SiteContainer, metadata={"doc": "Container defaults."})
    defaults: Dict[str, Any] = doc({}, "A partial spec merged under every spec (the spec wins).")


@dataclass
class Site:
    """A loaded site profile and where each of its keys was written."""

    name: str
    path: Path
    config: SiteConfig
    locations: Locations  # keys as written in the site file
    raw_container: Dict[str, Any] = field(default_factory=dict, repr=False)  # container keys as written

    def where(self, key: str) -> Location:
        return self.locations.get(key, Location(str(self.path)))

    def spec_defaults(self) -> Tuple[Dict[str, Any], Locations]:
        """The partial spec this site puts under every spec, with site-file locations per dotted key."""
        data = copy.deepcopy(self.config.defaults)
        locations = {k[len("defaults.") :]: v for k, v in self.locations.items() if k.startswith("defaults.")}
        written = self.raw_container
        if written:
            resources = data.setdefault("resources", {})
            for role in ROLES:
                target = resources.setdefault(role, {}).setdefault("container", {})
                for key, value in written.items():
                    target.setdefault(key, copy.deepcopy(value))
                    locations.setdefault(f"resources.{role}.container.{key}", self.where(f"container.{key}"))
                    for sub in [k for k in self.locations if k.startswith(f"container.{key}[")]:
                        locations.setdefault(f"resources.{role}.{sub}", self.locations[sub])
            for key in ("resources", *(f"resources.{r}" for r in ROLES), *(f"resources.{r}.container" for r in ROLES)):
                locations.setdefault(key, self.where("container"))
        return data, locations

    def gpu_spelling(self, gpu_type: str) -> GpuType:
        return self.config.gpu_types.get(gpu_type) or GpuType(constraint=gpu_type)

    def nodes(self) -> List[Node]:
        """One Node per partition (its shape), for an offline fit check."""
        from vlaslurm.spec.plan import Node

        nodes = []
        for name, p in self.config.partitions.items():
            features = (
                {p.gpu_type, *(self.gpu_spelling(p.gpu_type).constraint or "").split("&")} if p.gpu_type else set()
            )
            nodes += [
                Node(
                    f"{name}-{i}",
                    frozenset({name}),
                    p.cpus,
                    _mem_mb(p.mem),
                    p.gpus,
                    frozenset(f for f in features if f),
                )
                for i in range(p.nodes)
            ]
        return nodes

    def default_partition(self) -> Optional[str]:
        return next((name for name, p in self.config.partitions.items() if p.default), None)


def site_dirs() -> List[Path]:
    """Where site names are looked up, first match wins: the user's config folder, then the package."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [config / "vlaslurm" / "sites", PACKAGE_SITES]


def available_sites() -> List[str]:
    return sorted({p.stem for d in site_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def selected_site_name(cli_value: Optional[str]) -> Optional[str]:
    """`--site` if given, else $VLASLURM_SITE; `none` (or empty) selects no site."""
    name = cli_value if cli_value is not None else os.environ.get(SITE_ENV)
    return None if not name or name == "none" else name


def find_site(name: str) -> Path:
    """The file of site `name` (or `name` itself if it is a path to a file)."""
    if "/" in name or name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if path.is_file():
            return path
        raise SpecError(f"site file {name!r} does not exist", key="site", location=Location(COMMAND_LINE))
    for directory in site_dirs():
        path = directory / f"{name}.yaml"
        if path.is_file():
            return path
    known = available_sites()
    raise SpecError(
        f"no site {name!r} in {', '.join(map(str, site_dirs()))}; sites: {', '.join(known) or 'none'}",
        key="site",
        location=Location(COMMAND_LINE),
        suggestions=close_names(name, known),
    )


def load_site(name_or_path: str | Path) -> Site:
    """Find, read and type a site profile; every error names the site file and line."""
    path = Path(name_or_path) if isinstance(name_or_path, Path) else find_site(name_or_path)
    raw, locations = _read_yaml(path)
    from vlaslurm.spec.loader import _typed

    def where(key: str) -> Location:
        return locations.get(key.removeprefix("site."), Location(str(path)))

    defaults = raw.pop("defaults", {})
    if not isinstance(defaults, dict):
        raise SpecError(
            "must be a mapping: a partial spec (slurm:, resources:, ...)", key="defaults", location=where("defaults")
        )
    try:
        config = _typed("site", SiteConfig, raw, where)
    except SpecError as exc:
        raise SpecError(
            exc.message, key=exc.key.removeprefix("site."), location=exc.location, suggestions=exc.suggestions
        ) from None
    config.defaults = defaults
    site = Site(path.stem, path, config, locations, raw_container=dict(raw.get("container") or {}))
    _check_site(site)
    for attr in ("scratch", "runs_root"):
        value = getattr(config, attr)
        if value:
            setattr(config, attr, os.path.expanduser(os.path.expandvars(value)))
    return site


def _check_site(site: Site) -> None:
    config = site.config
    defaults = [name for name, p in config.partitions.items() if p.default]
    if len(defaults) > 1:
        raise SpecError(
            f"only one partition can be the default, got {', '.join(defaults)}",
            key=f"partitions.{defaults[1]}.default",
            location=site.where(f"partitions.{defaults[1]}.default"),
        )
    for name, shape in config.partitions.items():
        if shape.gpu_type and config.gpu_types and shape.gpu_type not in config.gpu_types:
            key = f"partitions.{name}.gpu_type"
            raise SpecError(
                f"unknown GPU type {shape.gpu_type!r}; gpu_types: {', '.join(config.gpu_types)}",
                key=key,
                location=site.where(key),
                suggestions=close_names(shape.gpu_type, config.gpu_types),
            )


def check_spec_against_site(loaded: LoadedSpec) -> None:
    """The spec's partitions and GPU types must be ones the site knows (when the site lists any)."""
    site = loaded.site
    if site is None:
        return
    partitions, gpu_types = site.config.partitions, site.config.gpu_types
    for role in ROLES:
        res = loaded.spec.role_resources(role)
        key, partition = (
            (f"resources.{role}.partition", res.partition)
            if res.partition
            else ("slurm.partition", loaded.spec.slurm.partition)
        )
        if partitions and partition and partition not in partitions:
            raise loaded.error(
                key,
                f"site {site.name} has no partition {partition!r}; partitions: {', '.join(partitions)}",
                suggestions=close_names(partition, partitions),
            )
        if gpu_types and res.gpu_type and res.gpu_type not in gpu_types:
            raise loaded.error(
                f"resources.{role}.gpu_type",
                f"site {site.name} has no GPU type {res.gpu_type!r}; gpu_types: {', '.join(gpu_types)}",
                suggestions=close_names(res.gpu_type, gpu_types),
            )


def site_additions(loaded: LoadedSpec) -> List[Tuple[str, Any, Location]]:
    """(dotted key, value, site location) of every leaf value the site put into the spec."""
    site = loaded.site
    if site is None:
        return []
    site_file = str(site.path)
    keys = [k for k, loc in loaded.locations.items() if loc.file == site_file]
    # leaves, with a list shown whole rather than item by item
    leaves = [k for k in keys if "[" not in k and not any(other.startswith(k + ".") for other in keys)]
    return [(key, _lookup(loaded.spec, key), loaded.locations[key]) for key in sorted(leaves)]


def describe(loaded: LoadedSpec, plan: HetjobPlan) -> List[str]:
    """What `vlaslurm plan` prints about the site: where it is, what it added, and whether the plan fits its shapes."""
    site = loaded.site
    if site is None:
        return []
    config = site.config
    lines = [f"site {site.name} ({site.path}){': ' + config.description if config.description else ''}"]
    for key, value, where in site_additions(loaded):
        lines.append(f"  added   {key} = {value!r}  ({where})")
    for line in config.setup:
        lines.append(f"  setup   {line}")
    for comp in plan.components:
        extras = [
            f"--constraint={comp.constraint}" if comp.constraint else "",
            f"--gres=gpu:{comp.gres_type}:{comp.gpus_per_node}" if comp.gres_type and comp.gpus_per_node else "",
            "--exclusive" if comp.exclusive else "",
        ]
        if any(extras):
            lines.append(f"  comp {comp.index} {' '.join(e for e in extras if e)}")
    if config.scratch:
        lines.append(f"  scratch {config.scratch} (VLASLURM_SCRATCH)")
    if config.partitions:
        from vlaslurm.spec.plan import check_fits

        try:
            for comp in plan.components:  # one at a time: the shapes say nothing about which nodes are shared
                check_fits(loaded, _one(plan, comp), site.nodes(), site.default_partition())
            lines.append("  fits    every component fits the site's node shapes")
        except SpecError as exc:
            lines.append(f"  DOES NOT FIT the site's node shapes: {exc}")
    return lines


def _one(plan: HetjobPlan, comp) -> HetjobPlan:
    from dataclasses import replace

    return replace(plan, components=(comp,))


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _mem_mb(value: Optional[str]) -> int:
    if not value:
        return 1 << 40
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    unit = value[-1].upper()
    return int(float(value[:-1]) * units[unit]) if unit in units else int(value)


def site_runs_root(cli_value: Optional[str]) -> Optional[str]:
    """The selected site's `runs_root`, if it sets one."""
    name = selected_site_name(cli_value)
    return load_site(name).config.runs_root if name else None
