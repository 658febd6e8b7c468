"""Containers per role: the rendered srun steps for pyxis/enroot and Apptainer.

Neither runtime is installed where these tests run (pyxis is a SPANK plugin of a real
Slurm site, Apptainer needs its setuid/user-namespace install), so nothing here starts a
container: the rendered steps are golden files, and the whole script is executed with a
fake `srun` (and a fake `apptainer`) that record the argv they got, which proves the
quoting and that the worker entry, and with it the headless-rendering preflight of the
simulator, runs inside the container. Regenerate the goldens after a deliberate change:
    VLASLURM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_containers.py
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from vlaslurm.slurm import containers
from vlaslurm.slurm.render import RenderError, RenderOptions, render_script
from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.plan import build_plan

GOLDEN = REPO / "tests" / "golden" / "containers"
UPDATE = os.environ.get("VLASLURM_UPDATE_GOLDEN") == "1"
PROBE_3C = REPO / "tests" / "specs" / "probe-3c.yaml"  # a step over two components: colon form
CODE = Path("/code/vlaslurm checkout")

CASES = {
    # every role in one pyxis image; the trainer adds a mount and a flag
    "pyxis": [
        "resources.simulator.container.image=ghcr.io#org/vla-deps:1.2",
        "resources.generator.container.image=ghcr.io#org/vla-deps:1.2",
        "resources.trainer.container.image=/images/vla-deps.sqsh",
        'resources.trainer.container.mounts=["/datasets:/data:ro"]',
        'resources.trainer.container.options=["--container-remap-root"]',
    ],
    # Apptainer for the simulator only (the others stay on the host)
    "apptainer": [
        "resources.simulator.container.image=/images/sim.sif",
        "resources.simulator.container.runtime=apptainer",
        "resources.simulator.container.python=/opt/conda/bin/python",
        'resources.simulator.container.mounts=["/scratch"]',
    ],
}


@pytest.fixture(autouse=True)
def fixed_code_dir(monkeypatch) -> None:
    monkeypatch.setattr(containers, "CODE_DIR", CODE)


def render(
    case: str,
    run_dir: str = "/runs/probe-3c/20260101-000000",
    suffix: bool = True,
    python: str = "/opt/venv/bin/python",
) -> str:
    loaded = load_spec(PROBE_3C, CASES[case])
    return render_script(
        loaded,
        build_plan(loaded),
        RenderOptions(run_dir=Path(run_dir), python=python, entry_args=("--probe",), job_id_suffix=suffix),
    )


def steps_of(text: str) -> str:
    """The launch lines of a script: what the container changes."""
    return text[text.index("\nlaunch simulator ") : text.index("\n\n# USR2")].strip() + "\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_steps_match_golden(case: str) -> None:
    text = steps_of(render(case))
    golden = GOLDEN / f"{case}.steps"
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden.name} differs; if intended, regenerate with VLASLURM_UPDATE_GOLDEN=1"


def test_no_image_renders_exactly_as_before() -> None:
    loaded = load_spec(PROBE_3C)
    text = render_script(
        loaded,
        build_plan(loaded),
        RenderOptions(
            run_dir=Path("/runs/probe-3c/20260101-000000"),
            python="/opt/venv/bin/python",
            entry_args=("--probe",),
            job_id_suffix=True,
        ),
    )
    assert text == (REPO / "tests" / "golden" / "probe-3c.sbatch").read_text()


def _fake(bin_dir: Path, name: str, calls: Path) -> None:
    tool = bin_dir / name
    tool.write_text(
        "#!/usr/bin/env python3\nimport json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
    )
    tool.chmod(0o755)


@pytest.mark.parametrize("case", sorted(CASES))
def test_script_runs_with_fake_runtimes_and_odd_paths(case: str, tmp_path: Path) -> None:
    """The run directory (spaces, quotes, $(...), %) reaches the mounts verbatim; the worker runs inside."""
    root = tmp_path / "runs $(touch PWNED) 'q' 50%"
    run_dir = root / "probe-3c" / "20260101-000000"
    final = Path(f"{run_dir}-42")
    final.mkdir(parents=True)
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "bin").mkdir()
    _fake(tmp_path / "bin", "srun", calls)
    script = tmp_path / "job.sbatch"
    script.write_text(render(case, str(run_dir)))
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.rglob("PWNED"))
    argv = {a[a.index("--role") + 1]: a for a in (json.loads(line) for line in calls.read_text().splitlines())}
    assert len(argv) == 3
    if case == "pyxis":
        trainer = argv["trainer"]
        mounts = next(a for a in trainer if a.startswith("--container-mounts="))
        assert mounts == f"--container-mounts={root}:{root},{CODE}:{CODE},/datasets:/data:ro"
        assert "--container-image=/images/vla-deps.sqsh" in trainer and "--container-remap-root" in trainer
        # the step over two components: every part carries the container flags
        assert sum(a.startswith("--container-image=") for a in argv["simulator"]) == 2
        for role, args in argv.items():
            entry = args.index("-m")
            assert args[entry - 3 : entry + 2] == [
                "env",
                f"PYTHONPATH={CODE}",
                "python3",
                "-m",
                "vlaslurm.runtime.worker",
            ], role
    else:
        sim = argv["simulator"]
        start = sim.index("apptainer")
        assert sim[start : start + 2] == ["apptainer", "exec"] and "--nv" in sim
        binds = [sim[i + 1] for i, a in enumerate(sim) if a == "--bind"]
        assert binds == [f"{root}:{root}", f"{CODE}:{CODE}", "/scratch:/scratch"] * 2  # two parts (colon form)
        assert sim.index("/images/sim.sif") < sim.index("vlaslurm.runtime.worker")  # the worker runs inside
        assert "/opt/conda/bin/python" in sim and str(final) == sim[sim.index("--run-dir") + 1]
        assert "apptainer" not in argv["trainer"] and "/opt/venv/bin/python" in argv["trainer"]


def test_explicit_run_dir_is_mounted_through_the_variable() -> None:
    text = steps_of(render("pyxis", "/work/my run", suffix=False))
    assert '--container-mounts="$RUN_DIR:$RUN_DIR",' in text
    text = steps_of(render("apptainer", "/work/my run", suffix=False))
    assert 'apptainer exec --nv --bind "$RUN_DIR" --bind' in text


@pytest.mark.parametrize("bad", ["/runs/a,b", "/runs/a:b"])
def test_paths_a_mount_list_cannot_hold_are_refused(bad: str) -> None:
    with pytest.raises(RenderError, match="list separators"):
        render("pyxis", f"{bad}/probe-3c/1")


@pytest.mark.parametrize(
    "override, key",
    [
        ("resources.trainer.container.runtime=docker", "resources.trainer.container.runtime"),
        ('resources.trainer.container.mounts=["data:/data"]', "resources.trainer.container.mounts[0]"),
        ('resources.trainer.container.mounts=["/a,/b"]', "resources.trainer.container.mounts[0]"),
        ("resources.trainer.container.image='two words'", "resources.trainer.container.image"),
    ],
)
def test_bad_container_fields_name_their_key(override: str, key: str) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(PROBE_3C, [override])
    assert err.value.key == key


def test_site_runtime_and_mounts_are_defaults(tmp_path: Path) -> None:
    site = tmp_path / "s.yaml"
    site.write_text("container:\n  runtime: apptainer\n  mounts: [/site/data]\n")
    loaded = load_spec(PROBE_3C, ["resources.trainer.container.image=/i.sif"], site=site)
    assert containers.runtime_of(loaded, loaded.spec.resources.trainer.container) == "apptainer"
    text = render_script(loaded, build_plan(loaded), RenderOptions(run_dir=Path("/runs/p/1"), python="/py"))
    assert "apptainer exec --nv" in text and "--bind /site/data:/site/data /i.sif" in text
    spec_wins = load_spec(PROBE_3C, ["resources.trainer.container.runtime=pyxis"], site=site)
    assert spec_wins.spec.resources.trainer.container.runtime == "pyxis"
    assert str(spec_wins.where("resources.generator.container.runtime")) == f"{site}:2"
