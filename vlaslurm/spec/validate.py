"""Pass three of loading: rules that span fields, checked once at load.

A field's own choices are its `Literal` type, checked while typing (`loader.py`), not here."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable, Union, cast

from vlaslurm.spec.errors import close_names
from vlaslurm.spec.model_types import PI0PolicyConfig, VLAConfig, flow_problem
from vlaslurm.spec.schema import DEFAULT_RESTARTS, ROLES
from vlaslurm.spec.trainer_types import fsdp_problem

if TYPE_CHECKING:
    from vlaslurm.spec.algo_types import GRPOConfig
    from vlaslurm.spec.env_types import SyntheticEnvConfig
    from vlaslurm.spec.loader import LoadedSpec

# Patterns are used with fullmatch: `$` also matches before a final newline, which would reach the script.
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}")
_SLURM_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SBATCH_OPTION = re.compile(r"[a-z][a-z0-9-]*")
MAX_NAME = 100  # the name plus a timestamp and suffixes must stay under the file system's 255
# Sane upper bounds: a larger value is a typo (an extra digit), never a real job.
_MAXIMA = {
    **{f"resources.{role}.nodes": 10_000 for role in ROLES},
    **{f"resources.{role}.tasks_per_node": 1_024 for role in ROLES},
    **{f"resources.{role}.gpus_per_node": 64 for role in ROLES},
    **{f"resources.{role}.cpus_per_task": 4_096 for role in ROLES},
    **{f"resources.{role}.max_restarts": 1_000 for role in ROLES},
    "env.num_envs": 10_000_000,
    "env.max_episode_steps": 10_000_000,
    "rollout.total_env_steps": 10**15,
    "rollout.stop_window": 10_000,
    "rollout.pipeline_depth": 1_024,
    "rollout.batching.max_batch": 1_000_000,
    "model.action_chunk": 4_096,
    "model.action_dim": 4_096,
    "algo.epochs": 10_000,
    "algo.minibatches": 1_000_000,
    "checkpoint.keep": 10_000,
    "tracking.failures_per_task": 10_000,
}


def validate(loaded: LoadedSpec) -> None:
    """Raise the first SpecError found in `loaded`."""
    for check in (
        _check_name,
        _check_counts,
        _check_maxima,
        _check_env,
        _check_model,
        _check_pi0,
        _check_algo,
        _check_algo_knobs,
        _check_publish_every,
        _check_stop_at_success,
        _check_hold_budget,
        _check_reset_seeds,
        _check_resources,
        _check_mode_layout,
        _check_slurm,
        _check_tracking,
        _check_sharding,
        _check_periodic_eval,
    ):
        check(loaded)


def _positive(loaded: LoadedSpec, keys: Iterable[str], minimum: float = 1) -> None:
    for key in keys:
        value = _get(loaded.spec, key)
        if value < minimum:
            raise loaded.error(key, f"must be at least {minimum}, got {value}")


def _get(obj: object, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_maxima(loaded: LoadedSpec) -> None:
    for key, maximum in _MAXIMA.items():
        value = _get(loaded.spec, key)
        if value > maximum:
            raise loaded.error(key, f"must be at most {maximum}, got {value}")
    for role, count in loaded.spec.runtime.local_ranks.items():
        if count > 1_024:
            raise loaded.error(f"runtime.local_ranks.{role}", f"must be at most 1024 local ranks, got {count}")


def _check_name(loaded: LoadedSpec) -> None:
    # The name becomes a directory and a Slurm job name; keep it free of shell and path characters.
    if len(loaded.spec.name) > MAX_NAME:
        raise loaded.error("name", f"must be at most {MAX_NAME} characters, got {len(loaded.spec.name)}")
    if not _NAME.fullmatch(loaded.spec.name):
        raise loaded.error("name", "may contain only letters, digits, '.', '_' and '-' (it names folders and jobs)")


def _check_tracking(loaded: LoadedSpec) -> None:
    # MLflow refuses an empty experiment name only when the run starts (and the run then goes untracked).
    experiment = loaded.spec.tracking.experiment
    if not experiment.strip() or any(not c.isprintable() for c in experiment):
        raise loaded.error(
            "tracking.experiment", f"must be a printable, non-blank MLflow experiment name, got {experiment!r}"
        )


def _check_counts(loaded: LoadedSpec) -> None:
    _positive(
        loaded,
        [
            "env.num_envs",
            "env.max_episode_steps",
            "rollout.total_env_steps",
            "rollout.stop_window",
            "rollout.pipeline_depth",
            "rollout.batching.max_batch",
            "model.action_chunk",
            "model.action_dim",
            "algo.steps_per_update",
            "algo.epochs",
            "algo.minibatches",
            "checkpoint.every_versions",
            "checkpoint.keep",
        ],
    )
    _positive(
        loaded,
        ["rollout.max_staleness", "rollout.batching.max_wait_ms", "env.obs.image_size", "tracking.failures_per_task"],
        minimum=0,
    )
    _positive(loaded, ["runtime.first_meeting_timeout_s", "runtime.timeout_s"], minimum=1)
    if loaded.spec.algo.lr <= 0:
        raise loaded.error("algo.lr", f"must be greater than 0, got {loaded.spec.algo.lr}")
    _check_trainer(loaded)
    _check_bind_address(loaded)
    for role, count in loaded.spec.runtime.local_ranks.items():
        if role not in ROLES:
            raise loaded.error(
                f"runtime.local_ranks.{role}",
                f"unknown role; roles: {', '.join(ROLES)}",
                suggestions=close_names(role, ROLES),
            )
        if count < 1:
            raise loaded.error(f"runtime.local_ranks.{role}", f"must be at least 1, got {count}")


ALL_INTERFACES = ("0.0.0.0", "::", "*", "[::]")


def _check_bind_address(loaded: LoadedSpec) -> None:
    runtime = loaded.spec.runtime
    address = (runtime.bind_address or "").strip()
    if address in ALL_INTERFACES and not runtime.allow_all_interfaces:
        raise loaded.error(
            "runtime.bind_address",
            f"{address!r} binds every interface, so any host that reaches the node reaches the job's sockets and "
            "store; name the node's cluster address or interface (e.g. ib0), or set "
            "runtime.allow_all_interfaces: true",
        )


def _check_trainer(loaded: LoadedSpec) -> None:
    trainer = loaded.spec.trainer
    if trainer.micro_batch_size is not None and trainer.micro_batch_size < 1:
        raise loaded.error("trainer.micro_batch_size", f"must be at least 1 (or null), got {trainer.micro_batch_size}")
    opt = trainer.optimizer
    if not opt.weight_decay >= 0:
        raise loaded.error("trainer.optimizer.weight_decay", f"must be 0 or more, got {opt.weight_decay}")
    if len(opt.betas) != 2 or not all(0 <= b < 1 for b in opt.betas):
        raise loaded.error("trainer.optimizer.betas", f"must be two numbers in [0, 1), got {opt.betas}")
    if not opt.eps > 0:
        raise loaded.error("trainer.optimizer.eps", f"must be greater than 0, got {opt.eps}")
    if opt.value_lr is not None and not opt.value_lr > 0:
        raise loaded.error("trainer.optimizer.value_lr", f"must be greater than 0 (or null), got {opt.value_lr}")


def _check_env(loaded: LoadedSpec) -> None:
    env = loaded.spec.env
    if not env.tasks:
        raise loaded.error("env.tasks", "must name at least one task")
    if env.type == "synthetic":
        _positive(loaded, ["env.step_ms.mean", "env.slow_factor"], minimum=1e-9)
        _positive(loaded, ["env.episode_steps"])
        _positive(loaded, ["env.step_ms.per_env"], minimum=0)
        step_ms = cast("SyntheticEnvConfig", env).step_ms  # the registry's class of env.type synthetic
        if step_ms.dist == "pareto" and step_ms.alpha <= 1:
            raise loaded.error("env.step_ms.alpha", "must be greater than 1 for a finite mean")
        for key in ("slow_fraction", "success_prob"):
            if not 0.0 <= getattr(env, key) <= 1.0:
                raise loaded.error(f"env.{key}", f"must lie in [0, 1], got {getattr(env, key)}")


def _check_model(loaded: LoadedSpec) -> None:
    model = loaded.spec.model
    temperature = getattr(model, "temperature", None)  # openvla and openvla-oft (discrete head) sample with it
    if temperature is not None and temperature <= 0:
        raise loaded.error("model.temperature", f"must be greater than 0, got {temperature}")
    for key in ("path", "base_path", "unnorm_key"):  # of whichever model type has them
        if getattr(model, key, None) == "":
            raise loaded.error(f"model.{key}", "must not be empty; remove it to use the default")
    executed = model.execute_actions
    if executed is not None and not 1 <= executed <= model.action_chunk:
        raise loaded.error(
            "model.execute_actions", f"must lie in [1, action_chunk = {model.action_chunk}] (or null), got {executed}"
        )
    if not isinstance(model, VLAConfig):
        return
    obs = loaded.spec.env.obs
    if obs.image_size <= 0 or not obs.cameras:
        field = "env.obs.image_size" if obs.image_size <= 0 else "env.obs.cameras"
        raise loaded.error(field, f"model.type {model.type} reads camera images: set env.obs.image_size and cameras")
    _check_random_init(loaded, model)
    if model.base_path is not None and model.path is None:
        raise loaded.error(
            "model.base_path",
            "names the release under a LoRA adapter, so it needs model.path (the adapter folder); "
            "to load a release itself, set model.path to it instead",
        )
    if model.lora is not None:
        _check_lora(loaded, model)


def _check_random_init(loaded: LoadedSpec, model: VLAConfig) -> None:
    """What vla/tiny.py builds for path: null (checked whatever the path: a spec that drops its path must load)."""
    sizes = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vision_channels", "num_keypoints")
    _positive(loaded, [f"model.backbone.{key}" for key in sizes])
    backbone = model.backbone
    if backbone.hidden_size % backbone.num_heads:
        raise loaded.error(
            "model.backbone.hidden_size",
            f"must be divisible by model.backbone.num_heads ({backbone.num_heads}), got {backbone.hidden_size}",
        )
    for key in ("init_std", "final_std"):  # openvla-oft's Gaussian
        value = getattr(model, key, None)
        if value is not None and not value > 0:
            raise loaded.error(f"model.{key}", f"must be greater than 0, got {value}")


def _check_pi0(loaded: LoadedSpec) -> None:
    """The π0 sampler's fields (`flow_problem`, which the policy's FlowSettings also applies), and what its
    trainer cannot do: per-token ratios (a chunk's log-prob is its denoising path's density, one per action)."""
    model = loaded.spec.model
    if not isinstance(model, PI0PolicyConfig):
        return
    problem = flow_problem(model)
    if problem is not None:
        raise loaded.error(f"model.{problem[0]}", problem[1])
    if model.lora is not None:
        _check_lora(loaded, model)
        if model.train_expert_only:
            raise loaded.error(
                "model.lora",
                "adapts PaliGemma's language model, which model.train_expert_only freezes: set one of the two",
            )
        if model.lora.publish == "merged":
            raise loaded.error(
                "model.lora.publish",
                "'merged' is built for openvla and openvla-oft; pi0 publishes its adapters (publish: adapters)",
            )
    if loaded.spec.algo.logprob_level == "token":
        raise loaded.error(
            "algo.logprob_level",
            "'token' needs a log-prob per action dimension; pi0's is its denoising path's density, one per action: "
            "use logprob_level: action (or chunk)",
        )


def _check_lora(loaded: LoadedSpec, model: Union[VLAConfig, PI0PolicyConfig]) -> None:
    # The same rules as vlaslurm.models.prismatic.lora.LoraSettings, checked here so plan reports them with a line.
    lora = model.lora
    assert lora is not None
    if lora.rank < 1:
        raise loaded.error("model.lora.rank", f"must be at least 1, got {lora.rank}")
    if lora.alpha <= 0:
        raise loaded.error("model.lora.alpha", f"must be greater than 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise loaded.error("model.lora.dropout", f"must lie in [0, 1), got {lora.dropout}")
    targets = lora.target_modules
    if isinstance(targets, str):
        if targets != "all-linear":
            raise loaded.error(
                "model.lora.target_modules",
                f"is {targets!r}; give 'all-linear' or a list of module names such as [q_proj, v_proj]",
                suggestions=close_names(targets, ["all-linear"]),
            )
        return
    if not targets:
        raise loaded.error("model.lora.target_modules", "is empty; give 'all-linear' or at least one module name")
    for index, name in enumerate(targets):
        if not name.strip():
            raise loaded.error(f"model.lora.target_modules[{index}]", "must be a module name, got an empty string")


def _check_pair(loaded: LoadedSpec, key: str, low_max: float = float("inf")) -> None:
    pair = _get(loaded.spec, key)
    if len(pair) != 2 or not 0 <= pair[0] <= low_max or pair[1] < 0:
        raise loaded.error(key, f"must be [low, high] with non-negative values, got {list(pair)}")


def _check_algo(loaded: LoadedSpec) -> None:
    env = loaded.spec.env
    _check_pair(loaded, "algo.clip", low_max=1.0)
    algo_cfg = loaded.spec.algo
    if algo_cfg.dual_clip is not None and not algo_cfg.dual_clip > 1:
        raise loaded.error("algo.dual_clip", f"must be greater than 1 (or null), got {algo_cfg.dual_clip}")
    for key in ("tis_cap", "behaviour_weight_cap"):
        if not getattr(algo_cfg, key) > 0:
            raise loaded.error(f"algo.{key}", f"must be greater than 0, got {getattr(algo_cfg, key)}")
    value_clip = getattr(algo_cfg, "value_clip", None)
    if value_clip is not None and not value_clip > 0:
        raise loaded.error("algo.value_clip", f"must be greater than 0 (or null), got {value_clip}")
    huber_delta = getattr(algo_cfg, "huber_delta", 1.0)
    if not huber_delta > 0:
        raise loaded.error("algo.huber_delta", f"must be greater than 0, got {huber_delta}")
    if getattr(algo_cfg, "value_level", "chunk") == "action" and algo_cfg.logprob_level == "chunk":
        raise loaded.error(
            "algo.value_level",
            "'action' gives each executed action its own advantage, which one ratio per chunk cannot use: "
            "set algo.logprob_level: action (or token)",
        )
    if loaded.spec.algo.type == "grpo":
        algo = cast("GRPOConfig", loaded.spec.algo)  # the registry's class of algo.type grpo
        _positive(loaded, ["algo.group_size"], minimum=2)
        low, high = (algo.success_filter + [0, 0])[:2]
        if len(algo.success_filter) != 2 or not 0 <= low <= high <= 1:
            raise loaded.error(
                "algo.success_filter",
                f"must be [low, high] with 0 <= low <= high <= 1, got {list(algo.success_filter)}",
            )
        for ranks, where in _simulator_ranks(loaded):
            per_rank = env.num_envs // ranks
            if per_rank % algo.group_size:
                raise loaded.error(
                    "env.num_envs",
                    f"each of the {ranks} simulator ranks ({where}) gets {per_rank} "
                    f"environments, which must be a multiple of algo.group_size "
                    f"({algo.group_size}) so that a group runs on one rank",
                )
    _check_every_task_played(loaded)


def _check_algo_knobs(loaded: LoadedSpec) -> None:
    algo = loaded.spec.algo
    if not algo.kl_coef >= 0:
        raise loaded.error("algo.kl_coef", f"must be at least 0 (0 = no KL penalty), got {algo.kl_coef}")
    if not algo.reward_scale > 0:
        raise loaded.error("algo.reward_scale", f"must be greater than 0, got {algo.reward_scale}")


def _check_stop_at_success(loaded: LoadedSpec) -> None:
    target = loaded.spec.rollout.stop_at_success
    if target is not None and not 0.0 < target <= 1.0:
        raise loaded.error(
            "rollout.stop_at_success", f"is a success rate: must be in (0, 1], or null to run on, got {target}"
        )


def _check_publish_every(loaded: LoadedSpec) -> None:
    rollout = loaded.spec.rollout
    every = rollout.publish_every
    if every < 1:
        raise loaded.error("rollout.publish_every", f"must be at least 1, got {every}")
    if every > 1 and rollout.mode != "async":
        raise loaded.error(
            "rollout.publish_every",
            f"is {every}, but rollout.mode {rollout.mode} runs each phase with the newest version's weights: "
            "use rollout.mode: async, or publish_every: 1",
        )
    if every - 1 > rollout.max_staleness:
        raise loaded.error(
            "rollout.publish_every",
            f"is {every}: samples of a published version are {every - 1} versions old before the next one, past "
            f"rollout.max_staleness ({rollout.max_staleness}); raise max_staleness to at least {every - 1}",
        )


def _check_hold_budget(loaded: LoadedSpec) -> None:
    """Async `hold` lets a version serve (max_staleness + 1) updates' slots, of which the updates until the next
    publication take publish_every: with no update to spare, episodes' partial last chunks (slots served, env
    steps not taken) leave the trainer short of steps_per_update env steps and the generators hold for ever.
    GRPO's whole groups are spared: the trainer credits what it holds but cannot use (`waiting`)."""
    rollout = loaded.spec.rollout
    if rollout.mode != "async" or rollout.stale_policy != "hold" or getattr(loaded.spec.algo, "group_size", 1) > 1:
        return
    if rollout.max_staleness + 1 - rollout.publish_every < 1:
        raise loaded.error(
            "rollout.max_staleness",
            f"is {rollout.max_staleness} with stale_policy hold and publish_every {rollout.publish_every}: each "
            "version may serve only what the updates until the next publication take, and partial last chunks "
            "of episodes would leave the trainer short of a batch while every generator holds; raise "
            f"max_staleness to at least {rollout.publish_every}, or use stale_policy: drop",
        )


def _check_reset_seeds(loaded: LoadedSpec) -> None:
    env = loaded.spec.env
    if env.reset_seeds and env.reset_seeds_file is not None:
        raise loaded.error("env.reset_seeds_file", "and env.reset_seeds are both set: give one of them")
    key = "env.reset_seeds" if env.reset_seeds_file is None else "env.reset_seeds_file"
    try:
        seeds = env.reset_seed_list()
    except (OSError, ValueError) as exc:
        raise loaded.error(key, f"cannot be read: {exc}") from None
    negative = [s for s in seeds if s < 0]
    if negative:
        raise loaded.error(key, f"seeds must be at least 0, got {negative[0]}")


def _check_every_task_played(loaded: LoadedSpec) -> None:
    # Tasks take turns by group (envs.base.tasks_of): with fewer groups than tasks some are never played.
    env, algo = loaded.spec.env, loaded.spec.algo
    group = algo.episodes_per_group
    if env.tasks and env.num_envs // group < len(env.tasks):
        turns = (
            f"groups (env.num_envs={env.num_envs} makes {env.num_envs // group} of algo.group_size={group})"
            if group > 1
            else f"environments (env.num_envs={env.num_envs})"
        )
        raise loaded.error(
            "env.tasks",
            f"{len(env.tasks)} tasks take turns over too few {turns}: some would never "
            f"be played; raise env.num_envs to at least {len(env.tasks) * group} or "
            f"list fewer tasks",
        )


def _simulator_ranks(loaded: LoadedSpec) -> list:
    """(simulator ranks, where they come from) under Slurm and for `vlaslurm run`."""
    sim = loaded.spec.resources.simulator
    return _role_ranks(loaded, "simulator", sim.nodes * sim.tasks_per_node)


def _role_ranks(loaded: LoadedSpec, role: str, slurm_ranks: int) -> list:
    """(ranks of `role`, where they come from): `slurm_ranks` in the job, `runtime.local_ranks` for `vlaslurm run`."""
    local = loaded.spec.runtime.local_ranks.get(role, slurm_ranks)
    return [(slurm_ranks, f"resources.{role}"), (local, "runtime.local_ranks")]


def _check_periodic_eval(loaded: LoadedSpec) -> None:
    cfg, spec = loaded.spec.eval, loaded.spec
    _positive(loaded, ["eval.every_versions", "eval.keep_failed"], minimum=0)
    _positive(loaded, ["eval.episodes"])
    if not cfg.every_versions:
        return
    if spec.trainer.strategy != "replicate":
        raise loaded.error(
            "eval.every_versions",
            "needs the whole policy on trainer rank 0 (trainer.strategy: replicate; fsdp shards it): evaluate the "
            "checkpoints with `vlaslurm eval` instead",
        )
    tasks = list(getattr(spec.env, "tasks", None) or [])
    if cfg.episodes < len(tasks):
        raise loaded.error(
            "eval.episodes",
            f"{cfg.episodes} is fewer than the {len(tasks)} tasks of env.tasks: some would never be evaluated",
        )


def _check_sharding(loaded: LoadedSpec) -> None:
    """What `trainer.strategy: fsdp` cannot do, refused here as the trainer refuses it at start. The job's trainer
    ranks are the plan's (in the hybrid layout one per GPU of the rollout roles, not resources.trainer's tasks), so
    this check runs last, on an otherwise valid spec."""
    from vlaslurm.spec.plan import build_plan  # the plan module imports the loader, which imports this one

    spec = loaded.spec
    for ranks, where in _role_ranks(loaded, "trainer", build_plan(loaded).ranks()["trainer"]):
        problem = fsdp_problem(spec.trainer, ranks, spec.resources.layout, where)
        if problem is not None:
            raise loaded.error(*problem)


def _check_resources(loaded: LoadedSpec) -> None:
    res = loaded.spec.resources
    for role in ROLES:
        _positive(loaded, [f"resources.{role}.{k}" for k in ("nodes", "tasks_per_node", "cpus_per_task")])
        _positive(loaded, [f"resources.{role}.{k}" for k in ("gpus_per_node", "max_restarts")], minimum=0)
        mem = getattr(res, role).mem
        if mem is not None and not _SLURM_MEM.fullmatch(mem):
            raise loaded.error(f"resources.{role}.mem", f"must be Slurm memory like 200G or 64000M, got {mem!r}")
        _check_container(loaded, role)
    if res.trainer.max_restarts:
        raise loaded.error(
            "resources.trainer.max_restarts",
            "must be 0: the trainer holds the run's state, so a lost "
            "trainer stops the job and `vlaslurm resume` continues "
            "from the last checkpoint",
        )
    if res.generator.max_restarts and loaded.spec.rollout.weight_sync != "filesystem":
        raise loaded.error(
            "resources.generator.max_restarts",
            "must be 0 with rollout.weight_sync: nccl: a restarted generator cannot rejoin the NCCL broadcast "
            f"group; use weight_sync: filesystem (then generators restart {DEFAULT_RESTARTS} times by default)",
        )
    depth = loaded.spec.rollout.depth
    for ranks, where in _simulator_ranks(loaded):
        if loaded.spec.env.num_envs < ranks * depth:
            raise loaded.error(
                "env.num_envs",
                f"{loaded.spec.env.num_envs} environments cannot fill {ranks} "
                f"simulator ranks x pipeline_depth {depth} (see {where})",
            )
        if loaded.spec.env.num_envs % ranks:
            raise loaded.error(
                "env.num_envs",
                f"{loaded.spec.env.num_envs} environments do not split evenly over "
                f"{ranks} simulator ranks (see {where})",
            )
    _check_groups(loaded)


def _check_groups(loaded: LoadedSpec) -> None:
    res = loaded.spec.resources
    by_group: dict = {}
    for role in ROLES:
        group = getattr(res, role).group
        if group is not None:
            by_group.setdefault(group, []).append(role)
    for group, roles in by_group.items():
        first = getattr(res, roles[0])
        for role in roles[1:]:
            other = getattr(res, role)
            # Node counts may differ: the group shares the smallest count, larger roles get extra nodes.
            for attr in ("partition", "constraint", "gpu_type"):
                if getattr(other, attr) != getattr(first, attr):
                    raise loaded.error(
                        f"resources.{role}.{attr}",
                        f"roles in group {group!r} share nodes, so {attr} must equal "
                        f"resources.{roles[0]}.{attr} ({getattr(first, attr)!r})",
                    )


def _check_container(loaded: LoadedSpec, role: str) -> None:
    container = loaded.spec.role_resources(role).container
    key = f"resources.{role}.container"
    for name in ("image", "python"):
        value = getattr(container, name)
        if value is not None and (not value.strip() or re.search(r"[\s,]", value)):
            raise loaded.error(f"{key}.{name}", f"must be one word without spaces or commas, got {value!r}")
    for index, mount in enumerate(container.mounts):
        # pyxis and Apptainer split mount lists on ',' and each mount on ':'
        parts = mount.split(":")
        if "," in mount or not 1 <= len(parts) <= 3 or not all(parts[:2]) or not parts[0].startswith("/"):
            raise loaded.error(
                f"{key}.mounts[{index}]", f"must be SRC[:DST[:FLAGS]] with absolute paths and no commas, got {mount!r}"
            )


# Layouts whose trainer shares GPUs with the rollout roles, so it may only update between rollout phases
# (sync and pipelined modes), and why. hybrid does not offload the generators' state either: the placement model
# counts the trainer on top of the simulator's or generator's memory (placement/search.py memory_check).
LOCKSTEP_ONLY_LAYOUTS = {
    "collocated": "the generator and the trainer take turns on the same GPUs between rollout phases",
    "hybrid": "the trainer spans the simulators' and generators' GPUs and updates between rollout phases; "
    "in async mode it would train on those GPUs while they roll out",
}


def _check_mode_layout(loaded: LoadedSpec) -> None:
    s = loaded.spec
    why = LOCKSTEP_ONLY_LAYOUTS.get(s.resources.layout)
    if why is not None and s.rollout.mode == "async":
        raise loaded.error(
            "rollout.mode",
            f"async needs the roles on their own GPUs, but with resources.layout: {s.resources.layout} {why}; "
            "use rollout.mode: sync or pipelined, or layout: disaggregated",
        )


def check_model_path(loaded: LoadedSpec) -> None:
    """Before anything runs (submit, run; not plan, which may describe another machine's files): a set
    `model.path` must be an existing folder; relative paths are taken from the current directory."""
    import os

    path = loaded.spec.model.path
    if path is not None and not os.path.isdir(path):
        raise loaded.error(
            "model.path",
            f"folder {path!r} does not exist (relative to {os.getcwd()}); "
            "set it to a checkpoint folder, or remove it for a random init",
        )


def _check_slurm(loaded: LoadedSpec) -> None:
    slurm = loaded.spec.slurm
    if not _SLURM_TIME.fullmatch(slurm.time):
        raise loaded.error("slurm.time", f"must be Slurm time like 12:00:00 or 1-00:00:00, got {slurm.time!r}")
    for key in slurm.extra:
        if not _SBATCH_OPTION.fullmatch(key):
            raise loaded.error(f"slurm.extra.{key}", "must be a long sbatch option name like qos or mail-type")
    _positive(loaded, ["slurm.signal_seconds"], minimum=0)
    limit = slurm_seconds(slurm.time)
    if limit and slurm.signal_seconds >= limit:
        raise loaded.error(
            "slurm.signal_seconds",
            f"must be shorter than slurm.time ({slurm.time} = {limit} s), got {slurm.signal_seconds}: "
            "the job would checkpoint and requeue as soon as it starts, forever",
        )


def slurm_seconds(time: str) -> int:
    """Seconds of a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hms = (parts + [0, 0])[:3]
        return int(days) * 86_400 + hms[0] * 3_600 + hms[1] * 60 + hms[2]
    scale = {1: (60,), 2: (60, 1), 3: (3_600, 60, 1)}[len(parts)]
    return sum(p * f for p, f in zip(parts, scale))
