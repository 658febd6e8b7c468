"""Evaluation while training (`eval.every_versions`): trainer rank 0 saves the weights of every n-th version and
starts a low-priority process beside it, which plays `eval.episodes` episodes with them through `vlaslurm eval`'s
loop (the same seeds at every version) and appends the result to the run's evals log; tracking sends it to
MLflow with the failed episodes' GIFs. Rollouts never stop for it: an evaluation still running when the next one
is due makes that one skipped, and said. Details: docs/runtime.md"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from vlaslurm.log import get_logger, set_context
from vlaslurm.models import build_policy
from vlaslurm.rundir import RunDir
from vlaslurm.runtime.context import run_spec
from vlaslurm.runtime.evaluate import EvalConfig, play
from vlaslurm.runtime.roles.simulator import env_dims
from vlaslurm.spec.schema import PeriodicEvalConfig

log = get_logger("vlaslurm.eval")
NICE = 10  # the evaluation yields the CPU to the rollouts beside it


class PeriodicEval:
    """Trainer rank 0's side: when a version is due, its weights go to `RunDir.periodic_eval_weights` and a process
    evaluates them; one at a time."""

    def __init__(self, cfg: PeriodicEvalConfig, run_dir: Path, device: torch.device) -> None:
        self.cfg, self.run_dir, self.device = cfg, Path(run_dir), device
        self.process: Optional[subprocess.Popen] = None

    def due(self, version: int) -> bool:
        return self.cfg.every_versions > 0 and version > 0 and version % self.cfg.every_versions == 0

    def maybe_start(self, policy: torch.nn.Module, version: int, env_steps: int) -> bool:
        """Start evaluating `policy`'s weights as version `version` (trained on `env_steps` env steps) if it is due
        and no evaluation is running; whether it started."""
        if not self.due(version):
            return False
        if self.process is not None and self.process.poll() is None:
            log.warning("version %d is not evaluated: the evaluation of an earlier version is still running", version)
            return False
        layout = RunDir(self.run_dir)
        layout.periodic_eval(version).mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        torch.save(weights, layout.periodic_eval_weights(version))
        output = layout.log("eval", version)
        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.run_dir), str(version), str(env_steps), str(self.device)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        log.info("evaluating version %d (%d episodes; log %s)", version, self.cfg.episodes, output)
        return True

    def close(self, wait_s: float) -> None:
        """At the end of training: let a running evaluation finish for up to `wait_s`, then stop it."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.warning("the evaluation still running after %.0f s is stopped", wait_s)
            self.process.kill()
            self.process.wait()


def evaluate_version(run_dir: Path, version: int, env_steps: int, device: str = "cpu") -> dict:
    """The process's work: play the saved weights of `version`, write its result beside them (`RunDir.eval`),
    append a line to the evals log, remove the weights. Returns that line."""
    spec = run_spec(run_dir)
    layout = RunDir(run_dir)
    weights_path = layout.periodic_eval_weights(version)
    weights = torch.load(weights_path, map_location=device, weights_only=True)
    cfg = EvalConfig(spec.eval.episodes, spec.eval.keep_failed, spec.eval.deterministic)

    def policy_for(env):
        policy = build_policy(spec.model, **env_dims(env, spec.env)).to(device)
        policy.load_state_dict(weights)
        return policy

    start = time.monotonic()
    summary = play(spec, layout.periodic_eval(version), cfg, policy_for, str(layout.spec))
    weights_path.unlink()
    outcomes = [ok for eps in summary["outcomes"].values() for ok in eps.values()]
    line = {
        "version": version,
        "env_steps": env_steps,
        "success_rate": sum(outcomes) / max(len(outcomes), 1),
        "episodes": len(outcomes),
        "eval_s": round(time.monotonic() - start, 2),
        **{f"success/{task}": rate for task, rate in summary["success"].items()},
    }
    with layout.evals_log.open("a") as handle:  # one writer: evaluations run one at a time
        handle.write(json.dumps(line) + "\n")
    return line


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m vlaslurm.runtime.periodic_eval RUN_DIR VERSION ENV_STEPS [DEVICE]`, started by `PeriodicEval`."""
    args = sys.argv[1:] if argv is None else argv
    set_context(role="eval", rank=0, version=int(args[1]))
    os.nice(NICE)
    torch.set_num_threads(1)
    line = evaluate_version(Path(args[0]), int(args[1]), int(args[2]), args[3] if len(args) > 3 else "cpu")
    log.info("version %d: success %.3f over %d episodes", line["version"], line["success_rate"], line["episodes"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
