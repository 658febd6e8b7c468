"""Every file name of a run directory, in one place.

<runs-root>/index.jsonl            one line per run (RUN can be a directory, a name or a job id)
<runs-root>/<name>/<stamp>[-<jobid>]/
    run.json  spec.yaml  secret  site.yaml  job.sbatch  job-resume-<n>.sbatch  spec-before-resume-<n>.yaml
    exit_record.jsonl  restarts.jsonl  metrics.jsonl  final.json  eval.json  ledger.parquet
    logs/<role>/<rank>.log  logs/batch-<jobid>.log
    events/ counters/ heartbeats/ probe/   <role>-<rank>.json(l)
    rendezvous/<job-key>/  weights/  checkpoints/v<version>/  checkpoints/fallbacks.jsonl  final_model/
    eval/sim-<rank>.json  failed/ (eval trajectories)  failures/<task>/<n>.gif  tracking/ (tracker state)
    evals.jsonl  evals/v<version>/{weights.pt, eval.json, failed/, failures/<task>/<n>.gif} (eval while training)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List

INDEX = "index.jsonl"
RUN_INFO = "run.json"
SPEC = "spec.yaml"
SECRET = "secret"
SITE_COPY = "site.yaml"  # the site profile the run was submitted with
JOB_SCRIPT = "job.sbatch"
EXIT_RECORD = "exit_record.jsonl"
RESTARTS = "restarts.jsonl"
METRICS = "metrics.jsonl"
FINAL = "final.json"
EVAL = "eval.json"
LEDGER = "ledger.parquet"
LOGS = "logs"
BATCH_LOG_PATTERN = "batch-%j.log"  # the batch script's own log; %j is the job id (sbatch --output)
EVENTS = "events"
COUNTERS = "counters"
HEARTBEATS = "heartbeats"
PROBE = "probe"
RENDEZVOUS = "rendezvous"
WEIGHTS = "weights"
CHECKPOINTS = "checkpoints"
FINAL_MODEL = "final_model"
FAILED = "failed"  # eval's failed trajectories (.npz)
EVAL_PARTS = "eval"  # eval/sim-<rank>.json: each simulator rank's outcomes, merged into eval.json by rank 0
FAILURES = "failures"  # GIFs of failed training episodes, per task
TRACKING = "tracking"  # what the tracker keeps besides MLflow's own store
EVALS = "evals"  # evals/v<version>/: an evaluation while training (the spec's eval:), laid out as an eval run
EVALS_LOG = "evals.jsonl"  # one line per finished evaluation while training
EVAL_WEIGHTS = "weights.pt"  # inside evals/v<version>/: the weights evaluated (removed once read)
MLFLOW_RUN_ID = "mlflow_run_id"  # the MLflow run the tracker created
PROFILE_ARTIFACTS = "profile*"  # profiler output a user leaves in the run directory: logged as artifacts
PROFILES = ".profiles"  # placement profiles, under the runs root
COMPARISONS = "comparisons"  # `vlaslurm compare` tables, under the runs root
MLARTIFACTS = "mlartifacts"  # the embedded MLflow store's artifacts, under the runs root

# inside one checkpoint folder
CKPT_STATE = "state.json"
CKPT_MANIFEST = "manifest.json"  # every other file's path, size and sha256; written last: marks a complete folder
CKPT_MODEL = "model.safetensors"
CKPT_RNG = "rng.safetensors"
CKPT_OPTIM = "optim.pt"
CKPT_LEDGER = LEDGER
CHECKPOINT_NAME = re.compile(r"v(\d{8,})")  # checkpoints/v<version, 8+ digits>; use fullmatch
CHECKPOINT_FALLBACKS = "fallbacks.jsonl"  # checkpoints/fallbacks.jsonl: resumes that skipped a checkpoint
# inside tracking/
TRACKER_STATE = "state.json"  # the last metrics line and evals-log line sent, so a restarted tracker skips them
TRACKER_FAILED = "failed_trajectories.json"

ROLE_FILE_DIRS = (EVENTS, COUNTERS, HEARTBEATS)
FREED_BY_CLEAN = (WEIGHTS, EVENTS, RENDEZVOUS)  # large or transient: `vlaslurm clean` frees them once a run ended


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created or read here)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    info = property(lambda self: self.root / RUN_INFO)
    spec = property(lambda self: self.root / SPEC)
    secret = property(lambda self: self.root / SECRET)
    site_copy = property(lambda self: self.root / SITE_COPY)
    job_script = property(lambda self: self.root / JOB_SCRIPT)
    exit_record = property(lambda self: self.root / EXIT_RECORD)
    restarts = property(lambda self: self.root / RESTARTS)
    metrics = property(lambda self: self.root / METRICS)
    final = property(lambda self: self.root / FINAL)
    eval = property(lambda self: self.root / EVAL)
    ledger = property(lambda self: self.root / LEDGER)
    logs = property(lambda self: self.root / LOGS)
    events = property(lambda self: self.root / EVENTS)
    counters = property(lambda self: self.root / COUNTERS)
    heartbeats = property(lambda self: self.root / HEARTBEATS)
    probe = property(lambda self: self.root / PROBE)
    rendezvous_root = property(lambda self: self.root / RENDEZVOUS)
    weights = property(lambda self: self.root / WEIGHTS)
    checkpoints = property(lambda self: self.root / CHECKPOINTS)
    checkpoint_fallbacks = property(lambda self: self.root / CHECKPOINTS / CHECKPOINT_FALLBACKS)
    final_model = property(lambda self: self.root / FINAL_MODEL)
    failed = property(lambda self: self.root / FAILED)
    failures = property(lambda self: self.root / FAILURES)
    tracking = property(lambda self: self.root / TRACKING)
    evals = property(lambda self: self.root / EVALS)
    evals_log = property(lambda self: self.root / EVALS_LOG)

    def periodic_eval(self, version: int) -> Path:
        return self.evals / f"v{version:08d}"

    def periodic_eval_weights(self, version: int) -> Path:
        return self.periodic_eval(version) / EVAL_WEIGHTS

    def checkpoint(self, version: int) -> Path:
        return self.checkpoints / f"v{version:08d}"

    def resume_script(self, n: int) -> Path:
        return self.root / f"job-resume-{n}.sbatch"

    def resume_scripts(self) -> List[Path]:
        return sorted(self.root.glob("job-resume-*.sbatch"))

    def spec_before_resume(self, n: int) -> Path:
        return self.root / f"spec-before-resume-{n}.yaml"

    def specs_before_resume(self) -> List[Path]:
        return sorted(self.root.glob("spec-before-resume-*.yaml"))

    def log(self, role: str, rank: int) -> Path:
        return self.logs / role / f"{rank}.log"

    def batch_logs(self) -> List[Path]:
        return sorted(self.logs.glob(BATCH_LOG_PATTERN.replace("%j", "*")))

    def role_logs(self, role: str | None = None, rank: int | None = None) -> List[Path]:
        return sorted(self.logs.glob(f"{role or '*'}/{rank if rank is not None else '*'}.log"))

    def event_log(self, role: str, rank: int) -> Path:
        return self.events / f"{role}-{rank}.jsonl"

    def counter(self, role: str, rank: int) -> Path:
        return self.counters / f"{role}-{rank}.json"

    def heartbeat(self, role: str, rank: int) -> Path:
        return self.heartbeats / f"{role}-{rank}.json"

    def heartbeat_files(self, role: str = "*") -> List[Path]:
        return sorted(self.heartbeats.glob(f"{role}-*.json"))

    def probe_record(self, role: str, rank: int) -> Path:
        return self.probe / f"{role}-{rank}.json"

    def rendezvous(self, job_key: str) -> Path:
        return self.rendezvous_root / job_key

    def eval_part(self, rank: int) -> Path:
        return self.root / EVAL_PARTS / f"sim-{rank}.json"

    def failed_trajectory(self, task: str, index: int) -> Path:
        return self.failed / f"{task}-{index}.npz"

    def holds_run(self) -> bool:
        return self.info.exists()


def profiles_dir(runs_root: str | os.PathLike[str]) -> Path:
    return Path(runs_root) / PROFILES


def comparisons_dir(runs_root: str | os.PathLike[str]) -> Path:
    return Path(runs_root) / COMPARISONS


def index_path(runs_root: str | os.PathLike[str]) -> Path:
    return Path(runs_root) / INDEX
