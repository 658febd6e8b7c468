"""Damaged run directories (issue 19): every command names the damaged file and never shows a traceback.

One real run directory (made by `rundir.create_run` + `write_info` + a few records, no processes) is damaged in
one way per case; each command that reads the damaged file runs in-process. `status` and `runs` go on and mark
what they cannot read ("unreadable", exit 0); the others stop with exit code 2. The file's name is in the output.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest

from vlaslurm import rundir
from vlaslurm.cli import main
from vlaslurm.rundir import DamagedRunDir, RunDir, RunInfo, layout

SPEC = "name: exp\nrollout:\n  total_env_steps: 1000\nruntime:\n  timeout_s: 60\n"
EVAL = {"success": {"lift": 0.5}, "episodes_per_task": {"lift": 2}, "outcomes": {"lift": {"0": True, "1": False}}}


@dataclass(frozen=True)
class Damage:
    """One way to damage one file of the run directory, and the commands that read that file."""

    name: str
    file: str  # relative to the run directory, or to the runs root for the index
    apply: Callable[[Path, Path], None]  # (run directory, runs root)
    commands: Tuple[str, ...]


def make_run(root: Path, stamp: str = "20260101-000000", kind: str = "local") -> Path:
    """A finished (failed) local run with exit records, a restart, a heartbeat, metrics, eval, a log, a checkpoint."""
    directory = root / "exp" / stamp
    directory.mkdir(parents=True)
    rundir.create_run(directory, SPEC)
    info = RunInfo(name="exp", run_dir=str(directory), kind=kind, ranks={"trainer": 1}, created=1.0)
    rundir.write_info(info)
    rundir.append_index(root, info)
    rundir.append_exit_record(directory, {"step": "trainer", "exit_code": 1, "start": 0.0, "end": 2.0})
    rundir.append_exit_record(directory, {"step": "job", "exit_code": 1, "start": 0.0, "end": 2.0})
    rundir.append_restart(directory, {"role": "trainer", "rank": 0, "restart": 1, "exit_code": 1})
    rundir.append_metrics(directory, {"version": 1, "env_steps": 100, "wall_s": 1.0, "rollout/success_rate": 0.5})
    paths = RunDir(directory)
    paths.heartbeats.mkdir()
    paths.heartbeat("trainer", 0).write_text(json.dumps({"time": 1.0, "version": 1, "progress": "step 1"}))
    paths.eval.write_text(json.dumps(EVAL))
    paths.log("trainer", 0).parent.mkdir(parents=True)
    paths.log("trainer", 0).write_text("trainer log\n")
    checkpoint = paths.checkpoint(1)
    checkpoint.mkdir(parents=True)
    (checkpoint / getattr(layout, "CKPT_MANIFEST", layout.CKPT_STATE)).write_text("{}")
    return directory


def overwrite(relative: str, text: str) -> Callable[[Path, Path], None]:
    def apply(run_dir: Path, root: Path) -> None:
        (run_dir / relative).write_text(text)

    return apply


def append(relative: str, line: str) -> Callable[[Path, Path], None]:
    def apply(run_dir: Path, root: Path) -> None:
        with (run_dir / relative).open("a") as handle:
            handle.write(line + "\n")

    return apply


def truncate(relative: str) -> Callable[[Path, Path], None]:
    def apply(run_dir: Path, root: Path) -> None:
        path = run_dir / relative
        path.write_text(path.read_text()[: len(path.read_text()) // 2])

    return apply


def directory(relative: str) -> Callable[[Path, Path], None]:
    def apply(run_dir: Path, root: Path) -> None:
        path = run_dir / relative
        path.unlink()
        path.mkdir()

    return apply


def edit_info(**changes: object) -> Callable[[Path, Path], None]:
    def apply(run_dir: Path, root: Path) -> None:
        path = RunDir(run_dir).info
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return apply


def index_line(line: str) -> Callable[[Path, Path], None]:
    def apply(run_dir: Path, root: Path) -> None:
        with layout.index_path(root).open("a") as handle:
            handle.write(line + "\n")

    return apply


HEARTBEAT = "heartbeats/trainer-0.json"
RUN_INFO_READERS = ("status", "logs", "cancel", "clean", "runs", "resume", "compare")
EXIT_READERS = ("status", "clean", "runs", "resume")
SPEC_READERS = ("status", "resume", "compare")

CORPUS = [
    Damage("heartbeat-not-json", HEARTBEAT, overwrite(HEARTBEAT, "{not json"), ("status",)),
    Damage("heartbeat-truncated", HEARTBEAT, truncate(HEARTBEAT), ("status",)),
    Damage("heartbeat-a-list", HEARTBEAT, overwrite(HEARTBEAT, "[1, 2]"), ("status",)),
    Damage("heartbeat-a-directory", HEARTBEAT, directory(HEARTBEAT), ("status",)),
    Damage("exit-record-a-list", layout.EXIT_RECORD, append(layout.EXIT_RECORD, "[1]"), EXIT_READERS),
    Damage("exit-record-no-exit-code", layout.EXIT_RECORD, append(layout.EXIT_RECORD, '{"step": "job"}'), EXIT_READERS),
    Damage("exit-record-a-directory", layout.EXIT_RECORD, directory(layout.EXIT_RECORD), EXIT_READERS),
    Damage("restarts-no-role", layout.RESTARTS, append(layout.RESTARTS, '{"rank": 0}'), ("status",)),
    Damage("restarts-a-directory", layout.RESTARTS, directory(layout.RESTARTS), ("status",)),
    Damage("metrics-not-an-object", layout.METRICS, append(layout.METRICS, "3"), ("status", "compare")),
    Damage("eval-truncated", layout.EVAL, truncate(layout.EVAL), ("status", "eval-show")),
    Damage("eval-wrong-shape", layout.EVAL, overwrite(layout.EVAL, '{"success": 1}'), ("status", "eval-show")),
    Damage("run-json-garbage", layout.RUN_INFO, overwrite(layout.RUN_INFO, "garbage"), RUN_INFO_READERS),
    Damage("run-json-truncated", layout.RUN_INFO, truncate(layout.RUN_INFO), RUN_INFO_READERS),
    Damage("run-json-a-list", layout.RUN_INFO, overwrite(layout.RUN_INFO, "[]"), RUN_INFO_READERS),
    Damage("run-json-no-kind", layout.RUN_INFO, overwrite(layout.RUN_INFO, '{"name": "exp"}'), RUN_INFO_READERS),
    Damage("run-json-ranks-text", layout.RUN_INFO, edit_info(ranks="trainer"), RUN_INFO_READERS),
    Damage("run-json-a-directory", layout.RUN_INFO, directory(layout.RUN_INFO), RUN_INFO_READERS),
    Damage("job-id-not-numeric", layout.RUN_INFO, edit_info(kind="slurm", job_id="1; rm -rf ~"), RUN_INFO_READERS),
    Damage("spec-not-yaml", layout.SPEC, overwrite(layout.SPEC, "a: [1, 2\n"), SPEC_READERS),
    Damage("spec-a-list", layout.SPEC, overwrite(layout.SPEC, "- 1\n- 2\n"), SPEC_READERS),
    Damage("spec-a-directory", layout.SPEC, directory(layout.SPEC), SPEC_READERS),
    Damage("index-line-without-run-dir", layout.INDEX, index_line('{"name": "exp"}'), ("runs", "clean-all")),
    Damage("index-line-a-list", layout.INDEX, index_line("[1]"), ("runs", "clean-all")),
]
GOES_ON = ("status", "runs", "clean-all")  # show what they can, mark the rest unreadable, exit 0


def argv(command: str, run_dir: Path, root: Path, other: Path) -> List[str]:
    args: Dict[str, List[str]] = {
        "status": ["status", str(run_dir)],
        "logs": ["logs", str(run_dir)],
        "cancel": ["cancel", str(run_dir)],
        "clean": ["clean", str(run_dir), "--dry-run"],
        "clean-all": ["clean", "--older-than", "0s", "--dry-run"],
        "runs": ["runs"],
        "eval-show": ["eval", "--show", str(run_dir)],
        "resume": ["resume", str(run_dir), "--local"],
        "compare": ["compare", str(run_dir), str(other), "--no-mlflow", "--out", str(root / "cmp")],
    }
    return ["--runs-root", str(root), *args[command]]


CASES = [
    pytest.param(damage, command, id=f"{damage.name}-{command}") for damage in CORPUS for command in damage.commands
]


@pytest.mark.parametrize(("damage", "command"), CASES)
def test_a_damaged_file_is_named_without_a_traceback(
    damage: Damage, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no squeue, sbatch or scancel is ever reached
    monkeypatch.delenv("VLASLURM_SITE", raising=False)
    root = tmp_path / "runs"
    run_dir = make_run(root)
    other = make_run(root, "20260101-000001")
    damage.apply(run_dir, root)
    code = main(argv(command, run_dir, root, other))
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert Path(damage.file).name in text, text
    if command in GOES_ON:
        assert code == 0 and "unreadable" in text, text
    else:
        assert code == 2, text


def test_a_torn_record_line_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    run_dir = make_run(root)
    for name in (layout.EXIT_RECORD, layout.RESTARTS, layout.METRICS):
        append(name, '{"step": "trai')(run_dir, root)
    index_line('{"run_dir": "/tm')(run_dir, root)
    assert main(["--runs-root", str(root), "status", str(run_dir)]) == 0
    assert main(["--runs-root", str(root), "runs"]) == 0
    text = capsys.readouterr().out
    assert "unreadable" not in text and "FAILED(1)" in text


def test_a_resume_forgets_later_metrics_and_a_torn_line(tmp_path: Path) -> None:
    """A resume from version 1's checkpoint keeps the metric lines through version 1; the line a crash tore goes
    (it used to stop the resumed trainer with a JSON error)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for version in (0, 1, 2):
        rundir.append_metrics(run_dir, {"version": version, "env_steps": 100 * version})
    append(layout.METRICS, '{"version": 3, "env_st')(run_dir, tmp_path)
    rundir.keep_metrics_through(run_dir, 1)
    assert rundir.read_metrics(run_dir) == [{"version": 0, "env_steps": 0}, {"version": 1, "env_steps": 100}]
    rundir.keep_metrics_through(tmp_path / "none", 1)  # a run without metrics yet: nothing to forget
    assert not (tmp_path / "none").exists()


def test_the_final_summary_round_trips(tmp_path: Path) -> None:
    assert rundir.final_env_steps(tmp_path) == -1  # none yet
    rundir.write_final_summary(tmp_path, 4, 2048, "rollout.total_env_steps", "0123abcd")
    assert rundir.final_env_steps(tmp_path) == 2048
    assert json.loads(RunDir(tmp_path).final.read_text())["ended_by"] == "rollout.total_env_steps"


def test_a_record_of_the_wrong_shape_names_file_and_line(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "runs")
    append(layout.EXIT_RECORD, '{"step": "job", "exit_code": "one", "start": 0, "end": 1}')(run_dir, tmp_path)
    with pytest.raises(DamagedRunDir) as caught:
        rundir.exit_records(run_dir)
    assert caught.value.path == RunDir(run_dir).exit_record
    assert "line 3" in caught.value.what and "exit_code" in caught.value.what


def test_run_json_never_points_at_another_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`clean` acts on the directory named, not on the `run_dir` written inside its run.json."""
    root = tmp_path / "runs"
    run_dir = make_run(root)
    victim = tmp_path / "victim"
    (victim / layout.WEIGHTS).mkdir(parents=True)
    edit_info(run_dir=str(victim))(run_dir, root)
    (run_dir / layout.WEIGHTS).mkdir()
    assert rundir.read_info(run_dir).run_dir == str(run_dir.absolute())
    assert main(["--runs-root", str(root), "clean", str(run_dir), "--yes"]) == 0
    assert (victim / layout.WEIGHTS).is_dir() and not (run_dir / layout.WEIGHTS).exists()


def test_clean_skips_indexed_directories_outside_the_runs_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs"
    make_run(root)
    outside = make_run(tmp_path / "elsewhere")
    (outside / layout.WEIGHTS).mkdir()
    rundir.append_index(root, rundir.read_info(outside))
    assert main(["--runs-root", str(root), "clean", "--older-than", "0s", "--yes"]) == 0
    assert (outside / layout.WEIGHTS).is_dir()
    assert "not under the runs root" in capsys.readouterr().out
    assert main(["--runs-root", str(root), "clean", str(outside), "--yes"]) == 0  # named: it is cleaned
    assert not (outside / layout.WEIGHTS).exists()


def test_clean_never_follows_a_link_inside_a_run(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run_dir = make_run(root)
    target = tmp_path / "precious"
    (target / "v00000001").mkdir(parents=True)
    checkpoints = RunDir(run_dir).checkpoints
    for child in checkpoints.iterdir():
        (child / getattr(layout, "CKPT_MANIFEST", layout.CKPT_STATE)).unlink()
        child.rmdir()
    checkpoints.rmdir()
    checkpoints.symlink_to(target)
    (run_dir / layout.WEIGHTS).symlink_to(target)
    assert main(["--runs-root", str(root), "clean", str(run_dir), "--keep-checkpoints", "0", "--yes"]) == 0
    assert (target / "v00000001").is_dir()


def test_claim_run_dir_keeps_the_mode_of_an_existing_directory(tmp_path: Path) -> None:
    existing = tmp_path / "shared"
    existing.mkdir()
    os.chmod(existing, 0o755)
    rundir.claim_run_dir(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755
    fresh = rundir.claim_run_dir(tmp_path / "a" / "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
