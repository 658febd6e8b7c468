"""The command line without Slurm: plan, user errors, and local probe runs (`vlaslurm run --probe`)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from conftest import REPO, vlaslurm

from vlaslurm.rundir import read_info
from vlaslurm.runtime.local import run_local
from vlaslurm.spec import load_spec

QUICKSTART = REPO / "experiments" / "quickstart.yaml"
PROBE_3C = REPO / "tests" / "specs" / "probe-3c.yaml"


def test_plan_prints_summary_and_script(tmp_path: Path) -> None:
    proc = vlaslurm("plan", str(REPO / "experiments" / "robotwin.yaml"), "slurm.time=02:00:00", runs_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "robotwin-grpo-async" in out and "layout=disaggregated" in out
    for column in ("comp", "roles", "partition", "GPUs/node", "constraint", "h100", "gpu-inference"):
        assert column in out
    assert "#!/bin/bash" in out and "#SBATCH --time=02:00:00" in out and "#SBATCH hetjob" in out
    assert out.count("launch ") >= 3
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), "plan must write nothing"
    # The resolved algorithm, defaults the spec does not name included (robotwin.yaml names neither).
    assert "resolved algo, trainer, rollout" in out
    assert re.search(r"^  kl_coef: 0\.0$", out, re.M) and re.search(r"^  publish_every: 1$", out, re.M), out
    assert re.search(r"^  strategy: replicate$", out, re.M), out


BASE = """\
name: t
env: {type: synthetic, num_envs: 8}
model: {type: synthetic}
algo: {type: synthetic}
rollout: {mode: sync, total_env_steps: 100}
"""
BAD_SPECS = [
    # (name, spec text, dotted key, line, part of the hint)
    (
        "unknown key",
        BASE + "resources:\n  trainer: {gpu_per_node: 2}\n",
        "resources.trainer.gpu_per_node",
        7,
        "did you mean: gpus_per_node",
    ),
    ("wrong type", BASE.replace("total_env_steps: 100", "total_env_steps: lots"), "rollout.total_env_steps", 5, ""),
    (
        "unknown type",
        BASE.replace("type: synthetic, num", "type: robotwn, num"),
        "env.type",
        2,
        "did you mean: robotwin",
    ),
    ("zero count", BASE + "resources:\n  simulator: {nodes: 0}\n", "resources.simulator.nodes", 7, "at least 1"),
    ("broken yaml", BASE + "slurm: {time: [\n", "", 0, ""),
    ("missing extends", "extends: nowhere.yaml\n" + BASE, "extends", 1, "nowhere.yaml"),
]


@pytest.mark.parametrize("name,text,key,line,hint", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_is_one_message_with_field_and_line(tmp_path: Path, name, text, key, line, hint) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    commands = ("plan", "submit", "run") if name == "unknown key" else ("plan",)
    for command in commands:
        proc = vlaslurm(command, str(spec), runs_root=tmp_path / "runs")
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        message = proc.stderr.strip()
        assert len(message.splitlines()) == 1, message
        assert message.startswith(f"error: {spec}")
        if key:
            assert f"{spec}:{line}: {key}: " in message and hint in message, message
    assert not (tmp_path / "runs").exists(), "a bad spec must leave nothing behind"


def test_override_error_points_at_the_command_line(tmp_path: Path) -> None:
    proc = vlaslurm("plan", str(QUICKSTART), "rollout.mdoe=async", runs_root=tmp_path)
    assert proc.returncode == 2 and "command line: rollout.mdoe" in proc.stderr and "mode" in proc.stderr


def test_unknown_run_is_a_user_error(tmp_path: Path) -> None:
    proc = vlaslurm("status", "nope", runs_root=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no run 'nope'" in proc.stderr


def test_run_probe_locally_writes_every_rank(tmp_path: Path) -> None:
    proc = vlaslurm("run", str(QUICKSTART), "--probe", runs_root=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "quickstart").iterdir()
    ranks = read_info(run_dir).ranks
    probes = [json.loads(p.read_text()) for p in (run_dir / "probe").glob("*.json")]
    world = sum(ranks.values())
    assert sorted((p["role"], p["rank"]) for p in probes) == sorted((r, i) for r, n in ranks.items() for i in range(n))
    assert all(p["sum"] == world * (world + 1) / 2 for p in probes)
    status = vlaslurm("status", "quickstart", runs_root=tmp_path)
    assert "COMPLETED" in status.stdout


def test_run_locally_with_a_missing_role_names_it(tmp_path: Path) -> None:
    loaded = load_spec(PROBE_3C, ["runtime.first_meeting_timeout_s=5"])
    start = time.monotonic()
    code = run_local(loaded, tmp_path, probe=True, extra_args=("--absent", "generator"), echo=False, timeout_s=90)
    elapsed = time.monotonic() - start
    assert code != 0 and code != 124, "the others must fail on their own deadline, not the launcher's"
    assert elapsed < 60
    (run_dir,) = (tmp_path / "probe-3c").iterdir()
    # whichever rank's deadline fires first says who is missing; the launcher then stops the rest
    logs = {p.relative_to(run_dir): p.read_text() for p in (run_dir / "logs").glob("*/*.log")}
    assert any("missing generator[0]" in text for text in logs.values()), logs
    assert "told to stay absent" in logs[Path("logs/generator/0.log")]
