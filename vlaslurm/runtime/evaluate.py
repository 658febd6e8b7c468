"""`vlaslurm eval`: the frozen policy's success per task, with its failed trajectories kept.

One episode loop (`run_episodes`) runs either in one process (`--local`, `evaluate`) or as a
Slurm job of simulators and frozen generators without a trainer (`main`). Episode e runs on
environment e % n from a seed of (rollout.seed, e), so a job gives the same table as `--local`.
Details: docs/runtime.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from vlaslurm import rundir
from vlaslurm.envs import make_env
from vlaslurm.envs.base import Observation, VecEnv
from vlaslurm.log import get_logger
from vlaslurm.models import Policy, PolicyInput, build_policy, env_action_transform
from vlaslurm.rundir import Counters, Heartbeat, RunDir, write_atomic
from vlaslurm.runtime import messages as msgs
from vlaslurm.runtime.context import RankContext, make_context, meet, rank_from_env, run_spec
from vlaslurm.runtime.episodes import mix_seed, run_chunk, split_obs, stack_obs
from vlaslurm.runtime.failures import FailureKeeper
from vlaslurm.runtime.roles.simulator import env_dims
from vlaslurm.runtime.schedule import Sync
from vlaslurm.runtime.transport import Dealer, Router, rejection_counts, routing_id
from vlaslurm.spec import ExperimentSpec, LoadedSpec
from vlaslurm.spec.env_types import EnvConfig
from vlaslurm.spec.model_types import ModelConfig
from vlaslurm.spec.schema import BatchingConfig

log = get_logger("vlaslurm.eval")


@dataclass(frozen=True)
class EvalConfig:
    """How an eval runs: what `vlaslurm eval` passes to every rank of its job, besides the spec."""

    episodes: int  # in all, over every task
    keep_failed: int = 3  # failed trajectories kept per task (per simulator rank in a job)
    deterministic: bool = True  # the policy's mean action; False samples, seeded per episode and step

    def __post_init__(self) -> None:
        if self.episodes < 1 or self.keep_failed < 0:
            raise ValueError(
                f"eval needs --episodes >= 1 and --keep-failed >= 0, got {self.episodes} and {self.keep_failed}"
            )

    def args(self) -> List[str]:
        """This config as the command line of a job's ranks (read back by `main`)."""
        return [
            "--episodes",
            str(self.episodes),
            "--keep-failed",
            str(self.keep_failed),
            *([] if self.deterministic else ["--sample"]),
        ]


@dataclass(frozen=True)
class EvalRankConfig:
    """What a rank of an eval job needs: the eval's options, and the spec's env, model, seed and batching."""

    eval: EvalConfig
    env: EnvConfig
    model: ModelConfig
    seed: int  # rollout.seed
    batching: BatchingConfig  # rollout.batching, of the frozen generators

    @classmethod
    def from_spec(cls, spec: ExperimentSpec, eval_cfg: EvalConfig) -> EvalRankConfig:
        return cls(eval_cfg, spec.env, spec.model, spec.rollout.seed, spec.rollout.batching)

    @property
    def max_frame_bytes(self) -> int:
        """Larger frames are refused unread by this rank's sockets."""
        return msgs.max_frame_bytes(self.env, self.model.action_chunk)


@dataclass
class Decision:
    """The environments that need actions now: global ids, episode numbers, steps into the episode."""

    gids: List[int]
    episodes: List[int]
    steps: List[int]

    def seeds(self, seed: int) -> List[int]:
        return [mix_seed(seed, e, s, 1) for e, s in zip(self.episodes, self.steps)]


Act = Callable[[Observation, Decision], np.ndarray]  # -> action chunks [n, C, A], one row per environment


class Outcomes:
    """Success of every finished episode by task; failed ones written to `failed/<task>-<n>.npz` (and their
    frames to `failures/<task>/<n>.gif`), n counted per task from `first_index`."""

    def __init__(self, directory: Path, keep_failed: int, first_index: int = 0) -> None:
        self.directory, self.keep_failed, self.first_index = directory, keep_failed, first_index
        self.success: Dict[str, Dict[int, bool]] = defaultdict(dict)
        self.kept: Dict[str, int] = defaultdict(int)
        self.frames = FailureKeeper(directory, keep_failed, background=False)

    def add(self, task: str, episode: int, success: bool, instruction: str, trace: list, last) -> None:
        self.success[task][episode] = success
        if success or self.kept[task] >= self.keep_failed:
            return
        index = self.first_index + self.kept[task]
        _save_failed(self.directory, task, index, episode, instruction, trace)
        if last[0] is not None:  # the frames of every decision step and the final one
            self.frames.keep(task, str(index), np.stack([s[2] for s in trace] + [last[0]]))
        self.kept[task] += 1

    def to_json(self) -> Dict[str, Dict[str, bool]]:
        return {task: {str(e): s for e, s in sorted(eps.items())} for task, eps in sorted(self.success.items())}


def check_every_task_played(spec, episodes: int) -> None:
    """Instances take the tasks in turn and episodes the instances: with fewer episodes than tasks some tasks
    would not be played at all, and the result would say nothing of them."""
    tasks = list(getattr(spec.env, "tasks", None) or [])
    if episodes < len(tasks):
        raise ValueError(
            f"--episodes {episodes} is fewer than the spec's {len(tasks)} tasks (env.tasks): some "
            f"would never be played; ask for at least {len(tasks)} (a multiple of it plays each "
            f"task equally often)"
        )


def run_episodes(
    env: VecEnv,
    first_gid: int,
    num_envs: int,
    cfg: EvalConfig,
    seed: int,
    act: Act,
    outcomes: Outcomes,
    to_env: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    executed: Optional[int] = None,
) -> None:
    """Run the episodes of `env`'s instances (global ids from `first_gid`; `num_envs` over all ranks):
    each instance in turn runs episodes gid, gid + n, ... below cfg.episodes, with partial resets.
    `to_env` maps the policy's actions to the environment's (`env_action_transform`); traces keep the policy's.
    `executed`: the first actions of each chunk that run (`model.execute_actions`)."""
    n = min(num_envs, cfg.episodes)
    episode = {i: first_gid + i for i in range(env.num_envs) if first_gid + i < n}
    if not episode:
        return
    ids = sorted(episode)
    obs = env.reset(ids, [mix_seed(seed, episode[i]) for i in ids])
    steps = {i: 0 for i in ids}
    trace: Dict[int, list] = {i: [] for i in ids}
    while ids:
        actions = act(obs, Decision([first_gid + i for i in ids], [episode[i] for i in ids], [steps[i] for i in ids]))
        result = run_chunk(env, np.asarray(ids, dtype=np.int64), actions, to_env=to_env, executed=executed)
        going = []
        for row, i in enumerate(ids):
            trace[i].append(
                (
                    obs.state[row] if obs.state is not None else None,
                    actions[row],
                    obs.images[row] if obs.images is not None else None,
                )
            )
            steps[i] += int(result.mask[row].sum())
            last = result.last_obs[row]
            if result.terminated[row] or result.truncated[row]:
                outcomes.add(env.tasks[i], episode[i], bool(result.success[row]), obs.instructions[row], trace[i], last)
                trace[i], steps[i] = [], 0
                episode[i] += n
                if episode[i] >= cfg.episodes:
                    continue
                last = split_obs(env.reset([i], [mix_seed(seed, episode[i])]))[0]  # partial reset
            going.append((i, last))
        ids = [i for i, _ in going]
        if ids:
            obs = stack_obs([o for _, o in going])


def evaluate(
    loaded: LoadedSpec, runs_root: Path, episodes: int, keep_failed: int = 3, deterministic: bool = True
) -> Path:
    """Run `episodes` episodes in this process; write the result (`RunDir.eval`) and the failed trajectories
    (`Outcomes`)."""
    from vlaslurm.spec.plan import job_run_name

    cfg, spec = EvalConfig(episodes, keep_failed, deterministic), loaded.spec
    check_every_task_played(spec, episodes)
    directory = rundir.new_run_dir(runs_root, job_run_name(spec.name, "eval"))
    play(spec, directory, cfg, lambda env: build_policy(spec.model, **env_dims(env, spec.env)), str(loaded.path))
    return directory


def play(
    spec: ExperimentSpec,
    directory: Path,
    cfg: EvalConfig,
    make_policy: Callable[[VecEnv], Policy],
    spec_path: str,
) -> dict:
    """`cfg.episodes` episodes in this process of the policy `make_policy(env)` builds; the result in `directory`
    (`RunDir.eval`, returned; `spec_path` names the spec there) and its failed trajectories (`Outcomes`)."""
    env = make_env(spec.env, num_envs=min(spec.env.num_envs, cfg.episodes), rank=0, seed=spec.rollout.seed)
    outcomes = Outcomes(directory, cfg.keep_failed)
    try:
        policy = make_policy(env).eval()
        act = local_act(policy, cfg, spec.rollout.seed)
        to_env = env_action_transform(spec.model)
        run_episodes(
            env, 0, spec.env.num_envs, cfg, spec.rollout.seed, act, outcomes, to_env, spec.model.execute_actions
        )
    finally:
        env.close()
    return write_summary(directory, spec_path, cfg, [outcomes.to_json()])


def local_act(policy, cfg: EvalConfig, seed: int) -> Act:
    """Actions from `policy` in this process (`--local`); a job's simulators ask their generator instead."""

    def act(obs: Observation, decision: Decision) -> np.ndarray:
        inp = PolicyInput(
            _tensor(obs.images),
            _tensor(obs.state),
            obs.instructions,
            torch.tensor(decision.seeds(seed), dtype=torch.int64),
        )
        with torch.no_grad():
            return policy.act(inp, deterministic=cfg.deterministic).actions.float().numpy()

    return act


def write_summary(directory: Path, spec_path: str, cfg: EvalConfig, parts: List[Dict[str, Dict[str, bool]]]) -> dict:
    """Merge the outcomes of every simulator rank into the result (`RunDir.eval`): success and episodes per task, and
    each episode's success (`outcomes`, by task and episode number)."""
    merged: Dict[str, Dict[str, bool]] = defaultdict(dict)
    for part in parts:
        for task, eps in part.items():
            merged[task].update(eps)
    outcomes = {task: dict(sorted(eps.items(), key=lambda kv: int(kv[0]))) for task, eps in sorted(merged.items())}
    summary = {
        "spec": spec_path,
        "episodes": sum(map(len, outcomes.values())),
        "deterministic": cfg.deterministic,
        "success": {t: float(np.mean(list(v.values()))) for t, v in outcomes.items()},
        "episodes_per_task": {t: len(v) for t, v in outcomes.items()},
        "outcomes": outcomes,
    }
    write_atomic(RunDir(directory).eval, json.dumps(summary, indent=2).encode(), mode=0o644)
    return summary


def _tensor(array):
    return None if array is None else torch.from_numpy(np.ascontiguousarray(array))


def _save_failed(directory: Path, task: str, index: int, episode: int, instruction: str, steps: list) -> None:
    path = RunDir(directory).failed_trajectory(task, index)
    path.parent.mkdir(exist_ok=True)
    states = [s[0] for s in steps if s[0] is not None]
    np.savez_compressed(
        path,
        actions=np.stack([s[1] for s in steps]),
        states=np.stack(states) if states else np.zeros(0),
        instruction=np.asarray(instruction),
        episode=np.asarray(episode),
    )


# --- an eval job's ranks ----------------------------------------------------------------------------


def main(argv=None) -> int:
    """Entry point of an eval job's ranks: `python -m vlaslurm.runtime.evaluate --role R --run-dir D ...`
    (rendered by `vlaslurm eval`; the same start as `vlaslurm.runtime.worker`, then the eval roles)."""
    from vlaslurm.runtime import signals, worker

    assert main.__doc__ is not None  # the docstring above
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=sorted(EVAL_ROLES))
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--rank-log", action="store_true", help="append output to <run-dir>/logs/<role>/<rank>.log")
    parser.add_argument("--episodes", type=int, required=True)
    parser.add_argument("--keep-failed", type=int, default=3)
    parser.add_argument("--sample", action="store_true", help="sample actions instead of the mean")
    args = parser.parse_args(argv)
    signals.install(drain_on_term=False)  # USR2 never kills a rank; TERM ends it (nothing to save)
    rank = rank_from_env()
    if args.rank_log:
        worker.append_output_to(RunDir(args.run_dir).log(args.role, rank))
    worker.log_start_line(args.role, rank)
    try:
        spec = run_spec(args.run_dir)
        cfg = EvalRankConfig.from_spec(spec, EvalConfig(args.episodes, args.keep_failed, not args.sample))
        return EVAL_ROLES[args.role](make_context(args.role, args.run_dir, spec.runtime), cfg)
    except Exception as exc:  # noqa: BLE001 - the last word of a rank must reach its log
        log.error("eval %s failed: %s\n%s", args.role, exc, traceback.format_exc())
        return 1


def simulate(ctx: RankContext, cfg: EvalRankConfig) -> int:
    """A simulator rank of an eval job: its environments' episodes, with actions from its generator;
    rank 0 then merges every rank's outcomes into the result (`RunDir.eval`)."""
    from vlaslurm.envs import preflight

    sims = ctx.info.ranks["simulator"]
    local = cfg.env.num_envs // sims
    if report := preflight.check_once_per_node(cfg.env, ctx.rank):
        log.info("%s", report.text())
    env = make_env(cfg.env, num_envs=local, rank=ctx.rank, seed=cfg.seed)
    meet(ctx, ports={}, extra=env_dims(env, cfg.env), roles=())  # no torch.distributed world: nothing to sync
    outcomes = Outcomes(ctx.run_dir, cfg.eval.keep_failed, first_index=ctx.rank * cfg.eval.keep_failed)
    client = _GeneratorClient(ctx, outcomes, cfg.seed, cfg.max_frame_bytes)
    try:
        to_env = env_action_transform(cfg.model)  # the generator serves the policy's own actions
        executed = cfg.model.execute_actions
        run_episodes(
            env, ctx.rank * local, cfg.env.num_envs, cfg.eval, cfg.seed, client.act, outcomes, to_env, executed
        )
        client.done()
    finally:
        env.close()
        client.close()
    write_atomic(_part(ctx.run_dir, ctx.rank), json.dumps(outcomes.to_json()).encode(), mode=0o644)
    log.info("finished %d episodes", sum(map(len, outcomes.success.values())))
    if ctx.rank == 0:
        summary = write_summary(ctx.run_dir, ctx.info.spec_path, cfg.eval, _gather_parts(ctx, sims))
        log.info("success per task: %s", summary["success"])
    return 0


class _GeneratorClient:
    """A simulator rank's line to its generator (rank % generators, as in the lock-step modes)."""

    def __init__(self, ctx: RankContext, outcomes: Outcomes, seed: int, max_frame_bytes: int) -> None:
        self.ctx, self.outcomes, self.seed = ctx, outcomes, seed
        self.gen = ctx.rank % ctx.info.ranks["generator"]
        generator = ctx.member("generator", self.gen)
        self.dealer = Dealer(
            ctx.secret,
            identity=routing_id(f"simulator-{ctx.rank}"),  # unpredictable: nobody can take our replies
            **msgs.generator_channels(ctx.job_key, self.gen, generator.pid),
            name=f"obs->generator[{self.gen}]",
            accepts={msgs.ACT: msgs.decode_act},
            max_frame_bytes=max_frame_bytes,
        )
        self.dealer.connect(generator.endpoint("obs"))
        self.heartbeat = Heartbeat(ctx.run_dir, "simulator", ctx.rank)
        self.counters = Counters(ctx.run_dir, "simulator", ctx.rank)
        self.counters.gauge(lambda: rejection_counts(self.dealer))
        self.answered = False  # the first answer waits for the generator to load its policy

    def act(self, obs: Observation, decision: Decision) -> np.ndarray:
        req = msgs.ObsRequest(
            decision.gids,
            decision.episodes,
            decision.steps,
            decision.seeds(self.seed),
            obs,
            sub_group=0,
            min_version=0,
            sim_rank=self.ctx.rank,
        )
        self.dealer.send(msgs.encode_obs(req))
        limit = self.ctx.deadlines.running_s if self.answered else self.ctx.deadlines.first_s
        end = time.monotonic() + limit
        while (msg := self.dealer.recv(100)) is None or msg.kind != msgs.ACT:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"simulator[{self.ctx.rank}]: generator[{self.gen}] sent no actions for {limit:g} s "
                    f"(host {self.ctx.member('generator', self.gen).host})"
                )
        self.answered = True
        self.heartbeat.beat(0, f"episodes={sum(map(len, self.outcomes.success.values()))}")
        self.counters.maybe_write()
        return msgs.decode_act(msg).actions

    def done(self) -> None:
        self.dealer.send(msgs.sim_done(self.ctx.rank, 0, 0))
        self.heartbeat.beat(0, "finished", force=True)

    def close(self) -> None:
        self.counters.maybe_write(force=True)
        self.dealer.close()  # lingers long enough to deliver `done`


def _part(run_dir: Path, rank: int) -> Path:
    path = RunDir(run_dir).eval_part(rank)
    path.parent.mkdir(exist_ok=True)
    return path


def _gather_parts(ctx: RankContext, sims: int) -> List[dict]:
    """Every simulator rank's outcomes; ranks still missing whose heartbeat stops for runtime.timeout_s are named."""
    started = time.time()
    while True:
        missing = [r for r in range(sims) if not _part(ctx.run_dir, r).exists()]
        if not missing:
            return [json.loads(_part(ctx.run_dir, r).read_text()) for r in range(sims)]
        beats = [RunDir(ctx.run_dir).heartbeat("simulator", r) for r in missing]
        silent = [
            r
            for r, b in zip(missing, beats)
            if time.time() - (b.stat().st_mtime if b.exists() else started) > ctx.deadlines.running_s
        ]
        if silent:
            names = ", ".join(f"simulator[{r}]" for r in silent)
            raise TimeoutError(
                f"simulator[0]: {names} wrote no outcomes and no heartbeat for {ctx.deadlines.running_s:g} s"
            )
        time.sleep(0.5)


def serve(ctx: RankContext, cfg: EvalRankConfig) -> int:
    """A generator rank of an eval job: `model.path` frozen (version 0) for its simulators, until each says done."""
    from vlaslurm.runtime.roles.generator import Batcher, Pending

    router = Router(
        ctx.secret,
        **msgs.generator_channels(ctx.job_key, ctx.rank, os.getpid()),  # the pid its rendezvous file names
        name=f"generator[{ctx.rank}]",
        accepts=msgs.EVAL_GENERATOR_INTAKE,
        max_frame_bytes=cfg.max_frame_bytes,
    )
    router.bind(ctx.address)
    meet(ctx, ports={"obs": router.port}, roles=())
    policy = build_policy(cfg.model, **ctx.member("simulator", 0).extra).to(ctx.device).eval()
    batching = cfg.batching
    schedule = Sync(max_batch=batching.max_batch, max_wait_s=batching.max_wait_ms / 1000.0)  # route by rank
    clients = schedule.clients(ctx.rank, ctx.info.ranks["simulator"], ctx.info.ranks["generator"])
    batcher = Batcher(schedule, clients)
    heartbeat = Heartbeat(ctx.run_dir, "generator", ctx.rank)
    counters = Counters(ctx.run_dir, "generator", ctx.rank)
    counters.gauge(lambda: rejection_counts(router))
    done: set = set()
    served, heard, limit = 0, time.monotonic(), ctx.deadlines.first_s
    try:
        while len(done) < clients:
            got = router.recv(int(min(batcher.wait_s(0, time.monotonic()), 0.05) * 1000))
            if got is not None:
                heard, limit = time.monotonic(), ctx.deadlines.running_s
                peer, msg = got
                if msg.kind == msgs.SIM_DONE:  # the socket takes only these two kinds, checked
                    done.add(msgs.decode_sim_done(msg)[0])
                else:
                    batcher.pending.append(Pending(peer, msgs.decode_obs(msg), time.monotonic()))
            elif time.monotonic() - heard > limit:
                raise TimeoutError(
                    f"generator[{ctx.rank}]: {clients - len(done)} of its simulators sent nothing for "
                    f"{limit:g} s (done: {sorted(done)})"
                )
            if batcher.ready(0, time.monotonic()):
                served += _serve_batch(ctx, policy, batcher.take(0), router, cfg.eval)
            heartbeat.beat(0, f"served={served}")
            counters.maybe_write()
    finally:
        counters.maybe_write(force=True)
        router.close()
    heartbeat.beat(0, f"finished served={served}", force=True)
    log.info("served %d decisions of a frozen %s", served, cfg.model.type)
    return 0


def _serve_batch(ctx: RankContext, policy, batch: list, router: Router, cfg: EvalConfig) -> int:
    """One forward for every request of `batch`; each simulator gets its rows back."""
    from vlaslurm.runtime.roles.generator import replies, to_policy_input

    requests = [p.request for p in batch]
    with torch.no_grad():
        out = policy.act(to_policy_input(requests, ctx.device), deterministic=cfg.deterministic)
    actions = out.actions.float().cpu().numpy()
    unused = np.zeros(len(actions), np.float32)  # log-probs and values matter to a trainer only
    for p, reply in replies(batch, 0, ctx.rank, actions, unused, unused):
        router.send(p.peer, msgs.encode_act(reply))
    return len(actions)


EVAL_ROLES: Dict[str, Callable[[RankContext, EvalRankConfig], int]] = {"simulator": simulate, "generator": serve}

if __name__ == "__main__":
    sys.exit(main())
