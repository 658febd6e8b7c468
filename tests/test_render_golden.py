"""The rendered sbatch script: golden files per spec and layout, and quoting that survives odd paths.

Regenerate the goldens after a deliberate template change with
    VLASLURM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_render_golden.py
and read the diff before committing it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from vlaslurm.slurm.render import RenderError, RenderOptions, check_header, render_script
from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.plan import build_plan

TESTS = Path(__file__).resolve().parent
SPECS = sorted((TESTS.parent / "experiments").glob("*.yaml")) + sorted((TESTS / "specs").glob("*.yaml"))
GOLDEN = TESTS / "golden"
UPDATE = os.environ.get("VLASLURM_UPDATE_GOLDEN") == "1"
PYTHON = "/opt/venv/bin/python"


def render(
    spec: Path, run_dir: str, overrides=(), python: str = PYTHON, entry_args=("--probe",), job_id_suffix: bool = True
) -> str:
    loaded = load_spec(spec, overrides)
    return render_script(
        loaded,
        build_plan(loaded),
        RenderOptions(run_dir=Path(run_dir), python=python, entry_args=entry_args, job_id_suffix=job_id_suffix),
    )


def fixed_render(spec: Path) -> str:
    """Deterministic: fixed run directory and python, whatever machine renders it."""
    return render(spec, f"/runs/{load_spec(spec).spec.name}/20260101-000000")


def check_golden(text: str, golden: Path) -> None:
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden {golden.relative_to(GOLDEN)}; run with VLASLURM_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden.name} differs; if intended, regenerate with VLASLURM_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_script_matches_golden(spec: Path) -> None:
    check_golden(fixed_render(spec), GOLDEN / f"{spec.stem}.sbatch")


def test_goldens_cover_every_layout_and_no_stale_files() -> None:
    layouts = {load_spec(spec).spec.resources.layout for spec in SPECS}
    assert layouts == {"collocated", "disaggregated", "hybrid"}
    assert {p.stem for p in GOLDEN.glob("*.sbatch")} == {p.stem for p in SPECS}
    assert {p.stem for p in (GOLDEN / "eval").glob("*.sbatch")} == {case[0] for case in EVAL_CASES}


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_script_is_valid_bash(spec: Path, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(fixed_render(spec))
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_plan_shares_a_node_and_spills_extra_nodes() -> None:
    plan = build_plan(load_spec(TESTS / "specs" / "probe-3c.yaml"))
    assert [c.roles for c in plan.components] == [("simulator", "generator"), ("simulator",), ("trainer",)]
    assert [c.gpus_per_node for c in plan.components] == [8, 6, 2]
    sim, gen = plan.step("simulator"), plan.step("generator")
    assert sim.het_groups == (0, 1) and gen.het_groups == (0,) and not sim.overlap
    assert plan.ranks() == {"simulator": 2, "generator": 1, "trainer": 1}


def test_plan_hybrid_trainer_overlaps_every_gpu() -> None:
    plan = build_plan(load_spec(TESTS / "specs" / "probe-hybrid.yaml"))
    trainer = plan.step("trainer")
    assert trainer.overlap and trainer.het_groups == (0, 1)
    assert [(p.tasks_per_node, p.gpus_per_node) for p in trainer.parts] == [(2, 2), (1, 1)]
    # an overlap step may not ask for more CPUs than its component holds
    assert [c.cpus_per_node for c in plan.components] == [2, 1]


def test_plan_shared_node_asks_for_the_sum_of_memory(tmp_path: Path) -> None:
    spec = TESTS / "specs" / "probe-3c.yaml"
    plan = build_plan(load_spec(spec, ["resources.simulator.mem=100G", "resources.generator.mem=28G"]))
    assert plan.components[0].mem == f"{128 * 1024}M" and plan.components[1].mem == "100G"


# (golden name, spec, overrides): one eval job per layout, and roles sharing a node (probe-3c)
EVAL_CASES = [
    ("quickstart", TESTS.parent / "experiments" / "quickstart.yaml", []),
    (
        "quickstart-collocated",
        TESTS.parent / "experiments" / "quickstart.yaml",
        ["resources.layout=collocated", "rollout.mode=sync"],
    ),
    ("probe-hybrid", TESTS / "specs" / "probe-hybrid.yaml", []),
    ("probe-3c", TESTS / "specs" / "probe-3c.yaml", []),
]


def eval_render(spec: Path, overrides) -> str:
    """`vlaslurm eval SPEC --episodes 50` as a job: the plan without its trainer, the eval entry point."""
    from vlaslurm.runtime.evaluate import EvalConfig

    loaded = load_spec(spec, overrides)
    options = RenderOptions(
        run_dir=Path(f"/runs/{loaded.spec.name}-eval/20260101-000000"),
        python=PYTHON,
        entry_args=EvalConfig(episodes=50).args(),
        job_id_suffix=True,
    )
    return render_script(loaded, build_plan(loaded, "eval"), options)


@pytest.mark.parametrize("name, spec, overrides", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_eval_script_matches_golden(name: str, spec: Path, overrides, tmp_path: Path) -> None:
    text = eval_render(spec, overrides)
    check_golden(text, GOLDEN / "eval" / f"{name}.sbatch")
    assert "--role trainer" not in text and "-m vlaslurm.runtime.evaluate --role simulator" in text
    (tmp_path / "job.sbatch").write_text(text)
    proc = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_eval_plan_drops_the_trainer_in_every_layout() -> None:
    layouts = {}
    for _, spec, overrides in EVAL_CASES:
        loaded = load_spec(spec, overrides)
        train, plan = build_plan(loaded), build_plan(loaded, "eval")
        layouts[plan.layout] = plan
        assert plan.kind == "eval" and plan.ranks() == {r: n for r, n in train.ranks().items() if r != "trainer"}
        assert all("trainer" not in c.roles for c in plan.components)
        assert [s for s in train.steps if s.role != "trainer"] == list(plan.steps)  # the rest is the training job's
    assert set(layouts) == {"collocated", "disaggregated", "hybrid"}
    assert [c.roles for c in layouts["collocated"].components] == [("simulator", "generator")]
    assert [c.roles for c in layouts["hybrid"].components] == [("simulator",), ("generator",)]


ODD = "odd dir $(touch {tmp}/PWNED1) `touch {tmp}/PWNED2`; touch {tmp}/PWNED3 'q' 50%j"


def _fake_srun(bin_dir: Path, calls: Path, record: str) -> None:
    """An `srun` that records `record` (its arguments) as JSON and exits 0."""
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        f"#!/usr/bin/env python3\nimport json, os, sys\nopen({str(calls)!r}, 'a').write(json.dumps({record}) + '\\n')\n"
    )
    srun.chmod(0o755)


def _run_faked(tmp_path: Path, text: str, record: str) -> list:
    """Execute a rendered script with `srun` faked; what each step's srun recorded."""
    calls = tmp_path / "calls.jsonl"
    _fake_srun(tmp_path / "bin", calls, record)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()]


def test_each_step_gets_its_cpus_per_task_as_omp_threads_unless_the_setup_sets_them(tmp_path: Path) -> None:
    """Without a cpuset every rank's torch would take all cores of its node and spin against the others."""
    cpus = {"simulator": 3, "generator": 2, "trainer": 5}
    overrides = [f"resources.{role}.cpus_per_task={n}" for role, n in cpus.items()]
    record = "[os.environ.get('OMP_NUM_THREADS'), sys.argv]"

    def threads(case: str, extra: list) -> dict:
        work = tmp_path / case
        (work / "run-42").mkdir(parents=True)
        steps = _run_faked(
            work, render(TESTS / "specs" / "probe-3c.yaml", str(work / "run"), overrides + extra), record
        )
        return {argv[argv.index("--role") + 1]: omp for omp, argv in steps}

    assert threads("default", []) == {role: str(n) for role, n in cpus.items()}
    assert threads("exported", ["slurm.setup=[export OMP_NUM_THREADS=7]"]) == dict.fromkeys(cpus, "7")


def test_odd_run_dir_and_python_run_nothing_unintended(tmp_path: Path) -> None:
    """Execute the whole script (srun faked): the odd path arrives verbatim and nothing in it runs."""
    run_dir = tmp_path / ODD.format(tmp=tmp_path)
    python = str(tmp_path / "py $(touch PWNED4)" / "python")
    text = render(
        TESTS / "specs" / "probe-3c.yaml",
        str(run_dir),
        python=python,
        entry_args=("--probe", "--absent", "x; touch PWNED5"),
    )
    assert f'RUN_DIR={shlex.quote(str(run_dir))}-"${{SLURM_JOB_ID}}"' in text
    final = Path(f"{run_dir}-42")
    final.mkdir(parents=True)
    steps = _run_faked(tmp_path, text, "sys.argv[1:]")
    made = [p for p in tmp_path.rglob("PWNED*") if p.name in {f"PWNED{i}" for i in range(1, 6)}]
    assert not made, "a path or argument was executed by the shell"
    assert len(steps) == 3
    for argv in steps:
        assert argv[argv.index("--run-dir") + 1] == str(final)
        assert python in argv and argv[-3:] == ["--probe", "--absent", "x; touch PWNED5"]
        assert any(
            a == f"--output={str(final).replace('%', '%%')}/logs/{argv[argv.index('--role') + 1]}/step.log"
            for a in argv
        )
    records = [json.loads(line) for line in (final / "exit_record.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records) == ["generator", "job", "simulator", "trainer"]
    assert all(r["exit_code"] == 0 for r in records)
    # sbatch reads #SBATCH lines without a shell: the path is double-quoted and % doubled
    assert f'#SBATCH --output="{str(run_dir).replace("%", "%%")}-%j/logs/batch-%j.log"' in text


@pytest.mark.parametrize("attempt", range(3))  # steps dying together is racy in bash's wait; try it a few times
def test_failing_step_becomes_the_job_exit_code(tmp_path: Path, attempt: int) -> None:
    text = render(TESTS / "specs" / "probe-3c.yaml", str(tmp_path / "run"), job_id_suffix=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\n[[ " $* " == *" --role generator "* ]] && exit 3\nexec sleep 30\n')
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "run").mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3 and "stopping the others" in proc.stderr
    lines = (tmp_path / "run/exit_record.jsonl").read_text().split("\n")
    records = {json.loads(x)["step"]: json.loads(x) for x in lines if x}
    assert records["generator"]["exit_code"] == 3 and records["job"]["exit_code"] == 3
    assert records["trainer"]["exit_code"] != 0  # stopped by the batch script, not left running


def test_setup_lines_run_verbatim_in_the_users_shell(tmp_path: Path) -> None:
    """slurm.setup is shell the user wrote (module load, export X=${SCRATCH}): copied as is, never interpolated."""
    lines = ["export X=${SCRATCH:-none}/x", "module load cuda/12.4 || true"]
    text = render(TESTS / "specs" / "probe-3c.yaml", "/runs/x", overrides=[f"slurm.setup={json.dumps(lines)}"])
    body = text.split("# --- setup lines from the spec, verbatim ---\n")[1].split("# --- end of setup ---")[0]
    assert body.splitlines() == lines


def test_override_with_a_newline_stays_in_the_comment() -> None:
    text = render(TESTS / "specs" / "probe-3c.yaml", "/runs/x", overrides=["tracking.experiment=a\ntouch PWNED"])
    assert "\ntouch PWNED" not in text


@pytest.mark.parametrize("bad", ['has"quote', "has\\backslash", "new\nline"])
def test_run_dir_that_sbatch_cannot_take_is_refused(bad: str) -> None:
    with pytest.raises(RenderError, match="--runs-root"):
        render(TESTS / "specs" / "probe-3c.yaml", f"/runs/{bad}")


def test_sbatch_values_with_shell_characters_are_refused() -> None:
    with pytest.raises(Exception, match=r"slurm\.extra\.qos.*#SBATCH"):
        render(TESTS / "specs" / "probe-3c.yaml", "/runs/x", overrides=["slurm.extra.qos='high; rm -rf /'"])


def spec_with(tmp_path: Path, slurm: dict) -> Path:
    data = yaml.safe_load((TESTS / "specs" / "probe-3c.yaml").read_text())
    data.setdefault("slurm", {}).update(slurm)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "slurm, field",
    [
        ({"extra": {"qos\n": "x|cmd"}}, "slurm.extra"),  # `^...$` with re.match let the newline through
        ({"time": "12:00:00\n"}, "slurm.time"),
    ],
)
def test_a_final_newline_never_passes_a_slurm_field(tmp_path: Path, slurm: dict, field: str) -> None:
    with pytest.raises(SpecError, match=re.escape(field)):
        load_spec(spec_with(tmp_path, slurm))


def test_an_sbatch_value_with_a_final_newline_is_refused(tmp_path: Path) -> None:
    loaded = load_spec(spec_with(tmp_path, {"extra": {"qos": "high\n"}}))
    with pytest.raises(SpecError, match=r"slurm\.extra\.qos.*#SBATCH"):
        render_script(loaded, build_plan(loaded), RenderOptions(run_dir=tmp_path / "run"))


def test_the_header_check_refuses_a_command_among_sbatch_lines() -> None:
    good = fixed_render(TESTS / "specs" / "probe-3c.yaml")
    check_header(good)  # every golden passes it too: render_script calls it
    bad = good.replace("#SBATCH --requeue\n", "#SBATCH --requeue\n#SBATCH --qos=x y\n", 1)
    with pytest.raises(RenderError, match="line"):
        check_header(bad)
    assert "#SBATCH --requeue\n" in good
