"""One mechanism for everything a section's `type:` string selects: a `Registry` per layer.

The spec layer keeps one of config dataclasses per section (`register`, `config_class`
below); each implementing package keeps one of its implementations under the same type
strings (`vlaslurm.envs.ENVS`, `vlaslurm.models.POLICIES`, `vlaslurm.algos.learners.LEARNERS`).
An entry is the object itself (`@registry.register(name)`) or `"module:attr"`
(`registry.lazy(name, target)`), imported the first time that type is used, so a spec
loads without torch or a simulator. A new env, model or algo type is one registration in
each layer: its config class in `vlaslurm/spec/*_types.py`, its implementation in its package.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Any, Callable, Dict, Generic, List, Optional, Type, TypeVar, Union

T = TypeVar("T")

SECTIONS = ("env", "model", "algo")


class Registry(Generic[T]):
    """The `kind` (config class, simulator, policy, learner) of each `<section>.type`, by type string."""

    def __init__(self, section: str, kind: str) -> None:
        self.section, self.kind = section, kind
        self._entries: Dict[str, Union[T, str]] = {}

    def register(self, type_name: str) -> Callable[[T], T]:
        """Decorator: make the decorated object the entry of `type_name`."""

        def wrap(obj: T) -> T:
            self._add(type_name, obj)
            return obj

        return wrap

    def lazy(self, type_name: str, target: str) -> None:
        """Make `"module:attr"` the entry of `type_name`, imported when the type is first looked up."""
        if target.count(":") != 1:
            raise ValueError(f"lazy entry of {self.section}.type {type_name!r} must be 'module:attr', got {target!r}")
        self._add(type_name, target)

    def names(self) -> List[str]:
        """Registered type names, sorted."""
        return sorted(self._entries)

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._entries

    def find(self, type_name: str) -> Optional[T]:
        """The entry of `type_name` (imported if lazy), or None."""
        entry = self._entries.get(type_name)
        if isinstance(entry, str):
            module, attr = entry.split(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[type_name] = entry
        return entry

    def get(self, type_name: str) -> T:
        """The entry of `type_name`; LookupError naming the known types if there is none."""
        entry = self.find(type_name)
        if entry is None:
            raise LookupError(
                f"{self.section}.type {type_name!r} has no {self.kind}; known types: {', '.join(self.names())}"
            )
        return entry

    def _add(self, type_name: str, entry: Union[T, str]) -> None:
        old = self._entries.get(type_name)
        if old is not None and _target(old) != _target(entry):
            raise ValueError(f"{self.section}.type {type_name!r} already has a {self.kind}: {_target(old)}")
        self._entries[type_name] = entry


def _target(entry: Any) -> str:
    """'module:attr' of an entry (a module re-imported registers the same target again)."""
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


CONFIGS: Dict[str, Registry[type]] = {section: Registry(section, "config class") for section in SECTIONS}


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and a documentation string.

    Mutable defaults (lists, dicts) are copied per instance.
    """
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": text})
    return dataclasses.field(default=default, metadata={"doc": text})


def register(section: str, type_name: str) -> Callable[[Type[T]], Type[T]]:
    """Class decorator: make `cls` the config of `<section>.type: <type_name>`."""
    if section not in CONFIGS:
        raise ValueError(f"unknown section {section!r}; expected one of {SECTIONS}")
    return CONFIGS[section].register(type_name)


def config_class(section: str, type_name: str) -> type | None:
    """The dataclass registered for a type, or None."""
    _load_builtin_types()
    return CONFIGS[section].find(type_name)


def known_types(section: str) -> list[str]:
    """Registered type names of a section, sorted."""
    _load_builtin_types()
    return CONFIGS[section].names()


def _load_builtin_types() -> None:
    # Imported here, not at module top, because those modules import `register` from this one.
    from vlaslurm.spec import algo_types, env_types, model_types  # noqa: F401
