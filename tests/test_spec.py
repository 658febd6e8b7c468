"""The spec loader: typed sections, extends, overrides, and errors that name field, file and line."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.env_types import SyntheticEnvConfig, ToyEnvConfig
from vlaslurm.spec.model_types import OpenVLAOFTConfig

EXPERIMENTS = sorted((Path(__file__).parent.parent / "experiments").glob("*.yaml"))

BASE = """\
name: t
env: {type: synthetic, num_envs: 8}
model: {type: synthetic}
algo: {type: synthetic}
rollout: {mode: sync, total_env_steps: 100}
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_shipped_experiment_loads(path: Path) -> None:
    loaded = load_spec(path)
    assert loaded.spec.name
    assert loaded.spec.env.type in {"toy", "robotwin", "maniskill", "libero", "synthetic"}


def test_type_selects_the_registered_dataclass(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE)).spec
    assert isinstance(spec.env, SyntheticEnvConfig)
    quick = load_spec(Path(__file__).parent.parent / "experiments" / "quickstart.yaml").spec
    assert isinstance(quick.env, ToyEnvConfig) and isinstance(quick.model, OpenVLAOFTConfig)


def test_extends_and_overrides_merge_in_order(tmp_path: Path) -> None:
    write(tmp_path, BASE, "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nrollout: {mode: async}\nenv: {num_envs: 16}\n")
    loaded = load_spec(child, ["rollout.max_staleness=2", "slurm.setup=[a, b]"])
    spec = loaded.spec
    assert (spec.rollout.mode, spec.rollout.total_env_steps, spec.env.num_envs) == ("async", 100, 16)
    assert spec.rollout.max_staleness == 2 and spec.slurm.setup == ["a", "b"]
    assert str(loaded.where("env.num_envs")) == f"{child}:3"
    assert str(loaded.where("env.type")).endswith("base.yaml:2")
    assert str(loaded.where("rollout.max_staleness")) == "command line"


def test_shell_strings_are_never_interpolated(tmp_path: Path) -> None:
    lines = ["export X=${SCRATCH}", "echo ${oc.env:HOME}", r"a \${b}", "$(whoami); `id`"]
    path = write(tmp_path, BASE + "slurm:\n  setup:\n" + "".join(f"    - '{x}'\n" for x in lines))
    assert load_spec(path).spec.slurm.setup == lines


def error_of(tmp_path: Path, text: str, overrides=()) -> SpecError:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return info.value


BAD = [
    # (description, yaml appended to BASE or whole text, dotted key, line, words in the message)
    ("unknown key", BASE + "checkpoint: {every_version: 5}\n", "checkpoint.every_version", 6, ["every_versions"]),
    ("unknown section", BASE + "rolout: {}\n", "rolout", 6, ["rollout"]),
    ("unknown type", BASE.replace("type: synthetic, num", "type: maniskil, num"), "env.type", 2, ["maniskill"]),
    ("wrong type", BASE + "checkpoint:\n  keep: lots\n", "checkpoint.keep", 7, ["Integer"]),
    ("negative count", BASE.replace("num_envs: 8", "num_envs: -3"), "env.num_envs", 2, ["at least 1"]),
    ("zero count", BASE + "resources:\n  generator: {nodes: 0}\n", "resources.generator.nodes", 7, ["at least 1"]),
    ("bad choice", BASE.replace("mode: sync", "mode: asnyc"), "rollout.mode", 5, ["async"]),
    ("missing type", BASE.replace("model: {type: synthetic}", "model: {path: x}"), "model.type", 3, ["openvla"]),
    ("nested list", BASE + "slurm:\n  setup: [[a]]\n", "slurm.setup[0]", 7, ["single value"]),
    (
        "collocated async",
        BASE.replace("mode: sync", "mode: async") + "resources: {layout: collocated}\n",
        "rollout.mode",
        5,
        ["collocated"],
    ),
    (
        "too few envs",
        BASE + "resources:\n  simulator: {nodes: 2, tasks_per_node: 8}\n",
        "env.num_envs",
        2,
        ["simulator ranks"],
    ),
    ("bad time", BASE + "slurm: {time: forever}\n", "slurm.time", 6, ["12:00:00"]),
    ("bad name", BASE.replace("name: t", "name: 'a b;rm -rf'"), "name", 1, ["letters"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_field_file_and_line(tmp_path: Path, case) -> None:
    _, text, key, line, words = case
    err = error_of(tmp_path, text)
    assert err.key == key
    assert err.location.file == str(tmp_path / "spec.yaml") and err.location.line == line
    for word in words:
        assert word in str(err)


def test_broken_yaml_gives_its_line(tmp_path: Path) -> None:
    err = error_of(tmp_path, BASE + "slurm: {partition: gpu\n")
    assert err.location.line in (6, 7) and "invalid YAML" in str(err)


def test_missing_extends_file(tmp_path: Path) -> None:
    err = error_of(tmp_path, "extends: nowhere.yaml\n" + BASE)
    assert err.key == "extends" and err.location.line == 1 and "nowhere.yaml" in str(err)


def test_extends_cycle_is_reported(tmp_path: Path) -> None:
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "name: b\nextends: a.yaml\n", "b.yaml")
    with pytest.raises(SpecError, match="cycle") as info:
        load_spec(tmp_path / "a.yaml")
    assert info.value.key == "extends" and str(info.value.location) == f"{tmp_path / 'b.yaml'}:2"


def test_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    lines = ["a: &a [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"{k}: &{k} [" + ", ".join([f"*{p}"] * 9) + "]" for p, k in zip("abcdefgh", "bcdefghi")]
    start = time.monotonic()
    err = error_of(tmp_path, "\n".join(lines) + "\n" + BASE)
    assert "expands to more than" in str(err) and time.monotonic() - start < 1.0


def test_deep_nesting_is_refused_quickly(tmp_path: Path) -> None:
    start = time.monotonic()
    err = error_of(tmp_path, BASE + "slurm: {setup: " + "[\n" * 20000 + "]" * 20000 + "}\n")
    assert "nested more than" in str(err) and err.location.line == 36 and time.monotonic() - start < 1.0


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    text = BASE + "resources:\n  simulator: &res {cpus_per_task: 4}\n  generator:\n    <<: *res\n    cpus_per_task: 2\n"
    spec = load_spec(write(tmp_path, text)).spec
    assert (spec.resources.simulator.cpus_per_task, spec.resources.generator.cpus_per_task) == (4, 2)


def test_base60_override_is_the_text_typed(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, BASE), ["slurm.time=12:00:00"]).spec
    assert spec.slurm.time == "12:00:00"


def test_bad_override_is_located_on_the_command_line(tmp_path: Path) -> None:
    err = error_of(tmp_path, BASE, overrides=["env.num_envz=4"])
    assert err.key == "env.num_envz" and str(err.location) == "command line" and "num_envs" in str(err)
    with pytest.raises(SpecError, match="dotted.key=value"):
        load_spec(write(tmp_path, BASE), ["novalue"])


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "absent.yaml")
