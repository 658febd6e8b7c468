"""The experiment spec: typed sections, loaded with file-and-line errors."""

from vlaslurm.spec.errors import Location, SpecError
from vlaslurm.spec.loader import LoadedSpec, load_spec
from vlaslurm.spec.registry import config_class, known_types, register
from vlaslurm.spec.schema import ExperimentSpec, RoleResources

__all__ = [
    "ExperimentSpec",
    "LoadedSpec",
    "Location",
    "RoleResources",
    "SpecError",
    "config_class",
    "known_types",
    "load_spec",
    "register",
]
