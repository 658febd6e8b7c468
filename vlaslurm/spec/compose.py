"""Pass one of loading: compose the YAML of an `extends` chain and `key=value`
overrides into one plain mapping, remembering where every dotted key was written.

OmegaConf keeps no line numbers, so this pass owns them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from vlaslurm.spec.errors import COMMAND_LINE, Location, SpecError

Locations = Dict[str, Location]


def compose(
    path: Path,
    overrides: Sequence[str] = (),
    defaults: Optional[Tuple[Dict[str, Any], Locations]] = None,
) -> Tuple[Dict[str, Any], Locations, List[Path]]:
    """The merged mapping, each dotted key's location, and the files read (child last).

    `defaults` (a site profile's partial spec and its locations) go under the files; overrides on top."""
    data, locations, files = _compose_file(Path(path), chain=())
    if defaults is not None:
        base, base_locations = copy.deepcopy(defaults[0]), dict(defaults[1])
        _deep_merge(base, data)
        for key in locations:  # a list the spec writes replaces the site's: forget the site's items
            for stale in [k for k in base_locations if k.startswith(key + "[")]:
                del base_locations[stale]
        base_locations.update(locations)
        data, locations = base, base_locations
    for item in overrides:
        _apply_override(data, locations, item)
    return data, locations, files


def _compose_file(path: Path, chain: Tuple[Path, ...]) -> Tuple[Dict[str, Any], Locations, List[Path]]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise SpecError(f"extends forms a cycle: {cycle}", key="extends", location=Location(str(path)))
    data, locations = _read_yaml(path)
    parent_name = data.pop("extends", None)
    if parent_name is None:
        return data, locations, [path]
    where = locations.pop("extends")
    if not isinstance(parent_name, str):
        raise SpecError("must be the path of another spec file", key="extends", location=where)
    parent_path = (path.parent / parent_name) if not Path(parent_name).is_absolute() else Path(parent_name)
    if not parent_path.is_file():
        raise SpecError(f"file {str(parent_path)!r} does not exist", key="extends", location=where)
    parent, parent_locations, files = _compose_file(parent_path, (*chain, resolved))
    _deep_merge(parent, data)
    parent_locations.update(locations)
    return parent, parent_locations, [*files, path]


def _read_yaml(path: Path) -> Tuple[Dict[str, Any], Locations]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read spec: {exc.strerror}", location=Location(str(path))) from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise SpecError(
            f"not UTF-8 text (byte {exc.object[exc.start]:#04x})", location=Location(str(path), line)
        ) from None
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else {}
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        yaml_line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"invalid YAML: {problem}", location=Location(str(path), yaml_line)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(
            "a spec must be a mapping of sections (name:, env:, model: ...)", location=Location(str(path), 1)
        )
    locations: Locations = {}
    if node is not None:
        _record_locations(node, "", str(path), locations)
    return data, locations


def _record_locations(node: yaml.Node, prefix: str, file: str, out: Locations) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[key] = Location(file, key_node.start_mark.line + 1)
            _record_locations(value_node, key, file, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            key = f"{prefix}[{index}]"
            out[key] = Location(file, item.start_mark.line + 1)
            _record_locations(item, key, file, out)


def _deep_merge(base: Dict[str, Any], update: Dict[str, Any]) -> None:
    """Merge `update` into `base`: mappings merge key by key; anything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _apply_override(data: Dict[str, Any], locations: Locations, item: str) -> None:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError(f"override {item!r} must look like dotted.key=value", location=Location(COMMAND_LINE))
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep it as the literal string the user typed
    parts = key.split(".")
    target = data
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    target[parts[-1]] = value
    location = Location(COMMAND_LINE)
    for stale in [k for k in locations if k == key or k.startswith(key + ".") or k.startswith(key + "[")]:
        locations[stale] = location
    for depth in range(1, len(parts) + 1):
        locations.setdefault(".".join(parts[:depth]), location)
    locations[key] = location
