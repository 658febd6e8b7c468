"""Step 6 (optional), ManiSkill's GPU backend: PickCube-v1 env steps/s at 64, 256 and 1024 parallel envs (physx_cuda),
without rendering (`obs_mode: state`) and rendering its one camera (`obs_mode: rgb`), random actions.

Skipped, with the reason, where mani_skill is not importable (its wheel, ~97 MiB, cannot travel to the GPU machine
within the 64 MiB limit). `--dry-run`: the import only. The end-to-end `vlaslurm run`
of the ManiSkill spec on the GPU is not part of this script.
"""

from __future__ import annotations

import time
from typing import Any, Dict

import common

TASK = "PickCube-v1"
STEPS = 20


def steps_per_s(gym: Any, num_envs: int, obs_mode: str, backend: str, steps: int) -> Dict[str, Any]:
    import torch

    began = time.perf_counter()
    env = gym.make(TASK, num_envs=num_envs, obs_mode=obs_mode, sim_backend=backend, control_mode="pd_ee_delta_pose")
    try:
        env.reset(seed=0)
        made_s = time.perf_counter() - began
        actions = torch.as_tensor(env.action_space.sample())
        env.step(actions)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            env.step(actions)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        env.close()
    return {
        "num_envs": num_envs,
        "obs_mode": obs_mode,
        "backend": backend,
        "make_reset_s": made_s,
        "steps": steps,
        "env_steps_per_s": num_envs * steps / seconds,
    }


def body(step: common.Step, device: Any) -> None:
    try:
        import gymnasium as gym
        import mani_skill
        import mani_skill.envs  # noqa: F401  (registers the tasks)
    except ImportError as err:
        raise common.Skip(f"mani_skill is not importable ({err}); its wheel cannot travel within 64 MiB") from err
    step.set("mani_skill", mani_skill.__version__)
    if step.dry_run:  # SAPIEN wants a Vulkan device even without rendering: the rehearsal stops at the import
        step.set("rows", [])
        step.set("dry_run_note", "import only: PickCube-v1 needs a Vulkan device, which the CPU rehearsal lacks")
        return
    plan = [(n, mode, "physx_cuda", STEPS) for mode in ("state", "rgb") for n in (64, 256, 1024)]
    rows = step.set("rows", [])
    for num_envs, obs_mode, backend, steps in plan:
        if step.left_s() < 8:
            rows.append({"num_envs": num_envs, "obs_mode": obs_mode, "status": "skipped: budget"})
            continue
        with step.part("_row") as row:
            row.update(steps_per_s(gym, num_envs, obs_mode, backend, steps))
        rows.append(step.data.pop("_row"))
        step.flush()
    step.set("vlaslurm_run", "not run by this script: the end-to-end ManiSkill spec run needs its own session")


if __name__ == "__main__":
    raise SystemExit(common.main("maniskill", 30.0, body))
