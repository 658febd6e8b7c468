"""Every `type:` string goes through one Registry per layer: each config type has an implementation
(and no implementation lacks a config), heavy modules load only when their type is used."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from vlaslurm.spec.registry import Registry, known_types


def test_every_config_type_has_its_implementation_and_back() -> None:
    from vlaslurm.algos.learners import LEARNERS
    from vlaslurm.envs import ENVS
    from vlaslurm.models import POLICIES

    for section, impls in (("env", ENVS), ("model", POLICIES), ("algo", LEARNERS)):
        assert known_types(section) == impls.names(), section


def test_lazy_entries_import_on_first_use_and_unknown_types_name_the_known() -> None:
    reg: Registry = Registry("env", "simulator")
    reg.lazy("json", "json:dumps")
    reg.register("plain")(len)
    assert reg.names() == ["json", "plain"] and "json" in reg
    import json

    assert reg.get("json") is json.dumps and reg.get("plain") is len and reg.find("none") is None
    with pytest.raises(LookupError, match="env.type 'none' has no simulator; known types: json, plain"):
        reg.get("none")
    reg.register("plain")(len)  # the same target again (a module imported twice) is fine
    with pytest.raises(ValueError, match="already has a simulator"):
        reg.register("plain")(max)


def test_loading_a_spec_imports_no_heavy_module() -> None:
    code = (
        "import sys; from vlaslurm.spec import load_spec, known_types; import vlaslurm.envs; "
        "load_spec('experiments/quickstart.yaml'); [known_types(s) for s in ('env', 'model', 'algo')]; "
        "heavy = {'torch', 'transformers', 'mani_skill', 'libero'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
