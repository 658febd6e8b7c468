"""Learners: turn a TrainBatch into one policy update, one class per `algo.type` in `LEARNERS`.

Data parallel: every trainer rank owns whole segments of the batch, holds only their observations, takes the
decision steps of each minibatch in them and scales its loss so that the summed gradients equal one rank's update
on the whole batch (`DataParallel`). A minibatch's unit is a decision step; `algo.logprob_level` sets the ratio per
chunk, action or token (action dimension).
Details: docs/algorithms.md
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vlaslurm.algos.batch import TrainBatch, episode_layout
from vlaslurm.algos.gae import action_level_gae, chunk_rewards, compute_gae, expand_chunk
from vlaslurm.algos.grpo import group_advantages, group_advantages_per_step, reward_to_go, success_filter_mask
from vlaslurm.algos.offpolicy import policy_loss, vtrace_traces
from vlaslurm.algos.ppo import entropy_at_level, explained_variance, kl_k3, masked_mean, value_errors
from vlaslurm.algos.reference import FrozenReference
from vlaslurm.spec.algo_types import GRPO_ADVANTAGES, AlgoConfig, GRPOConfig, PPOConfig, SyntheticAlgoConfig
from vlaslurm.spec.registry import Registry
from vlaslurm.spec.trainer_types import OptimizerConfig, TrainerSpec

if TYPE_CHECKING:
    from vlaslurm.models.base import Policy

Stats = Dict[str, List[float]]
VALUE_HEAD = "value_head."  # the critic's parameters in every policy that has one (its own learning rate)


class Learner(Protocol):
    def update(self, batch: TrainBatch, version: int) -> Dict[str, float]:
        """One policy update on `batch` (every data-parallel rank calls it with the same batch)."""


# The learner class of each algo.type (its config class is registered in vlaslurm/spec/algo_types.py),
# built as `cls(cfg, policy, dp, seed, trainer)` (trainer: the spec's `trainer:` section).
LEARNERS: Registry[Callable[..., Learner]] = Registry("algo", "learner")


class DataParallel:
    """This rank's place among the trainer ranks (a no-op with one rank).

    Each rank owns whole rows (segments) of a batch (`owners`): it holds only their observations
    (`TrainBatch.held`), evaluates them before an update, and takes of every minibatch the decision steps in them;
    its loss is its part of the minibatch mean, so the summed gradients equal one rank's update on the whole batch.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def owners(self, lengths: Tensor) -> Tensor:
        """[N] the rank owning each row: rows by descending length dealt round-robin, so that the ranks' decision
        steps about balance; a function of the lengths alone, which every rank has."""
        order = torch.sort(lengths.cpu(), descending=True, stable=True).indices
        out = torch.empty_like(order)
        out[order] = torch.arange(len(order)) % self.size
        return out.to(lengths.device)

    def held_rows(self, lengths: Tensor, rank: Optional[int] = None) -> Tensor:
        """The rows whose observations `rank` (default: this one) holds: those it owns; one that owns none (fewer
        rows than ranks) holds one spare row, for the forwards a sharded rank must join without data of its own."""
        rank = self.rank if rank is None else rank
        owned = (self.owners(lengths.cpu()) == rank).nonzero()[:, 0]
        return owned if len(owned) or not len(lengths) else torch.tensor([rank % len(lengths)])

    def shares(self, owner: Tensor) -> List[int]:
        """How many of the entries owned as `owner` says each rank has."""
        return torch.bincount(owner.cpu(), minlength=self.size).tolist()

    def micro_batches(self, mine: Tensor, shares: List[int], size: Optional[int]) -> List[Tensor]:
        """This rank's entries of a minibatch (`mine`, of the ranks' `shares`) in micro-batches of at most `size`."""
        count = 0 if not len(mine) else 1 if size is None else math.ceil(len(mine) / size)
        return list(mine.tensor_split(count)) if count else []

    def sync_buffers(self, module: nn.Module) -> None:
        """Give every rank the first rank's buffers: rank 0 alone sets run-level state such as a scheduled
        std's progress (`set_std_progress`), and the others must evaluate the same distribution."""
        if self.size == 1:
            return
        for buffer in module.buffers():
            dist.broadcast(buffer, group=self.group, group_src=0)

    def sum_grads(self, params: List[nn.Parameter]) -> None:
        if self.size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)

    def spread(self, owner: Tensor, chunk: int, spare: Tensor) -> List[Tensor]:
        """This rank's chunks of `chunk` of the entries it owns (`owner[i] == rank`) whose results every rank needs
        (`gather`); as many chunks on every rank (with fsdp each forward is a collective): a rank short of one
        repeats its first chunk, or evaluates `spare` (an entry of its spare row), whose results `gather` drops."""
        owned = (owner == self.rank).nonzero()[:, 0]
        mine = list(owned.split(chunk)) if len(owned) else []  # an empty tensor splits into one empty chunk
        per = max(math.ceil(n / chunk) for n in self.shares(owner))
        return mine + [mine[0] if mine else spare] * (per - len(mine))

    def gather(self, mine: List[Tensor], owner: Tensor) -> Tensor:
        """Every entry's result, in entry order ([len(owner), ...]), from each rank's results of its `spread`."""
        results = torch.cat(mine)
        if self.size == 1:
            return results[: len(owner)]
        shares = self.shares(owner)
        padded = results.new_zeros((max(shares), *results.shape[1:]))
        padded[: shares[self.rank]] = results[: shares[self.rank]]
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        out = results.new_empty((len(owner), *results.shape[1:]))
        for rank, part in enumerate(parts):
            out[owner == rank] = part[: shares[rank]]
        return out


def behaviour_key(level: str) -> str:
    """The batch tensor holding the behaviour log-probs a ratio at `algo.logprob_level` compares with."""
    return "token_logprob" if level == "token" else "logprob"


def _given(value: Optional[Tensor], field: str, what: str, instead: str) -> Tensor:
    if value is None:
        raise ValueError(f"{field} needs {what}, which this policy does not give; use {instead}")
    return value


def token_logprob(logprob: Optional[Tensor]) -> Tensor:
    return _given(logprob, "algo.logprob_level 'token'", "per-token log-probs", "logprob_level: action")


def slot_values(values: Optional[Tensor]) -> Tensor:
    return _given(values, "algo.value_level 'action'", "a value per action slot", "value_level: chunk")


# Observations evaluated per forward before an update, unless `trainer.micro_batch_size` bounds the activations.
EVAL_CHUNK = 512


@torch.no_grad()
def evaluate_all(
    policy: nn.Module,
    batch: TrainBatch,
    values: bool,
    dp: Optional[DataParallel] = None,
    chunk: int = EVAL_CHUNK,
    tokens: bool = False,
    slots: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Under the current parameters: values of all T+1 observations ([N, T+1], zeros unless `values`; with
    `slots` a value per action slot, [N, T+1, C]) and the proximal log-probs of the stored actions ([N, T, C],
    or [N, T, C, A] per token with `tokens`), the trust region's centre. With several trainer ranks (`dp`) each
    evaluates its share of the observations and every rank gets all the results."""
    t = batch.tensors
    n, T = t["step_valid"].shape
    shape = (n, T + 1, t["mask"].shape[2]) if slots else (n, T + 1)  # [N, T+1, C] with a value per action slot
    out_values = torch.zeros(shape, device=t["actions"].device)
    key = behaviour_key("token" if tokens else "action")
    if key not in t:
        token_logprob(None)  # the segments carry no per-token log-probs: raises, saying what to change
    prox = torch.zeros_like(t[key])
    last = T + 1 if values else T
    obs_valid = torch.arange(last, device=out_values.device)[None] <= t["length"][:, None] - (0 if values else 1)
    rows, cols = obs_valid.nonzero(as_tuple=True)
    if not len(rows):
        return out_values, prox
    dp = dp or DataParallel(None, 0, 1)
    owner = dp.owners(t["length"])[rows]
    spare = ((rows == dp.held_rows(t["length"])[0].to(rows.device)) & (cols == 0)).nonzero()[0]  # a first observation
    found: List[Tuple[Tensor, Tensor]] = []
    for part in dp.spread(owner, chunk, spare):
        r, c = rows[part], cols[part]
        out = cast("Policy", policy).evaluate(batch.policy_input(r, c), t["actions"][r, c.clamp(max=T - 1)])
        logprob = token_logprob(out.token_logprob) if tokens else out.logprob
        found.append(((slot_values(out.slot_value) if slots else out.value).float(), logprob.float()))
    if values:
        out_values[rows, cols] = dp.gather([v for v, _ in found], owner)
    acting = cols < t["length"][rows]  # the last observation of a segment only bootstraps its value
    prox[rows[acting], cols[acting]] = dp.gather([lp for _, lp in found], owner)[acting]
    return out_values, prox


@dataclass(frozen=True)
class MinibatchCounts:
    """Counts of the whole minibatch (all ranks), so that every shard's and micro-batch's losses add up to the
    minibatch mean: decision steps, executed actions, ratios at the logprob level, entropies at the entropy
    level."""

    steps: int
    actions: int
    ratios: int
    entropy_units: int  # tokens, executed actions or chunks at algo.entropy_level


def _entropy_units(t: Dict[str, Tensor], rows: Tensor, cols: Tensor, level: str) -> int:
    """How many entropies the minibatch's bonus averages at `algo.entropy_level`."""
    executed = int(t["mask"][rows, cols].sum())
    return len(rows) if level == "chunk" else executed * (t["actions"].shape[-1] if level == "token" else 1)


class PolicyStep:
    """One optimiser step of a clipped policy-gradient loss on a minibatch of decision steps, shared by
    PPO and GRPO: the ratio at `algo.logprob_level`, the off-policy correction, the entropy bonus at
    `algo.entropy_level`, the KL penalty to the frozen initial policy (`algo.kl_coef`, k3 per ratio), an
    optional extra term (PPO's value loss), data-parallel loss scaling, gradient accumulation over
    `trainer.micro_batch_size` and the gradient sum."""

    def __init__(
        self,
        cfg: AlgoConfig,
        policy: nn.Module,
        dp: DataParallel,
        entropy_coef: float,
        trainer: Optional[TrainerSpec] = None,
    ) -> None:
        self.cfg, self.policy, self.dp, self.entropy_coef = cfg, policy, dp, entropy_coef
        self.trainer = trainer or TrainerSpec()
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # Before any update: the reference is the initial policy (on resume too, built before the checkpoint loads).
        self.reference = FrozenReference(policy) if cfg.kl_coef > 0 else None
        self.opt = make_optimizer(policy, cfg.lr, self.trainer.optimizer)

    @property
    def eval_chunk(self) -> int:
        """Observations per forward of `evaluate_all`: no more than a micro-batch's decision steps, when set."""
        return self.trainer.micro_batch_size or EVAL_CHUNK

    def reference_logprobs(self, batch: TrainBatch) -> Optional[Tensor]:
        """The frozen reference's log-probs of the stored actions ([N, T, C], or [N, T, C, A] at token level);
        None without a KL penalty."""
        if self.reference is None:
            return None
        with self.reference.swapped():
            tokens = self.cfg.logprob_level == "token"
            return evaluate_all(self.policy, batch, False, self.dp, self.eval_chunk, tokens=tokens)[1]

    def epochs(
        self, batch: TrainBatch, used: Tensor, adv: Tensor, prox: Tensor, seed: int, extra: Optional[Extra] = None
    ) -> Dict[str, float]:
        """`algo.epochs` passes over the decision steps `used` [N, T], each in shuffled minibatches (as many per
        sample whatever the batch's size, `minibatch_count`; the shuffle seeded by `seed`); the mean statistics."""
        rows, cols = used.nonzero(as_tuple=True)
        gen = torch.Generator().manual_seed(seed)
        stats: Stats = {}
        ref = self.reference_logprobs(batch)
        count = minibatch_count(self.cfg, used_env_steps(batch.tensors, used))
        for _ in range(self.cfg.epochs):
            for mb in _minibatches(len(rows), count, gen):
                self(batch, rows[mb], cols[mb], adv, prox, stats, extra, ref)
        return _mean_stats(stats)

    def __call__(
        self,
        batch: TrainBatch,
        rows: Tensor,
        cols: Tensor,
        adv: Tensor,
        prox: Tensor,
        stats: Stats,
        extra: Optional[Extra] = None,
        ref: Optional[Tensor] = None,
    ) -> None:
        """`adv` [N, T] per decision step, or [N, T, C] per action; `extra(out, rows, cols, counts)` returns an extra
        loss term (PPO's value loss) already divided by the minibatch's counts; `ref` the reference's log-probs
        (`reference_logprobs`) when `algo.kl_coef` > 0."""
        t = batch.tensors
        level = self.cfg.logprob_level
        n_actions = int(t["mask"][rows, cols].sum())
        per_action = t["actions"].shape[-1] if level == "token" else 1
        counts = MinibatchCounts(
            len(rows),
            n_actions,
            len(rows) if level == "chunk" else n_actions * per_action,
            _entropy_units(t, rows, cols, self.cfg.entropy_level),
        )
        owner = self.dp.owners(t["length"])[rows]
        mine = (owner == self.dp.rank).nonzero()[:, 0]
        self.opt.zero_grad(set_to_none=True)
        parts: List[Tuple[float, float, Dict[str, Tensor]]] = []
        for micro in self.dp.micro_batches(mine, self.dp.shares(owner), self.trainer.micro_batch_size):
            if not len(micro):  # a sharded rank without data joins the backward's collectives with a zero loss
                first = self.dp.held_rows(t["length"])[:1].to(rows.device)
                loss = self._loss(batch, first, torch.zeros_like(first), adv, prox, counts, extra, ref)[0]
                (loss * 0.0).backward()
                continue
            loss, weights, part = self._loss(batch, rows[micro], cols[micro], adv, prox, counts, extra, ref)
            loss.backward()  # gradients accumulate: each micro-batch's loss is its share of the minibatch mean
            parts.append((*weights, part))
        self.dp.sum_grads(self.params)
        nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.opt.step()
        for key, value in _weighted_stats(parts).items():
            stats.setdefault(key, []).append(value)

    def _loss(
        self,
        batch: TrainBatch,
        rows: Tensor,
        cols: Tensor,
        adv: Tensor,
        prox: Tensor,
        counts: MinibatchCounts,
        extra: Optional[Extra],
        ref: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tuple[float, float], Dict[str, Tensor]]:
        """(this micro-batch's share of the minibatch loss, its weights in the shard's statistics, statistics)."""
        t = batch.tensors
        level = self.cfg.logprob_level
        out = cast("Policy", self.policy).evaluate(batch.policy_input(rows, cols), t["actions"][rows, cols])
        mask = t["mask"][rows, cols]
        a = adv[rows, cols]
        behaviour, proximal = t[behaviour_key(level)][rows, cols], prox[rows, cols]
        if level == "chunk":

            def chunk_sum(x: Tensor) -> Tensor:
                return torch.where(mask, x, torch.zeros_like(x)).sum(-1)

            new, old, proximal, lmask = chunk_sum(out.logprob), chunk_sum(behaviour), chunk_sum(proximal), None
            reference = None if ref is None else chunk_sum(ref[rows, cols])
            local = len(rows)
        elif level == "action":  # one ratio per executed action
            new, old, lmask = out.logprob, behaviour, mask
            a = expand_chunk(a, mask.shape[-1]) if a.ndim == 1 else a  # a chunk's advantage, or each action's
            reference = None if ref is None else ref[rows, cols]
            local = int(mask.sum())
        else:  # token: one ratio per action dimension of each executed action
            new, old = token_logprob(out.token_logprob), behaviour
            lmask = mask[..., None].expand_as(new)
            a = (expand_chunk(a, mask.shape[-1]) if a.ndim == 1 else a)[..., None].expand_as(new)
            reference = None if ref is None else ref[rows, cols]
            local = int(lmask.sum())
        pg, pg_stats = policy_loss(
            new,
            proximal,
            old,
            a,
            self.cfg.clip[0],
            self.cfg.clip[1],
            self.cfg.offpolicy_correction,
            self.cfg.tis_cap,
            lmask,
            dual_clip=self.cfg.dual_clip,
            weight_cap=self.cfg.behaviour_weight_cap,
        )
        entropy, units = entropy_at_level(out.entropy, mask, self.cfg.entropy_level, t["actions"].shape[-1])
        # Means over this micro-batch -> its part of the minibatch mean (exact under data parallelism).
        share, entropy_share = local / max(counts.ratios, 1), units / max(counts.entropy_units, 1)
        loss = pg * share - self.entropy_coef * entropy * entropy_share
        stats = {**pg_stats, "losses/entropy": entropy.detach()}
        if reference is not None:  # k3 per ratio, a mean over the same ratios as the policy loss
            kl = masked_mean(kl_k3(new, reference), lmask)
            loss = loss + self.cfg.kl_coef * kl * share
            stats["losses/ref_kl"] = kl.detach()
        if extra is not None:
            term, term_stats = extra(out, rows, cols, counts)
            loss = loss + term
            stats.update(term_stats)
        return loss, (float(local), float(units)), stats


# PPO's value loss: (the policy's outputs, rows, cols, the minibatch's counts) -> (its share of the minibatch mean,
# its statistics over these rows).
Extra = Callable[[Any, Tensor, Tensor, MinibatchCounts], Tuple[Tensor, Dict[str, Tensor]]]


def make_optimizer(policy: nn.Module, lr: float, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; the value head in its own group when `value_lr` is set."""
    named = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
    value = [p for name, p in named if name.startswith(VALUE_HEAD)]
    groups: List[Dict[str, Any]]
    if cfg.value_lr is None or not value:
        groups = [{"params": [p for _, p in named]}]
    else:
        groups = [
            {"params": [p for name, p in named if not name.startswith(VALUE_HEAD)]},
            {"params": value, "lr": cfg.value_lr},
        ]
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def _weighted_stats(parts: List[Tuple[float, float, Dict[str, Tensor]]]) -> Dict[str, float]:
    """The shard's statistics from its micro-batches': ratio statistics weighted by their ratios, the entropy by
    its units at the entropy level (with one micro-batch, exactly that micro-batch's values)."""
    out: Dict[str, float] = {}
    for key in parts[0][2] if parts else ():
        entropy = key == "losses/entropy"
        weights = [p[1] if entropy else p[0] for p in parts]
        total = sum(weights)
        values = [float(p[2][key]) for p in parts]
        out[key] = sum(w * v for w, v in zip(weights, values)) / total if total else values[0]
    return out


def ratios_per_step(t: Dict[str, Tensor], level: str) -> Tensor:
    """[N, T] how many ratios each decision step contributes at `level`: 1, its executed actions, or those
    times the action's dimensions (tokens)."""
    if level == "chunk":
        return torch.ones_like(t["mask"][..., 0], dtype=torch.float32)
    executed = t["mask"].sum(-1).float()
    return executed * t["actions"].shape[-1] if level == "token" else executed


def normalised(adv: Tensor, scored: Tensor) -> Tensor:
    """Advantages centred and scaled over the scored entries; one entry (a tiny async batch) is only centred,
    since its spread is undefined (a NaN here would reach every parameter)."""
    values = adv[scored]
    if len(values) < 2:
        return adv - values.mean() if len(values) else adv
    return (adv - values.mean()) / (values.std() + 1e-8)


def _shuffle_seed(seed: int, version: int) -> int:
    """The minibatch shuffle's seed of the update at policy `version` (the same in a resumed run)."""
    return seed * 100003 + version


def _minibatches(n: int, count: int, gen: torch.Generator) -> List[Tensor]:
    return [mb for mb in torch.randperm(n, generator=gen).chunk(count) if len(mb)]


def minibatch_count(cfg: AlgoConfig, env_steps: int) -> int:
    """Minibatches per pass over a batch of `env_steps` used env steps: `algo.minibatches` per `steps_per_update`,
    so that a larger batch (async GRPO's: whole groups, and every group the next update could no longer use,
    up to twice the size) takes as many optimizer steps per sample as sync's. With a fixed count, async GRPO
    made a third fewer optimizer steps per env step than sync (48 updates in 140k env steps against 74)."""
    return max(cfg.minibatches, round(cfg.minibatches * env_steps / cfg.steps_per_update))


def used_env_steps(t: Dict[str, Tensor], used: Tensor) -> int:
    """Env steps (executed actions) of the decision steps `used` [N, T]."""
    return int((t["mask"] & used[..., None]).sum())


def _mean_stats(stats: Stats) -> Dict[str, float]:
    return {k: sum(v) / len(v) for k, v in stats.items()}


@LEARNERS.register("ppo")
class PPOLearner:
    """PPO with chunk-level GAE, a shared-backbone value head, and decoupled-PPO / truncated-IS
    correction for stale samples. Advantages are normalised over the whole batch."""

    def __init__(
        self, cfg: PPOConfig, policy: nn.Module, dp: DataParallel, seed: int, trainer: Optional[TrainerSpec] = None
    ) -> None:
        if cfg.value_level == "action" and cfg.logprob_level == "chunk":
            raise ValueError("algo.value_level 'action' gives each action its own advantage: use logprob_level action")
        self.cfg, self.policy, self.dp, self.seed = cfg, policy, dp, seed
        self.step = PolicyStep(cfg, policy, dp, cfg.entropy_coef, trainer)
        self.opt = self.step.opt  # checkpoints save and restore it

    def advantages(self, batch: TrainBatch, values: Tensor, prox: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """GAE over each segment, bootstrapped from the last observation unless terminated: per decision step
        ([N, T], `values` [N, T+1]) or per executed action (value_level: action, `values` [N, T+1, C]); with
        `prox` (the proximal log-probs) and `algo.gae_traces: vtrace`, V-trace's traces of the stored actions."""
        t = batch.tensors
        n, T = t["step_valid"].shape
        last = torch.zeros(n, T, dtype=torch.bool, device=values.device)
        last[torch.arange(n), t["length"] - 1] = True
        padded = ~t["step_valid"]
        terminated = (last & t["terminated"][:, None]) | padded
        truncated = last & ~t["terminated"][:, None]
        rewards = t["rewards"] * self.cfg.reward_scale
        executed = t["mask"] & t["step_valid"][..., None]
        traces = None
        if prox is not None and self.cfg.gae_traces == "vtrace":
            behaviour = t[behaviour_key(self.cfg.logprob_level)]
            traces = vtrace_traces(prox, behaviour, executed, per_action=self.cfg.value_level == "action")
        if self.cfg.value_level == "action":
            mask = executed
            adv, ret = action_level_gae(
                rewards.transpose(0, 1),
                values[:, :T].transpose(0, 1),
                values[:, 1:, 0].T,  # after a chunk: the next observation's value before its first action
                mask.transpose(0, 1),
                terminated.T,
                truncated.T,
                self.cfg.gamma,
                self.cfg.gae_lambda,
                None if traces is None else traces.transpose(0, 1),
            )
            return adv.transpose(0, 1), ret.transpose(0, 1)
        reward, discount = chunk_rewards(rewards, t["mask"], self.cfg.gamma)
        adv, ret = compute_gae(
            reward.T,
            values[:, :T].T,
            values[:, 1:].T,
            terminated.T,
            truncated.T,
            discount.T,
            self.cfg.gae_lambda,
            None if traces is None else traces.T,
        )
        return adv.T, ret.T

    def update(self, batch: TrainBatch, version: int) -> Dict[str, float]:
        self.dp.sync_buffers(self.policy)
        t = batch.tensors
        per_action = self.cfg.value_level == "action"
        tokens = self.cfg.logprob_level == "token"
        values, prox = evaluate_all(self.policy, batch, True, self.dp, self.step.eval_chunk, tokens, per_action)
        adv, ret = self.advantages(batch, values, prox)
        valid = t["step_valid"]
        scored = t["mask"] & valid[..., None] if per_action else valid  # where an advantage exists
        adv = normalised(adv, scored)
        cfg = self.cfg
        huber = cfg.huber_delta if cfg.value_loss == "huber" else None

        def value_term(out, r: Tensor, c: Tensor, counts: MinibatchCounts) -> Tuple[Tensor, Dict[str, Tensor]]:
            # against the values before this update (the clip's centre)
            if per_action:  # each executed action's value against its own return
                executed = t["mask"][r, c]
                new = slot_values(out.slot_value)
                err = value_errors(new, ret[r, c], values[r, c], cfg.value_clip, huber)[executed]
                total = counts.actions
            else:
                err = value_errors(out.value, ret[r, c], values[r, c], cfg.value_clip, huber)
                total = counts.steps
            value_loss = err.detach().mean() if len(err) else err.new_zeros(())
            return self.cfg.value_coef * err.sum() / max(total, 1), {"losses/value_loss": value_loss}

        out = self.step.epochs(batch, valid, adv, prox, _shuffle_seed(self.seed, version), value_term)
        predicted = values[:, :-1][scored] if per_action else values[:, :-1][valid]
        out["losses/explained_variance"] = explained_variance(predicted, ret[scored])
        return out


@LEARNERS.register("grpo")
class GRPOLearner:
    """GRPO: no critic; advantages relative to the other rollouts of the same task and initial state.

    A group is the episodes that start from the same reset seed: those of environments
    `env_id // group_size` with the same episode number (the simulator seeds their resets alike).
    Only complete episodes of complete groups are used (a segment cut at the end of a sync phase,
    or a group one of whose segments was dropped as stale, is left out), and groups outside
    `algo.success_filter` are dropped. Advantages (`advantage`):

    - `episode` (the default, the paper's outcome reward): the episode return normalised within the
      group, for every chunk;
    - `chunk`: each chunk's reward normalised against the same chunk index of the group's other
      episodes still running (dense credit, for shaped rewards: with a sparse success reward the early
      chunks of a successful episode get no positive advantage);
    - `step`: the reward-to-go of those normalised chunk rewards (process-supervised GRPO).

    The loss of each trajectory is averaged over its valid actions (or chunks), then over
    trajectories: every episode weighs the same whatever its length.
    """

    def __init__(
        self, cfg: GRPOConfig, policy: nn.Module, dp: DataParallel, seed: int, trainer: Optional[TrainerSpec] = None
    ) -> None:
        if cfg.advantage not in GRPO_ADVANTAGES:
            raise ValueError(f"algo.advantage must be one of {', '.join(GRPO_ADVANTAGES)}, got {cfg.advantage!r}")
        self.cfg, self.policy, self.dp, self.seed, self.advantage = cfg, policy, dp, seed, cfg.advantage
        self.step = PolicyStep(cfg, policy, dp, cfg.entropy_coef, trainer)
        self.opt = self.step.opt

    def advantages(self, batch: TrainBatch) -> Tuple[Tensor, Tensor, Dict[str, float]]:
        """Per decision step: the advantage [N, T] and whether the step is used [N, T]."""
        t = batch.tensors
        lay = episode_layout(batch, self.cfg.group_size)
        rewards = t["rewards"] * self.cfg.reward_scale  # group normalisation undoes the scale but for its eps
        reward = torch.where(t["mask"], rewards, torch.zeros_like(rewards)).sum(-1)  # [N, T]
        E, L = lay.num_episodes, lay.max_chunks
        ep_reward = torch.zeros(E, L, dtype=reward.dtype, device=reward.device)
        ep_valid = torch.zeros(E, L, dtype=torch.bool, device=reward.device)
        rows, cols = t["step_valid"].nonzero(as_tuple=True)
        e, k = lay.episode[rows], lay.chunk[rows, cols]
        ep_reward[e, k] = reward[rows, cols]
        ep_valid[e, k] = True
        keep = lay.usable & success_filter_mask(lay.success, lay.group, *self.cfg.success_filter)
        ep_valid &= keep[:, None]
        if self.advantage == "episode":
            ep_adv = group_advantages(ep_reward.sum(-1), torch.where(keep, lay.group, -1))[:, None].expand(E, L)
        else:
            ep_adv = group_advantages_per_step(ep_reward, lay.group, ep_valid)
            if self.advantage == "step":
                ep_adv = reward_to_go(ep_adv, ep_valid)
        used = torch.zeros_like(t["step_valid"])
        used[rows, cols] = ep_valid[e, k]
        adv = torch.zeros_like(reward)
        adv[rows, cols] = ep_adv[e, k].to(adv.dtype)
        # Each trajectory's loss is a mean over its valid ratios: weight 1 / (its count), and every kept
        # episode weighs the same (the mean over ratios in the minibatch divides by their total count).
        per_step = ratios_per_step(t, self.cfg.logprob_level).to(adv.dtype)
        counts = torch.zeros(E, dtype=adv.dtype, device=adv.device).index_add_(
            0, lay.episode[rows], torch.where(used[rows, cols], per_step[rows, cols], torch.zeros_like(adv[rows, cols]))
        )
        kept = int((keep & (counts > 0)).sum())
        total = float(torch.where(used, per_step, torch.zeros_like(per_step)).sum())
        weight = torch.zeros_like(adv)
        weight[rows, cols] = total / (kept * counts[e].clamp(min=1)) if kept else 0.0
        info = {
            "grpo/groups": float(len(torch.unique(lay.group[lay.usable]))),
            "grpo/episodes_used": float(kept),
            "grpo/episodes_dropped": float(E - kept),
            "grpo/success_rate": (float(lay.success[lay.usable].float().mean()) if lay.usable.any() else float("nan")),
        }
        return adv * weight, used, info

    def update(self, batch: TrainBatch, version: int) -> Dict[str, float]:
        self.dp.sync_buffers(self.policy)
        adv, used, info = self.advantages(batch)
        if not used.any():
            return info
        tokens = self.cfg.logprob_level == "token"
        prox = (
            evaluate_all(self.policy, batch, False, self.dp, self.step.eval_chunk, tokens)[1]
            if self.cfg.offpolicy_correction == "decoupled"
            else batch.tensors[behaviour_key(self.cfg.logprob_level)]
        )
        return {**self.step.epochs(batch, used, adv, prox, _shuffle_seed(self.seed, version)), **info}


@LEARNERS.register("synthetic")
class SyntheticLearner:
    """Sleeps `update_ms` and nudges the weights, so every version is distinct."""

    def __init__(
        self,
        cfg: SyntheticAlgoConfig,
        policy: nn.Module,
        dp: DataParallel,
        seed: int,
        trainer: Optional[TrainerSpec] = None,
    ) -> None:
        self.cfg, self.policy = cfg, policy

    def update(self, batch: TrainBatch, version: int) -> Dict[str, float]:
        time.sleep(self.cfg.update_ms / 1000.0)
        with torch.no_grad():
            for p in self.policy.parameters():
                p.add_(1.0)
        return {}


def make_learner(
    cfg: AlgoConfig, policy: nn.Module, dp: DataParallel, seed: int, trainer: Optional[TrainerSpec] = None
) -> Learner:
    """The learner of `algo.type` (`LEARNERS`)."""
    return LEARNERS.get(cfg.type)(cfg, policy, dp, seed, trainer)
