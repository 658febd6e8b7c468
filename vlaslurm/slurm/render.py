"""Render a hetjob plan into sbatch script text through a Jinja template users can edit."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import jinja2

from vlaslurm.rundir import layout
from vlaslurm.runtime.signals import REQUEUE_EXIT
from vlaslurm.spec import LoadedSpec
from vlaslurm.spec.plan import HetjobPlan

TEMPLATE_DIR = Path(__file__).resolve().parent.parent.parent / "sbatch_templates"
TEMPLATE_NAME = "hetjob.sbatch.j2"
ENTRY_MODULE = "vlaslurm.runtime.worker"
# What each rank runs, by the plan's kind: the roles, or (eval) the frozen policy's episodes without a trainer
ENTRY_MODULES = {"train": ENTRY_MODULE, "eval": "vlaslurm.runtime.evaluate"}
# #SBATCH values are parsed by sbatch, not a shell: allow only what needs no quoting there.
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9._:,@+=\-/%\[\]|&()!*]+")  # fullmatch: `$` would let a final newline in
_SBATCH_LINE = re.compile(r'#SBATCH (hetjob|--[a-z][a-z0-9-]*(=([^\s"]+|"[^"\\]*"))?)')  # a quoted path may hold spaces


class RenderError(ValueError):
    """A value cannot be written into an sbatch script safely."""


@dataclass(frozen=True)
class RenderOptions:
    """Things the script needs that are not in the spec."""

    run_dir: Path
    job_id_suffix: bool = False  # the run directory is `<run_dir>-<job id>`, renamed after sbatch
    python: str = sys.executable
    entry_args: Sequence[str] = ()  # extra arguments of every rank, e.g. ("--probe",); each is shell-quoted
    template_dir: Optional[Path] = None


def render_script(loaded: LoadedSpec, plan: HetjobPlan, options: RenderOptions) -> str:
    """The sbatch script of `plan`."""
    spec = loaded.spec
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(options.template_dir or TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    template = env.get_template(TEMPLATE_NAME)
    run_dir = str(Path(options.run_dir).resolve())
    suffix = "-%j" if options.job_id_suffix else ""
    run_dir_q = shlex.quote(run_dir) + ('-"${SLURM_JOB_ID}"' if options.job_id_suffix else "")
    from vlaslurm.slurm.containers import step_launch

    launch = {
        step.role: step_launch(loaded, step.role, Path(options.run_dir), options.job_id_suffix) for step in plan.steps
    }
    for key, value in _sbatch_values(spec, plan).items():
        if not _SBATCH_VALUE.fullmatch(value):
            raise loaded.error(key, f"{value!r} cannot be an #SBATCH value (no spaces, quotes or shell characters)")
    script = template.render(
        header=_one_line(
            f"spec: {loaded.path.name}" + (f" with {' '.join(loaded.overrides)}" if loaded.overrides else "")
        ),
        name=spec.name,
        batch_log=_sbatch_path(f"{run_dir.replace('%', '%%')}{suffix}/{layout.LOGS}/{layout.BATCH_LOG_PATTERN}"),
        time=spec.slurm.time,
        signal_seconds=spec.slurm.signal_seconds,
        account=spec.slurm.account,
        extra=sorted(spec.slurm.extra.items()),
        components=plan.components,
        hetjob=len(plan.components) > 1,
        steps=plan.steps,
        run_dir_q=run_dir_q,
        python_q=shlex.quote(options.python),
        setup=[*_site_setup(loaded), *spec.slurm.setup],
        launch=launch,
        kind=plan.kind,
        entry_module=ENTRY_MODULES[plan.kind],
        entry_args="".join(f" {shlex.quote(arg)}" for arg in options.entry_args),
        requeue_exit=REQUEUE_EXIT,
        logs=layout.LOGS,
        exit_record=layout.EXIT_RECORD,
    )
    check_header(script)
    return script


def check_header(script: str) -> None:
    """The script's header, up to its first command, is comments and well-formed #SBATCH lines only: no value
    may end a line early and start a command of its own (the values' own checks come first; this is the net)."""
    for number, line in enumerate(script.splitlines()[1:], start=2):
        if not line.strip():
            continue
        if not line.startswith("#"):
            return
        if line.startswith("#SBATCH") and not _SBATCH_LINE.fullmatch(line.rstrip()):
            raise RenderError(f"rendered #SBATCH line {number} is malformed: {line!r}")


def _sbatch_values(spec, plan: HetjobPlan) -> dict:
    values = {"slurm.time": spec.slurm.time}
    if spec.slurm.account:
        values["slurm.account"] = spec.slurm.account
    for key, value in spec.slurm.extra.items():
        values[f"slurm.extra.{key}"] = value
    for comp in plan.components:
        role = comp.roles[0]
        for attr in ("partition", "constraint", "mem", "gres_type"):
            value = getattr(comp, attr)
            if value:
                values[
                    f"resources.{role}.{attr}"
                    if attr != "partition" or getattr(spec.resources, role).partition
                    else "slurm.partition"
                ] = value
    return values


def _site_setup(loaded: LoadedSpec) -> list:
    """The site profile's setup lines (verbatim) and its scratch folder, before the spec's own lines."""
    site = loaded.site
    if site is None or not (site.config.setup or site.config.scratch):
        return []
    lines = [_one_line(f"# site {site.name} ({site.path})"), *site.config.setup]
    if site.config.scratch:
        lines.append(f"export VLASLURM_SCRATCH={shlex.quote(site.config.scratch)}")
    return lines


def _one_line(text: str) -> str:
    """A comment line cannot be left by a newline in an override."""
    return " ".join(text.splitlines())


def _sbatch_path(path: str) -> str:
    """A path for an #SBATCH line: sbatch honours double quotes there, a shell never sees it."""
    if '"' in path or "\n" in path or "\\" in path:
        raise RenderError(
            f"run directory {path!r} contains a double quote, backslash or newline; choose another --runs-root"
        )
    return f'"{path}"' if re.search(r"\s", path) else path
