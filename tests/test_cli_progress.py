"""What the command line shows while and after a run: `vlaslurm run`'s live display in a real terminal
(tmux) and its plain lines in a pipe, `status`'s latest metrics, `plan --placement auto`'s word before a
profiling job and without Slurm, and `doctor`'s one line for a GPU simulator on a machine without one."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, vlaslurm

from vlaslurm import rundir
from vlaslurm.cli.progress import Latest, summary_lines, ui_command
from vlaslurm.rundir import Heartbeat, RunDir, append_metrics

QUICKSTART = REPO / "experiments" / "quickstart.yaml"
MANISKILL = REPO / "experiments" / "maniskill.yaml"
EXIT_MARK = "VLASLURM-EXIT="
NOT_REACHABLE = "sinfo: fatal: Could not establish a configuration source"


def write_spec(directory: Path, total_env_steps: int = 640) -> Path:
    """A short synthetic run: three local ranks, ten updates of 64 env steps (mostly process start-up)."""
    spec = {
        "name": "prog",
        "env": {"type": "synthetic", "num_envs": 8, "step_ms": {"dist": "constant", "mean": 5.0}, "episode_steps": 10},
        "model": {"type": "synthetic", "action_chunk": 2, "forward_ms": {"base": 1.0, "per_item": 0.1}},
        "algo": {"type": "synthetic", "steps_per_update": 64, "update_ms": 10.0},
        "rollout": {
            "mode": "sync",
            "total_env_steps": total_env_steps,
            "weight_sync": "nccl",
            "batching": {"max_batch": 64, "max_wait_ms": 2},
        },
        "runtime": {"first_meeting_timeout_s": 60, "timeout_s": 20},
    }
    path = directory / "prog.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def tmux_or_skip() -> str:
    found = shutil.which("tmux")
    if found:
        return found
    message = "tmux is missing (bash .ci/setup installs it)"
    if os.environ.get("VLASLURM_REQUIRE_SLURM") == "1":  # CI: the terminal display must be tested there
        pytest.fail(message)
    pytest.skip(message)


def test_run_shows_live_progress_in_a_terminal(tmp_path: Path) -> None:
    tmux = tmux_or_skip()
    spec, runs = write_spec(tmp_path), tmp_path / "runs"
    sock_dir = Path(tempfile.mkdtemp(prefix="vlt-"))  # a private tmux server; its socket path must be short
    sock = str(sock_dir / "s")
    command = (
        f"{shlex.quote(sys.executable)} -m vlaslurm.cli --runs-root {shlex.quote(str(runs))} run "
        f"{shlex.quote(str(spec))}; echo {EXIT_MARK}$?; sleep 600"
    )
    env = {**os.environ, "VLASLURM_TRACKING": "off"}
    subprocess.run(
        [tmux, "-S", sock, "new-session", "-d", "-x", "150", "-y", "40", "-c", str(REPO), command],
        env=env,
        check=True,
        timeout=30,
    )
    screens = []
    try:
        deadline = time.monotonic() + 90  # moved on whenever the screen changes: a slow machine is no failure
        while True:
            screen = subprocess.run(
                [tmux, "-S", sock, "capture-pane", "-p", "-J"], capture_output=True, text=True, check=True, timeout=30
            ).stdout
            if not screens or screen != screens[-1]:
                screens.append(screen)
                deadline = time.monotonic() + 90
            if EXIT_MARK in screen:
                break
            assert time.monotonic() < deadline, "the screen has not changed for 90 s:\n" + screen
            time.sleep(0.2)
    finally:
        subprocess.run([tmux, "-S", sock, "kill-server"], capture_output=True, timeout=30)
        shutil.rmtree(sock_dir, ignore_errors=True)
    final = screens[-1]
    assert f"{EXIT_MARK}0" in final, final
    assert any("env steps" in s and EXIT_MARK not in s for s in screens), "no live frame before the end:\n" + final
    bars = re.findall(r"([\d,]+) / 640 env steps", final)
    assert len(bars) == 1, "the display redraws in place, not frame after frame:\n" + final
    assert int(bars[0].replace(",", "")) > 0
    assert re.search(r"SPS [\d,]+", final) and re.search(r"policy v\d+", final), final
    for role in ("simulator", "generator", "trainer"):
        assert re.search(rf"^{role}\s", final, re.M), final
    assert re.search(
        r"^completed after [\d:]+( s)?: [\d,]+ of 640 env steps, success [\d.]+, SPS [\d,]+, policy v\d+", final, re.M
    ), final
    (run_dir,) = (runs / "prog").iterdir()
    assert f"run dir  {run_dir}" in final and "vNone" not in final and "Traceback" not in final


def test_run_off_a_terminal_prints_plain_lines(tmp_path: Path) -> None:
    proc = vlaslurm(
        "run", str(write_spec(tmp_path)), runs_root=tmp_path / "runs", timeout=180, env={"VLASLURM_TRACKING": "off"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "\x1b[" not in out and "━" not in out, "no terminal codes in a pipe"
    (run_dir,) = (tmp_path / "runs" / "prog").iterdir()
    assert f"run dir: {run_dir}" in out
    assert re.search(r"progress v=\d+ env_steps=\d+ success=[\d.]+ SPS=\d+", out), out
    assert re.search(r"^completed after [\d:]+( s)?: [\d,]+ of 640 env steps", out, re.M), out
    assert f"run dir  {run_dir}" in out and "MLflow   off ($VLASLURM_TRACKING=off)" in out


@pytest.mark.slurm
@pytest.mark.slow
def test_submit_follow_shows_progress_until_the_job_ends(local_slurm, tmp_path: Path) -> None:
    proc = vlaslurm(
        "submit",
        str(write_spec(tmp_path, total_env_steps=1280)),
        "slurm.partition=cpu",
        "--follow",
        runs_root=tmp_path / "runs",
        timeout=300,
        env={"VLASLURM_TRACKING": "off"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^submitted job \d+", out, re.M) and "state: COMPLETED" in out, out
    assert re.search(
        r"^COMPLETED after [\d:]+( s)?: [\d,]+ of 1,280 env steps, success [\d.]+, SPS [\d,]+", out, re.M
    ), out
    assert "\x1b[" not in out and "Traceback" not in proc.stderr


def test_summary_names_the_mlflow_run_and_how_to_open_it(tmp_path: Path) -> None:
    run_dir = rundir.new_run_dir(tmp_path / "runs", "sum")
    append_metrics(
        run_dir,
        {"version": 4, "env_steps": 512, "charts/SPS": 250.0, "rollout/success_rate": 0.5, "trainer/batch_segments": 8},
    )
    (RunDir(run_dir) / rundir.layout.MLFLOW_RUN_ID).write_text("abc123\n")
    lines = summary_lines(run_dir, "completed", None, 1000, 12.0)
    assert lines[0] == "completed after 12 s: 512 of 1,000 env steps, success 0.50, SPS 250, policy v4"
    uri = f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}"
    assert f"MLflow   run abc123 in {uri}" in lines
    assert f"         open it: mlflow ui --backend-store-uri {uri}" in lines
    assert ui_command("http://mlflow:5000") == "open http://mlflow:5000"
    assert ui_command("sqlite:////a b/mlflow.db") == "mlflow ui --backend-store-uri 'sqlite:////a b/mlflow.db'"


def test_status_shows_the_latest_metrics_and_never_vnone(tmp_path: Path) -> None:
    from vlaslurm.cli.runs import describe_run

    directory = rundir.new_run_dir(tmp_path / "runs", "st")
    RunDir(directory).spec.write_text(yaml.safe_dump({"rollout": {"total_env_steps": 1000}}))
    for version, steps, used, dropped in ((1, 128, 4, 0), (2, 256, 3, 1)):
        append_metrics(
            directory,
            {
                "version": version,
                "env_steps": steps,
                "charts/SPS": 1234.0,
                "rollout/success_rate": 0.25 * version,
                "staleness/mean": 0.5,
                "staleness/max": 1,
                "staleness/dropped_segments": dropped,
                "trainer/batch_segments": used,
            },
        )
    Heartbeat(directory, "trainer", 0).beat(None, "finished env_steps=256", force=True)
    Heartbeat(directory, "simulator", 0).beat(2, "env_steps=256", force=True)
    info = rundir.RunInfo(name="st", run_dir=str(directory), kind="local", ranks={"trainer": 1, "simulator": 1})
    rundir.write_info(info)
    text = describe_run(info)
    assert "vNone" not in text, text
    assert "metrics  v2  env steps 256/1,000  success 0.50  SPS 1,234  Δv mean 0.50 max 1  dropped 12.5%" in text
    assert re.search(r"role     trainer-0\s+-\s+finished env_steps=256", text), text
    assert re.search(r"role     simulator-0\s+v2\s+env_steps=256", text), text
    assert "vNone" not in Latest().line()
    assert "metrics" not in describe_run(
        rundir.RunInfo(name="e", run_dir=str(rundir.new_run_dir(tmp_path / "runs", "e")), kind="local", ranks={})
    )


def fake_sinfo(directory: Path, reachable: bool) -> dict:
    """A PATH whose `sinfo` answers like a cluster with one partition, or like a machine with no Slurm set up."""
    directory.mkdir(exist_ok=True)
    script = directory / "sinfo"
    body = 'echo "cpu*"' if reachable else f'echo "{NOT_REACHABLE}" >&2; exit 1'
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return {"PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


class ProfilingStarted(Exception):
    pass


def test_plan_auto_says_it_runs_a_profiling_job_before_it_starts_one(tmp_path: Path, monkeypatch, capsys) -> None:
    from vlaslurm.cli import main
    from vlaslurm.placement import choose

    monkeypatch.setenv("PATH", fake_sinfo(tmp_path / "bin", reachable=True)["PATH"])
    said = []

    def profile(*args, **kwargs):
        said.append(capsys.readouterr().out)
        raise ProfilingStarted

    monkeypatch.setattr(choose, "profile", profile)
    for extra, where in (([], "through Slurm"), (["--local"], "on this machine")):
        with pytest.raises(ProfilingStarted):
            main(["--runs-root", str(tmp_path / "runs"), "plan", str(QUICKSTART), "--placement", "auto", *extra])
        assert "No profile of quickstart is cached" in said[-1] and f"profiling job {where}" in said[-1]
        assert "Nothing else is submitted" in said[-1]


def test_plan_for_n_gpus_needs_no_reachable_slurm(tmp_path: Path) -> None:
    spec = tmp_path / "gpu.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "gpu",
                "env": {"type": "synthetic", "num_envs": 8},
                "model": {"type": "synthetic"},
                "algo": {"type": "synthetic"},
                "rollout": {"mode": "sync", "total_env_steps": 100},
                "resources": {role: {"gpus_per_node": 1} for role in ("simulator", "generator", "trainer")},
            }
        )
    )
    env = fake_sinfo(tmp_path / "bin", reachable=False)
    proc = vlaslurm("plan", str(spec), "--placement", "auto", "--gpus", "4", runs_root=tmp_path / "runs", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Slurm is not reachable ({NOT_REACHABLE})" in proc.stdout
    assert "Planning for 4 GPUs without it" in proc.stdout
    assert "placements for 4 units" in proc.stdout and "choice:" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    # Without --gpus the plan needs the cluster's profile: one line says so and how to get on.
    proc = vlaslurm("plan", str(spec), "--placement", "auto", runs_root=tmp_path / "runs", env=env)
    message = proc.stderr.strip()
    assert proc.returncode == 2 and len(message.splitlines()) == 1, proc.stdout + proc.stderr
    assert message.startswith(f"error: Slurm is not reachable ({NOT_REACHABLE}): start the cluster")
    assert "SLURM_CONF" in message and "`--gpus N` plans without one" in message


def test_doctor_says_in_one_line_that_a_gpu_simulator_needs_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    proc = vlaslurm("doctor", str(MANISKILL), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout and 'File "' not in proc.stdout, proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if "sim_backend" in line]
    assert "no CUDA GPU" in line and "env.sim_backend=cpu" in line, line
