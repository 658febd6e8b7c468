"""Reading run-directory files that may be damaged: one typed error naming the file and what is wrong.

A run directory outlives crashes, disks that fill up and hands that edit it. Every reader in this package
turns what it cannot use into `DamagedRunDir(path, what)` instead of a JSONDecodeError, TypeError,
IsADirectoryError or KeyError. The rule for JSON-lines record files (exit records, restarts, metrics,
the runs index):

- a line that is not JSON at all is skipped: a crash tears the line it was appending, and a torn object
  never parses (its closing brace is missing);
- a line that parses but is not a record of the right shape (not an object, a key missing or of the wrong
  type) is not a crash artefact: the reader raises `DamagedRunDir` naming the file and the line.

A whole-file record (`run.json`, `spec.yaml`, `eval.json`, a heartbeat) that is missing reads as "not written
yet" where the reader says so; one that is there but unreadable raises `DamagedRunDir`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

Kind = Union[type, Tuple[type, ...]]  # the type(s) a key's value may have
Shape = Mapping[str, Kind]  # the keys a record must hold


class DamagedRunDir(Exception):
    """A run-directory file is there but cannot be used: `path` names it, `what` says what is wrong."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = Path(path), what
        super().__init__(f"{self.path}: {what}")

    def relative(self, root: Path) -> str:
        """'heartbeats/trainer-0.json: not JSON': the file relative to `root` where it lies under it."""
        try:
            name = str(self.path.relative_to(root))
        except ValueError:
            name = str(self.path)
        return f"{name}: {self.what}"


def read_text(path: Path) -> Optional[str]:
    """A file's text, None if it does not exist; DamagedRunDir if it is a directory, unreadable or not UTF-8."""
    path = Path(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise DamagedRunDir(path, "is a directory, not a file") from None
    except UnicodeDecodeError:
        raise DamagedRunDir(path, "not text (not UTF-8)") from None
    except OSError as exc:
        raise DamagedRunDir(path, f"unreadable ({exc.strerror or exc})") from None


def read_json(path: Path) -> Optional[Any]:
    """A JSON file's value, None if it does not exist; DamagedRunDir if it is not JSON."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty (truncated)" if not text.strip() else f"not JSON ({exc.msg} at line {exc.lineno})"
        raise DamagedRunDir(path, what) from None


def read_json_object(path: Path, required: Shape) -> Optional[Dict[str, Any]]:
    """A JSON file holding one object with the `required` keys (and types), None if the file does not exist."""
    value = read_json(path)
    return None if value is None else check_record(path, value, required)


def json_lines(path: Path) -> Iterator[Tuple[int, Any]]:
    """(line number, value) of each JSON line of a file (none if it does not exist; torn lines skipped)."""
    text = read_text(path) or ""
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a crash


def records(path: Path, required: Shape) -> list[Dict[str, Any]]:
    """The records of a JSON-lines file, each an object with the `required` keys (see the module rule)."""
    return [check_record(path, value, required, number) for number, value in json_lines(path)]


def check_record(path: Path, value: Any, required: Shape, line: Optional[int] = None) -> Dict[str, Any]:
    """`value` if it is an object holding each required key with a value of its type; else DamagedRunDir."""
    where = f"line {line}: " if line is not None else ""
    if not isinstance(value, dict):
        raise DamagedRunDir(path, f"{where}not a JSON object ({_type_names(type(value))})")
    for key, kind in required.items():
        if key not in value:
            raise DamagedRunDir(path, f"{where}no {key!r}")
        if not isinstance(value[key], kind) or isinstance(value[key], bool) and bool not in _types(kind):
            raise DamagedRunDir(path, f"{where}{key!r} is {value[key]!r}, not {_type_names(kind)}")
    return value


def _types(kind: Kind) -> Tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _type_names(kind: Kind) -> str:
    names = {int: "a number", float: "a number", str: "text", dict: "an object", list: "a list", type(None): "null"}
    names[bool] = "true or false"
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in _types(kind)))
