"""The package's structural rules (docs/architecture.md) that import-linter does not check.

- Only vlaslurm/rundir/ spells a run-directory file name.
- No module imports a private name of another package.
(The one-way layers themselves are import-linter's contract in pyproject.toml, run by .ci/test.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Tuple

from vlaslurm.rundir import layout

PACKAGE = Path(__file__).resolve().parent.parent / "vlaslurm"


def modules() -> Iterator[Tuple[str, Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text(), str(path))


def run_dir_names() -> Tuple[set, set]:
    """(file names with an extension, every name) of layout's constants."""
    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)}
    return {n for n in names if "." in n.strip(".")}, names


def spelled_names(tree: ast.Module) -> List[Tuple[int, str]]:
    files, every = run_dir_names()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in files:
            found.append((node.lineno, node.value))
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and node.value.value in every
            and any(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
        ):
            found.append((node.lineno, f"= {node.value.value!r}"))  # a constant of its own for a layout name
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value in every - files
        ):
            found.append((node.lineno, f"/ {node.right.value!r}"))
    return sorted(found)


def test_only_rundir_spells_run_directory_file_names():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for name, path, tree in modules()
        if not name.startswith("vlaslurm.rundir")
        for line, what in spelled_names(tree)
    ]
    assert not offenders, "run-directory names outside vlaslurm/rundir/ (use rundir.RunDir):\n" + "\n".join(offenders)


def imported_private_names(module: str, tree: ast.Module) -> List[Tuple[int, str]]:
    package = module.split(".")[:2]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("vlaslurm"):
            if node.module.split(".")[:2] == package:
                continue
            for alias in node.names:
                if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split(".")[2:]):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    return found


def test_no_module_imports_a_private_name_of_another_package():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for name, path, tree in modules()
        for line, what in imported_private_names(name, tree)
    ]
    assert not offenders, "private names imported across packages:\n" + "\n".join(offenders)


def test_the_checks_find_what_they_look_for():
    """The two scanners above are not vacuous: they flag a hand-written offender."""
    bad = ast.parse(
        'from vlaslurm.cli import _load\nx = run_dir / "metrics.jsonl"\ny = run_dir / "logs"\nLOG_DIR = "logs"\n'
    )
    assert imported_private_names("vlaslurm.runtime.x", bad) == [(1, "vlaslurm.cli._load")]
    assert spelled_names(bad) == [(2, "metrics.jsonl"), (3, "/ 'logs'"), (4, "= 'logs'")]


def test_no_source_text_outside_rundir_names_a_run_directory_file():
    """What `git grep` would find: docstrings and messages too (a checkpoint's inner files such as
    model.safetensors are left out: release folders have files of those names)."""
    inner = {getattr(layout, k) for k in vars(layout) if k.startswith(("CKPT_", "TRACKER_"))} - {layout.LEDGER}
    names = sorted(run_dir_names()[0] - inner)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?!\w)")
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(1)}"
        for name, path, _ in modules()
        if not name.startswith("vlaslurm.rundir")
        for text in [path.read_text()]
        for m in pattern.finditer(text)
    ]
    assert not offenders, "run-directory file names outside vlaslurm/rundir/:\n" + "\n".join(offenders)
