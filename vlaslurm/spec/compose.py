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
    data, locations, files = _compose_file(Path(path), chain=(), via=None)
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


def _compose_file(
    path: Path, chain: Tuple[Path, ...], via: Optional[Location]
) -> Tuple[Dict[str, Any], Locations, List[Path]]:
    """`via`: the `extends` that named `path` (where a cycle is reported)."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise SpecError(f"extends forms a cycle: {cycle}", key="extends", location=via or Location(str(path)))
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
    parent, parent_locations, files = _compose_file(parent_path, (*chain, resolved), where)
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
        _check_depth(text, str(path))
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_graph(node, str(path))
            data = loader.construct_document(node) if node is not None else {}
        finally:
            loader.dispose()
    except RecursionError:
        raise SpecError(
            f"invalid YAML: nested more than {MAX_DEPTH} levels deep", location=Location(str(path))
        ) from None
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


MAX_DEPTH = 32  # levels of nesting a spec may have (the schema needs fewer than 8)
MAX_VALUES = 10_000  # values a spec may expand to, aliases included (refuses a "billion laughs" alias bomb)
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _check_depth(text: str, file: str) -> None:
    """Refuse nesting past MAX_DEPTH from the parser's events, before PyYAML's recursive composer sees it."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else None
                raise SpecError(
                    f"invalid YAML: nested more than {MAX_DEPTH} levels deep", location=Location(file, line)
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_graph(node: yaml.Node, file: str) -> None:
    """Before constructing anything: refuse deep nesting, alias expansion past MAX_VALUES, duplicate keys
    and unquoted base-60 numbers (YAML 1.1 reads 12:00:00 as 43200)."""
    sizes: Dict[int, int] = {}
    _graph_size(node, "", file, 0, sizes)


def _graph_size(node: yaml.Node, key: str, file: str, depth: int, sizes: Dict[int, int]) -> int:
    """Values `node` expands to (memoised per node, so shared aliases cost one walk); raise SpecError."""
    where = Location(file, node.start_mark.line + 1)
    if id(node) in sizes:
        if sizes[id(node)] < 0:
            raise SpecError("invalid YAML: an alias refers to itself", key=key, location=where)
        return sizes[id(node)]
    if depth > MAX_DEPTH:
        raise SpecError(f"nested more than {MAX_DEPTH} levels deep", key=key, location=where)
    sizes[id(node)] = -1
    total = 1 + sum(_graph_size(child, k, file, depth + 1, sizes) for k, child in _children(node, key, file))
    if total > MAX_VALUES:
        raise SpecError(f"expands to more than {MAX_VALUES} values (YAML aliases?)", key=key, location=where)
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:timestamp":
        raise SpecError(
            f"unquoted {node.value} is a date in YAML; no field takes one, quote it: '{node.value}'",
            key=key,
            location=where,
        )
    if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS and ":" in node.value:
        raise SpecError(
            f"unquoted {node.value} is a base-60 number in YAML 1.1 ({_base60(node.value)}); quote it: '{node.value}'",
            key=key,
            location=where,
        )
    sizes[id(node)] = total
    return total


def _base60(text: str) -> str:
    try:
        return str(yaml.safe_load(text))
    except yaml.YAMLError:
        return "a number"


def _children(node: yaml.Node, key: str, file: str) -> List[Tuple[str, yaml.Node]]:
    """(dotted key, node) of a mapping's values or a sequence's items; refuse a key written twice."""
    if isinstance(node, yaml.SequenceNode):
        return [(f"{key}[{i}]", item) for i, item in enumerate(node.value)]
    if not isinstance(node, yaml.MappingNode):
        return []
    first: Dict[str, int] = {}
    out: List[Tuple[str, yaml.Node]] = []
    for key_node, value_node in node.value:
        name = str(key_node.value)
        child = f"{key}.{name}" if key else name
        line = key_node.start_mark.line + 1
        if name in first and name != "<<":
            raise SpecError(
                f"written twice in one mapping, at lines {first[name]} and {line}",
                key=child,
                location=Location(file, line),
            )
        first.setdefault(name, line)
        out += [(child, key_node), (child, value_node)]
    return out


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
    if isinstance(value, (int, float)) and ":" in raw:
        value = raw.strip()  # slurm.time=12:00:00 means the text, not YAML 1.1's base-60 number 43200
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
