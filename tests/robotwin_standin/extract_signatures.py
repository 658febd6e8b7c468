"""The RoboTwin API the vlaslurm adapter uses, as `path::Class.method(signature)` lines.

`SIGNATURES.txt` holds these lines for RoboTwin at the commit in `PINNED_COMMIT`, made inside a
RoboTwin clone with `python extract_signatures.py --git $(cat PINNED_COMMIT) > SIGNATURES.txt`.
`tests/test_env_robotwin.py` extracts the same lines from the stand-in under `root/` and requires
them to be identical, so the stand-in cannot drift from the real API.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

WANTED = {
    "envs/_base_task.py": {
        "Base_Task": [
            "_init_task_env_",
            "play_once",
            "check_success",
            "get_obs",
            "take_action",
            "close_env",
            "set_instruction",
            "get_instruction",
        ]
    },
    "envs/beat_block_hammer.py": {"beat_block_hammer": ["setup_demo", "play_once", "check_success"]},
    "envs/lift_pot.py": {"lift_pot": ["setup_demo", "play_once", "check_success"]},
    "envs/utils/create_actor.py": {"UnStableError": []},
    "description/utils/generate_episode_instructions.py": {None: ["generate_episode_descriptions"]},
}


def extract(read: Callable[[str], str]) -> List[str]:
    """Signature lines of WANTED, reading each file's source with `read(path)`."""
    lines = []
    for path, classes in WANTED.items():
        tree = ast.parse(read(path))
        for cls, methods in classes.items():
            if cls is None:
                lines += [
                    f"{path}::{n.name}({ast.unparse(n.args)})"
                    for n in tree.body
                    if isinstance(n, ast.FunctionDef) and n.name in methods
                ]
                continue
            node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
            lines.append(f"{path}::class {cls}({', '.join(ast.unparse(b) for b in node.bases)})")
            lines += [
                f"{path}::{cls}.{item.name}({ast.unparse(item.args)})"
                for item in node.body
                if isinstance(item, ast.FunctionDef) and item.name in methods
            ]
    return lines


def from_git(commit: str) -> Callable[[str], str]:
    return lambda path: (
        subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout
    )


def from_dir(root: Path) -> Callable[[str], str]:
    return lambda path: (Path(root) / path).read_text()


if __name__ == "__main__":
    reader = from_git(sys.argv[2]) if sys.argv[1] == "--git" else from_dir(Path(sys.argv[2]))
    print("\n".join(extract(reader)))
