"""Submit, query and cancel hetjobs; everything a run needs is written before sbatch."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from vlaslurm import rundir
from vlaslurm.rundir import RunDir, write_atomic
from vlaslurm.slurm.cluster import SlurmUnavailable, check_fits, default_partition, query_nodes, run_slurm
from vlaslurm.slurm.render import RenderOptions, render_script
from vlaslurm.spec import LoadedSpec, load_spec
from vlaslurm.spec.plan import build_plan, job_run_name
from vlaslurm.spec.validate import check_model_path

FORGOTTEN_JOB = "Invalid job id specified"  # squeue -j on a job slurmctld no longer knows (past MinJobAge)


@dataclass
class Submission:
    """A submitted job."""

    job_id: str
    run_dir: Path
    script: str


def plan_script(loaded: LoadedSpec, runs_root: Path, entry_args: Sequence[str] = ()) -> str:
    """The script `submit` would send, with the job id left to Slurm (nothing is written)."""
    run_dir = Path(runs_root) / loaded.spec.name / "<date>-<time>"
    return render_script(
        loaded, build_plan(loaded), RenderOptions(run_dir=run_dir, job_id_suffix=True, entry_args=entry_args)
    )


def test_only(loaded: LoadedSpec, runs_root: Path) -> str:
    """Ask Slurm whether it would accept the job (`sbatch --test-only`); return what it said."""
    plan = build_plan(loaded)
    check_fits(loaded, plan, query_nodes(), default_partition())
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as handle:
        handle.write(plan_script(loaded, runs_root))
    try:
        return _sbatch(["--test-only", handle.name])
    finally:
        os.unlink(handle.name)


def submit(
    loaded: LoadedSpec,
    runs_root: Path,
    run_dir: Optional[Path] = None,
    entry_args: Sequence[str] = (),
    sweep: Optional[str] = None,
    kind: str = "train",
) -> Submission:
    """Check the plan fits, write the run directory, and submit held; release once the directory is final.

    With no `run_dir`, the directory is renamed to `<stamp>-<jobid>` while the job is held, so the
    script (which computes the same name from $SLURM_JOB_ID) never starts before it exists.
    A `resources.placement: auto` spec must have its placement chosen first (`placement.resolve_auto`).
    `kind="eval"` submits the job without its trainer (`vlaslurm eval`; `entry_args` carry the eval's config),
    named `<name>-eval`.
    """
    check_model_path(loaded)
    plan = build_plan(loaded, kind)
    check_fits(loaded, plan, query_nodes(), default_partition())
    explicit = run_dir is not None
    name = job_run_name(loaded.spec.name, kind)
    directory = rundir.claim_run_dir(run_dir) if run_dir is not None else rundir.new_run_dir(runs_root, name)
    script = render_script(
        loaded, plan, RenderOptions(run_dir=directory, job_id_suffix=not explicit, entry_args=entry_args)
    )
    # `vlaslurm resume` renders with the same site (the resolved spec already holds its defaults)
    rundir.create_run(
        directory,
        loaded.to_yaml(),
        job_script=script,
        site_profile=loaded.site.path.read_bytes() if loaded.site is not None else None,
    )
    job_id = _sbatch(["--parsable", "--hold", str(RunDir(directory).job_script)]).strip().split(";")[0]
    if not explicit:
        final = directory.with_name(f"{directory.name}-{job_id}")
        directory.rename(final)
        directory = final
    info = rundir.RunInfo(
        name=name,
        run_dir=str(directory.resolve()),
        kind="slurm",
        job_id=job_id,
        spec_path=str(loaded.path),
        overrides=list(loaded.overrides),
        ranks=plan.ranks(),
        sweep=sweep,
    )
    rundir.write_info(info)
    rundir.append_index(runs_root, info)
    run_slurm(["scontrol", "release", job_id])
    return Submission(job_id, directory, script)


def resubmit(info: rundir.RunInfo, runs_root: Path) -> Submission:
    """Submit a stopped run again into its own run directory (`vlaslurm resume`): a new job id, so a fresh
    rendezvous; the trainer continues from the newest checkpoint. The first script is kept; this one is
    `job-resume-<n>.sbatch`."""
    directory = Path(info.run_dir)
    paths = RunDir(directory)
    loaded = load_spec(paths.spec, site=paths.site_copy if paths.site_copy.exists() else None)
    plan = build_plan(loaded)
    check_fits(loaded, plan, query_nodes(), default_partition())
    script = render_script(loaded, plan, RenderOptions(run_dir=directory))
    path = paths.resume_script(len(paths.resume_scripts()) + 1)
    write_atomic(path, script.encode(), mode=0o700)
    job_id = _sbatch(["--parsable", str(path)]).strip().split(";")[0]
    info.job_id = job_id
    rundir.write_info(info)
    rundir.append_index(runs_root, info)
    return Submission(job_id, directory, script)


def _sbatch(args: List[str]) -> str:
    import subprocess

    proc = subprocess.run(["sbatch", *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout + proc.stderr


def job_states(job_id: str) -> Dict[str, str]:
    """State of each component of a job that Slurm still knows ('123+0': 'RUNNING'); empty once forgotten.

    `-t all` keeps finished jobs (COMPLETED, FAILED, CANCELLED) for MinJobAge; plain squeue drops them at once.
    After that `squeue -j` fails with "Invalid job id specified": forgotten, not an error.
    """
    try:
        out = run_slurm(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%T"])
    except SlurmUnavailable as err:
        if FORGOTTEN_JOB in str(err):
            return {}
        raise
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def cancel(job_id: str) -> None:
    """Cancel every component of a job."""
    if not re.fullmatch(r"\d+", job_id):
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    run_slurm(["scancel", job_id])
