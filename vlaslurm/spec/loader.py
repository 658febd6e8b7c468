"""Load an experiment spec: compose YAML (pass one), then type it section by
section with the dataclass registered for its `type` (pass two), then check the
cross-field rules (`validate.py`). Every error is a `SpecError` with a location.

Typing checks every field against its annotation, `Literal[...]` choices included
(wherever they sit: plain, Optional, in a list or a dict's values), so a field's
valid values are written once, in its type.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from vlaslurm.spec.compose import Locations, compose
from vlaslurm.spec.errors import Location, SpecError, close_names
from vlaslurm.spec.registry import SECTIONS, config_class, known_types
from vlaslurm.spec.schema import ExperimentSpec, resolve_restarts

if typing.TYPE_CHECKING:
    from vlaslurm.spec.sites import Site


@dataclass
class LoadedSpec:
    """A typed spec together with where each of its keys came from."""

    spec: ExperimentSpec
    path: Path
    files: List[Path]
    overrides: Tuple[str, ...]
    locations: Locations
    site: Optional[Site] = None  # the site profile whose defaults lie under the spec (vlaslurm.spec.sites)

    def where(self, key: str) -> Location:
        """The location of `key`, or of its nearest written parent, or the spec file."""
        return nearest(self.locations, key) or Location(str(self.path))

    def error(self, key: str, message: str, suggestions: Sequence[str] = ()) -> SpecError:
        """A SpecError for `key` at its location."""
        return SpecError(message, key=key, location=self.where(key), suggestions=suggestions)

    def check_resumable(self) -> None:
        """Raise a SpecError for an override that may not change when a run resumes (`schema.RESUMABLE`)."""
        from vlaslurm.spec.schema import RESUMABLE, resumable

        for item in self.overrides:
            key = item.split("=", 1)[0].strip()
            if not resumable(key):
                raise self.error(
                    key,
                    "cannot change when a run resumes: its checkpoint and samples depend on it (what can: "
                    f"{', '.join(RESUMABLE)})",
                )

    def to_dict(self) -> Dict[str, Any]:
        """The resolved spec as plain data (what `plan` prints and MLflow logs)."""
        return dataclasses.asdict(self.spec)

    def to_yaml(self) -> str:
        """The resolved spec as YAML, never interpolated."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_spec(path: str | Path, overrides: Sequence[str] = (), site: str | Path | Site | None = None) -> LoadedSpec:
    """Load, type and validate a spec file with `key=value` overrides, over a site profile's defaults
    (a site name, a site file, or a loaded Site); raise SpecError."""
    from vlaslurm.spec.sites import Site, check_spec_against_site, load_site

    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec file {str(path)!r} does not exist", location=Location(str(path)))
    site = site if site is None or isinstance(site, Site) else load_site(site)
    data, locations, files = compose(path, overrides, defaults=site.spec_defaults() if site else None)
    spec = _build(data, locations, path)
    resolve_restarts(spec)  # the role defaults of resources.<role>.max_restarts, before the checks
    loaded = LoadedSpec(spec, path, files, tuple(overrides), locations, site)
    from vlaslurm.spec.validate import validate

    validate(loaded)
    check_spec_against_site(loaded)
    return loaded


def nearest(locations: Locations, key: str) -> Optional[Location]:
    """The location of `key`, or of its nearest written parent (`a.b[2].c` -> `a.b[2]` -> `a.b` -> `a`)."""
    probe = key
    while probe:
        if probe in locations:
            return locations[probe]
        probe = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", probe) if re.search(r"[.\[]", probe) else ""
    return None


def _build(data: Dict[str, Any], locations: Locations, path: Path) -> ExperimentSpec:
    def where(key: str) -> Location:
        return nearest(locations, key) or Location(str(path))

    valid = [f.name for f in dataclasses.fields(ExperimentSpec)]
    for key in data:
        if key not in valid:
            raise SpecError(
                "unknown section", key=str(key), location=where(str(key)), suggestions=close_names(str(key), valid)
            )
    sections: Dict[str, Any] = {}
    for f in dataclasses.fields(ExperimentSpec):
        if f.name not in data:
            if f.name in SECTIONS:
                raise SpecError(
                    f"section is required (with a type: one of {', '.join(known_types(f.name))})",
                    key=f.name,
                    location=Location(str(path)),
                )
            continue
        cls = _section_class(f.name, data[f.name], where) if f.name in SECTIONS else f.type
        sections[f.name] = _typed(f.name, cls, data[f.name], where)
    return ExperimentSpec(**sections)


def _section_class(section: str, value: Any, where) -> type:
    if not isinstance(value, dict):
        raise SpecError("must be a mapping with a type: field", key=section, location=where(section))
    type_name = value.get("type")
    if type_name is None:
        raise SpecError(
            f"type is required; known types: {', '.join(known_types(section))}",
            key=f"{section}.type",
            location=where(section),
        )
    cls = config_class(section, str(type_name))
    if cls is None:
        types = known_types(section)
        raise SpecError(
            f"unknown type {type_name!r}; known types: {', '.join(types)}",
            key=f"{section}.type",
            location=where(f"{section}.type"),
            suggestions=close_names(str(type_name), types),
        )
    return cls


def _typed(section: str, cls: Any, value: Any, where) -> Any:
    """Merge user data into the dataclass `cls` in struct mode; map OmegaConf errors to SpecError."""
    if isinstance(cls, str):  # postponed annotation on a plain field, e.g. name: str
        cls = typing.get_type_hints(ExperimentSpec)[section]
    if not dataclasses.is_dataclass(cls):
        return _plain_value(section, cls, value, where)
    if not isinstance(value, dict):
        got = _SHAPES.get(type(value), type(value).__name__)
        raise SpecError(f"must be a mapping, got {got}", key=section, location=where(section))
    _check_choices(cls, value, section, where)
    _check_shape(cls, value, section, where)
    base = OmegaConf.structured(cls)
    try:
        merged = OmegaConf.merge(base, _escape(value))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _spec_error(section, base, exc, where) from None
    _check_scalar_elements(obj, section, where)
    return obj


def _plain_value(key: str, typ: Any, value: Any, where) -> Any:
    _check_choice(typ, value, key, where)
    if typing.get_origin(typ) is typing.Literal:
        return value
    if typ is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise SpecError(
        f"must be a {getattr(typ, '__name__', typ)}, got {type(value).__name__}", key=key, location=where(key)
    )


def _check_choices(cls: Any, value: Dict[str, Any], prefix: str, where) -> None:
    """Check the user's values in `value` against the `Literal` choices of the dataclass `cls`'s fields, before
    OmegaConf types them (its message would name neither close names nor the choices as written). Keys `cls` lacks
    are left to OmegaConf, which names the valid ones."""
    hints = typing.get_type_hints(cls)
    for name, item in value.items():
        if name in hints:
            _check_choice(hints[name], item, f"{prefix}.{name}", where)


def _check_choice(typ: Any, item: Any, key: str, where) -> None:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Literal:
        if item not in args:
            choices = [str(a) for a in args]
            raise SpecError(
                f"must be one of {', '.join(choices)}, got {item!r}",
                key=key,
                location=where(key),
                suggestions=close_names(str(item), choices),
            )
    elif origin is typing.Union:
        options = [a for a in args if a is not type(None)]
        if item is not None and len(options) == 1:
            _check_choice(options[0], item, key, where)
    elif origin in (list, tuple) and isinstance(item, list) and args:
        for index, element in enumerate(item):
            _check_choice(args[0], element, f"{key}[{index}]", where)
    elif origin is dict and isinstance(item, dict) and len(args) == 2:
        for name, element in item.items():
            _check_choice(args[1], element, f"{key}.{name}", where)
    elif dataclasses.is_dataclass(typ) and isinstance(item, dict):
        _check_choices(typ, item, key, where)


def _check_shape(typ: Any, item: Any, key: str, where) -> None:
    """Check that `item` has the shape of the annotation `typ` (mapping, list or single value; finite numbers)
    before OmegaConf merges it: its TypeError on a list where a mapping belongs names no field."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Union:
        options = [a for a in args if a is not type(None)]
        if item is not None and len(options) == 1:
            _check_shape(options[0], item, key, where)
    elif dataclasses.is_dataclass(typ):
        _check_fields(typ, _expect(item, dict, key, where), key, where)
    elif origin in (list, tuple):
        for index, element in enumerate(_expect(item, list, key, where)):
            _check_shape(args[0] if args else Any, element, f"{key}[{index}]", where)
    elif origin is dict:
        for name, element in _expect(item, dict, key, where).items():
            _check_shape(args[1] if len(args) == 2 else Any, element, f"{key}.{name}", where)
    elif typ is not Any and isinstance(item, (list, dict)):
        raise SpecError("must be a single value, not a list or mapping", key=key, location=where(key))
    elif typ in (float, int) and isinstance(item, float) and not math.isfinite(item):
        raise SpecError(f"must be a finite number, got {item}", key=key, location=where(key))
    elif typ is str and isinstance(item, bool):
        raise SpecError(
            f"must be text, got the boolean {str(item).lower()} (YAML reads unquoted yes/no/on/off/true/false "
            "as booleans); quote it",
            key=key,
            location=where(key),
        )


def _check_fields(cls: Any, value: Dict[str, Any], prefix: str, where) -> None:
    hints = typing.get_type_hints(cls)
    for name, item in value.items():
        if name in hints:
            _check_shape(hints[name], item, f"{prefix}.{name}", where)


_SHAPES: Dict[type, str] = {dict: "a mapping", list: "a list", type(None): "null (nothing)"}


def _expect(item: Any, shape: type, key: str, where) -> Any:
    if not isinstance(item, shape):
        got = _SHAPES.get(type(item), f"the single value {item!r}")
        raise SpecError(f"must be {_SHAPES[shape]}, got {got}", key=key, location=where(key))
    return item


def _spec_error(section: str, base: Any, exc: OmegaConfBaseException, where) -> SpecError:
    full_key = str(getattr(exc, "full_key", "") or "")
    key = f"{section}.{full_key}" if full_key else section
    key = key.replace(".[", "[")
    if isinstance(exc, ConfigKeyError):
        parent, _, name = full_key.rpartition(".")
        node = OmegaConf.select(base, parent) if parent else base
        valid = list(node.keys()) if hasattr(node, "keys") else []
        return SpecError(
            f"unknown key {name!r}; valid keys: {', '.join(map(str, valid))}",
            key=key,
            location=where(key),
            suggestions=close_names(name, map(str, valid)),
        )
    message = str(getattr(exc, "msg", "") or exc).splitlines()[0]
    return SpecError(_friendly(message), key=key, location=where(key))


def _friendly(message: str) -> str:
    message = message.replace("AnyNode is not a ListConfig, TupleConfig, list, or tuple", "expected a list")
    return message.replace("Invalid value assigned: ", "")


_INTERPOLATION = re.compile(r"(\\*)\$\{")


def _escape(value: Any) -> Any:
    """Make OmegaConf keep `${...}` literally: strings here reach a shell, never a resolver."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def _check_scalar_elements(obj: Any, prefix: str, where) -> None:
    """OmegaConf lets a nested list into List[str]; reject containers where scalars belong."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            _check_scalar_elements(value, key, where)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for index, item in items:
            if isinstance(item, (list, dict)):
                item_key = f"{key}.{index}" if isinstance(value, dict) else f"{key}[{index}]"
                raise SpecError("must be a single value, not a list or mapping", key=item_key, location=where(item_key))
