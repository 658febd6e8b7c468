"""`vlaslurm eval`: the frozen policy's success per task, with its failed trajectories kept.

Simulator and policy run without a trainer, in one local process: this is the
baseline to reproduce (e.g. the SFT checkpoint in `model.path`) before RL.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from vlaslurm.envs import make_env
from vlaslurm.models import PolicyInput, build_policy
from vlaslurm.runtime import rundir
from vlaslurm.runtime.episodes import mix_seed, run_chunk
from vlaslurm.runtime.failures import FailureKeeper
from vlaslurm.runtime.rendezvous import write_atomic
from vlaslurm.runtime.roles.simulator import env_dims
from vlaslurm.spec import LoadedSpec

EVAL_FILE = "eval.json"


def evaluate(loaded: LoadedSpec, runs_root: Path, episodes: int, keep_failed: int = 3,
             deterministic: bool = True) -> Path:
    """Run `episodes` episodes with the frozen policy; write `eval.json` and `failed/<task>-<n>.npz`
    (with images, also `failures/<task>/<n>.gif`: the frames of the episode, as training keeps them)."""
    spec = loaded.spec
    directory = rundir.new_run_dir(runs_root, f"{spec.name}-eval")
    env = make_env(spec.env, num_envs=min(spec.env.num_envs, episodes), rank=0, seed=spec.rollout.seed)
    policy = build_policy(spec.model, **env_dims(env, spec.env)).eval()
    results: Dict[str, List[bool]] = defaultdict(list)
    kept: Dict[str, int] = defaultdict(int)
    frames = FailureKeeper(directory, keep_failed, background=False)
    started = 0
    ids = np.arange(env.num_envs)
    obs = env.reset(ids, [mix_seed(spec.rollout.seed, int(i), 0) for i in ids])
    started = env.num_envs
    trace = {int(i): [] for i in ids}
    while len(ids):
        with torch.no_grad():
            out = policy.act(PolicyInput(_tensor(obs.images), _tensor(obs.state), obs.instructions),
                             deterministic=deterministic)
        actions = out.actions.float().numpy()
        result = run_chunk(env, ids, actions)
        next_ids, next_obs = [], []
        for row, i in enumerate(ids):
            trace[int(i)].append((obs.state[row] if obs.state is not None else None, actions[row],
                                  obs.images[row] if obs.images is not None else None))
            last = result.last_obs[row]
            if not (result.terminated[row] or result.truncated[row]):
                next_ids.append(i)
                next_obs.append(last)
                continue
            task, success = env.tasks[i], bool(result.success[row])
            results[task].append(success)
            if not success and kept[task] < keep_failed:
                _save_failed(directory, task, kept[task], obs.instructions[row], trace[int(i)])
                if last[0] is not None:  # the frames of every decision step and the final one
                    frames.keep(task, str(kept[task]), np.stack([s[2] for s in trace[int(i)]] + [last[0]]))
                kept[task] += 1
            trace[int(i)] = []
            if started < episodes:  # partial reset: this instance runs another episode
                fresh = env.reset([i], [mix_seed(spec.rollout.seed, int(i), started)])
                started += 1
                next_ids.append(i)
                next_obs.append((None if fresh.images is None else fresh.images[0],
                                 None if fresh.state is None else fresh.state[0], fresh.instructions[0]))
        ids = np.asarray(next_ids, dtype=np.int64)
        if len(ids):
            obs = _stack(next_obs)
    env.close()
    summary = {"spec": str(loaded.path), "episodes": sum(map(len, results.values())), "deterministic": deterministic,
               "success": {t: float(np.mean(v)) for t, v in sorted(results.items())},
               "episodes_per_task": {t: len(v) for t, v in sorted(results.items())}}
    write_atomic(directory / EVAL_FILE, json.dumps(summary, indent=2).encode(), mode=0o644)
    return directory


def _tensor(array):
    return None if array is None else torch.from_numpy(np.ascontiguousarray(array))


def _stack(items):
    from vlaslurm.runtime.episodes import stack_obs

    return stack_obs(items)


def _save_failed(directory: Path, task: str, index: int, instruction: str, steps: list) -> None:
    folder = directory / "failed"
    folder.mkdir(exist_ok=True)
    states = [s[0] for s in steps if s[0] is not None]
    np.savez_compressed(folder / f"{task}-{index}.npz", actions=np.stack([s[1] for s in steps]),
                        states=np.stack(states) if states else np.zeros(0), instruction=np.asarray(instruction))
