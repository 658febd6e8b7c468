"""The bad-input corpus: every malformed spec in tests/bad_specs, through the command line's entry point.

Each file's first line says what the error must name: `# expect: <dotted key> at line <n> (<hint>)
[commands] --site <site>` (key `-` where the YAML itself is broken; commands default to `plan`; the site,
none by default, is passed as `--site`). Each must exit
with code 2 and one line `error: <file>:<line>: <key>: ...`, no traceback, and leave the runs root
exactly as it was (nothing submitted, created or overwritten).

The corpus calls `vlaslurm.cli.main` in the test's process (an exception escaping it fails the test as a
traceback would): a fresh interpreter per file cost ~0.4 s of CPU each, 45 s per suite. A sample of the corpus,
and the unreadable files, go through the real `python -m vlaslurm.cli` as a user's shell runs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import subprocess
from pathlib import Path
from typing import Dict

import pytest
from conftest import REPO, vlaslurm

from vlaslurm.cli import main

CORPUS = sorted((REPO / "tests" / "bad_specs").glob("*.yaml"))
_EXPECT = re.compile(
    r"^# expect: (?P<key>\S+) at line (?P<line>\d+)(?: \((?P<hint>[^)]*)\))?(?: \[(?P<cmds>[^]]*)\])?"
    r"(?: --site (?P<site>\S+))?"
)


def snapshot(root: Path) -> Dict[str, str]:
    """Every file under `root` with a hash of its content."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """A runs root that already holds a run (its files must survive untouched)."""
    old = tmp_path / "runs" / "bad" / "20260101-000000"
    old.mkdir(parents=True)
    (old / "run.json").write_text('{"name": "bad"}')
    (tmp_path / "runs" / "index.jsonl").write_text('{"name": "bad"}\n')
    return tmp_path / "runs"


def check_user_error(proc, spec: Path) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"error: {spec}"), message
    return message


def in_process(*args: str, runs_root: Path) -> subprocess.CompletedProcess:
    """`vlaslurm ARGS` through `vlaslurm.cli.main` in this process, as `conftest.vlaslurm` runs it in a child."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["--runs-root", str(runs_root), *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's own usage errors
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


SAMPLE = CORPUS[:: max(1, len(CORPUS) // 6)]  # through the real command line too


@pytest.mark.parametrize("spec", CORPUS, ids=lambda p: p.stem)
def test_bad_spec_is_one_user_error_and_changes_nothing(
    spec: Path, runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expect = _EXPECT.match(spec.read_bytes().decode("utf-8", "replace").splitlines()[0])
    assert expect, f"{spec.name}: first line must be '# expect: KEY at line N (HINT) [COMMANDS]'"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("VLASLURM_SITE", "none")
    before = snapshot(runs_root)
    for command in (expect["cmds"] or "plan").split():
        site = ["--site", expect["site"]] if expect["site"] else []
        if spec in SAMPLE:
            proc = vlaslurm(command, str(spec), *site, runs_root=runs_root)
        else:
            proc = in_process(command, str(spec), *site, runs_root=runs_root)
        message = check_user_error(proc, spec)
        key = "" if expect["key"] == "-" else f" {expect['key']}:"
        assert f"{spec}:{expect['line']}:{key}" in message, message
        assert (expect["hint"] or "") in message, message
    assert snapshot(runs_root) == before


def test_unreadable_spec_files(tmp_path: Path, runs_root: Path) -> None:
    before = snapshot(runs_root)
    missing = tmp_path / "no such spec.yaml"
    directory = tmp_path / "a-folder.yaml"
    directory.mkdir()
    cases = [missing, directory]
    if os.getuid() != 0:  # root reads anything
        locked = tmp_path / "locked.yaml"
        locked.write_text(CORPUS[0].read_text())
        locked.chmod(0)
        cases.append(locked)
    for spec in cases:
        for command in ("plan", "run", "submit"):
            check_user_error(vlaslurm(command, str(spec), runs_root=runs_root), spec)
    assert snapshot(runs_root) == before


def test_setup_lines_are_shell_and_never_interpolated(tmp_path: Path) -> None:
    """`${...}` in slurm.setup is the batch shell's business (e.g. ${SCRATCH:-/tmp}); the spec loader
    must pass it through literally, not resolve it (OmegaConf would) or fail on it."""
    spec = tmp_path / "setup.yaml"
    spec.write_text(
        "name: setup\nenv: {type: synthetic, num_envs: 8}\nmodel: {type: synthetic}\n"
        "algo: {type: synthetic}\nslurm:\n  setup:\n"
        "    - 'export DATA=${SCRATCH:-/tmp}/data'\n    - 'echo ${oc.env:HOME} $(hostname)'\n"
    )
    proc = vlaslurm("plan", str(spec), runs_root=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr
    assert "\nexport DATA=${SCRATCH:-/tmp}/data\n" in proc.stdout
    assert "\necho ${oc.env:HOME} $(hostname)\n" in proc.stdout
