"""Containers per role: how one srun step starts its ranks inside pyxis/enroot or Apptainer.

A role with `resources.<role>.container.image` runs each rank in that image, with the runs root,
the code (first on PYTHONPATH), the site's scratch folder and the role's own mounts at their own
paths. Neither runtime exists where vlaslurm is tested: golden files check the rendered steps.
Details: docs/slurm.md
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from vlaslurm.slurm.render import RenderError
from vlaslurm.spec import LoadedSpec
from vlaslurm.spec.schema import ContainerConfig

CODE_DIR = Path(__file__).resolve().parent.parent.parent  # the folder holding the vlaslurm package
DEFAULT_RUNTIME = "pyxis"
RUN_DIR_VAR = '"$RUN_DIR"'  # the batch script's variable (its final path includes the job id)


class ContainerError(RenderError):
    """A path cannot be written into a runtime's mount list."""


@dataclass(frozen=True)
class StepLaunch:
    """How one role's step starts a rank: srun flags and the command before `-m vlaslurm.runtime.worker`."""

    srun_options: str  # shell text after srun's own flags ('' or starting with a space)
    command: str  # shell text that runs Python, e.g. '"$PYTHON"'


HOST = StepLaunch("", '"$PYTHON"')


def runtime_of(loaded: LoadedSpec, container: ContainerConfig) -> str:
    """The role's runtime: its own, else the site's, else pyxis."""
    site = loaded.site.config.container.runtime if loaded.site else None
    return container.runtime or site or DEFAULT_RUNTIME


def step_launch(
    loaded: LoadedSpec, role: str, run_dir: Path, job_id_suffix: bool, code_dir: Optional[Path] = None
) -> StepLaunch:
    """How `role`'s ranks start: on the host (no image) or in its container.

    With the standard layout (`<root>/<name>/<stamp>-<jobid>`, `job_id_suffix`) the runs root is mounted
    (run directory, rendezvous, MLflow's SQLite file); an explicit run directory is mounted as "$RUN_DIR".
    """
    container = loaded.spec.role_resources(role).container
    if not container.image:
        return HOST
    code_dir = code_dir or CODE_DIR
    _check_mount_path(str(Path(run_dir).resolve()))
    static_mounts = [str(Path(run_dir).resolve().parent.parent)] if job_id_suffix else []
    mounts = [*static_mounts, str(code_dir)]
    scratch = loaded.site.config.scratch if loaded.site else None
    if scratch:
        mounts.append(scratch)
    for path in mounts:
        _check_mount_path(path)
    mounts = [f"{m}:{m}" for m in _unique(mounts)] + [_full_mount(m) for m in container.mounts]
    python = f"env PYTHONPATH={shlex.quote(str(code_dir))} {shlex.quote(container.python)}"
    runtime = runtime_of(loaded, container)
    options = "".join(f" {shlex.quote(o)}" for o in container.options)
    if runtime == "pyxis":
        run_dir_mount = "" if static_mounts else f'{RUN_DIR_VAR[:-1]}:$RUN_DIR",'
        return StepLaunch(
            f" --container-image={shlex.quote(container.image)} "
            f"--container-mounts={run_dir_mount}{shlex.quote(','.join(mounts))}{options}",
            python,
        )
    binds = ([] if static_mounts else [f"--bind {RUN_DIR_VAR}"]) + [f"--bind {shlex.quote(m)}" for m in mounts]
    return StepLaunch("", f"apptainer exec --nv {' '.join(binds)}{options} {shlex.quote(container.image)} {python}")


def _full_mount(mount: str) -> str:
    parts = mount.split(":")
    return mount if len(parts) > 1 else f"{mount}:{mount}"


def _check_mount_path(path: str) -> None:
    if any(c in path for c in ",:\n"):
        raise ContainerError(
            f"{path!r} contains ',', ':' or a newline, which container runtimes read as list "
            "separators; choose another --runs-root or checkout folder"
        )


def _unique(items: List[str]) -> List[str]:
    return list(dict.fromkeys(items))


def describe(launch: StepLaunch) -> Optional[str]:
    """One line for `vlaslurm plan`, or None on the host."""
    return None if launch is HOST else (launch.srun_options.strip() + " " + launch.command).strip()
