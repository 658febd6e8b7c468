"""Choose the Vulkan driver SAPIEN (ManiSkill's renderer) uses, before SAPIEN starts.

`activate(setting)` (`auto` or the path of an ICD json) keeps `$VK_ICD_FILENAMES` or the system's
ICDs when there are any, else uses the private Mesa lavapipe folder of `.ci/setup-sims`
(`.sims/vulkan`, or `$VLASLURM_VULKAN_DIR`), and sets the environment and preloads its libraries.
Details (why lavapipe, what is preloaded): docs/simulators.md
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

VULKAN_DIR_ENV = "VLASLURM_VULKAN_DIR"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".sims" / "vulkan"
SYSTEM_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")
SYSTEM_LIB_PREFIXES = ("/usr/lib", "/lib", "/usr/local/lib")  # drivers there need no preloading
SETUP_HINT = "run `bash .ci/setup-sims` (unpacks Mesa 25 lavapipe into .sims/vulkan) or install a GPU driver"


@dataclass
class VulkanChoice:
    """Which ICD json files the Vulkan loader will read, and why."""

    icds: List[str]  # empty: none found
    source: str  # VK_ICD_FILENAMES, system, private, config, none
    lib_dirs: List[str] = field(default_factory=list)  # folders whose libraries were preloaded


def private_dir() -> Path:
    return Path(os.environ.get(VULKAN_DIR_ENV) or DEFAULT_DIR)


def system_icds() -> List[str]:
    found = []
    for folder in SYSTEM_ICD_DIRS:
        if os.path.isdir(folder):
            found += sorted(str(p) for p in Path(folder).glob("*.json"))
    return found


def choose(setting: str = "auto") -> VulkanChoice:
    """Resolve `setting` without changing anything."""
    if setting not in ("", "auto"):
        return VulkanChoice([setting], "config")
    env = os.environ.get("VK_ICD_FILENAMES")
    if env:
        return VulkanChoice([p for p in env.split(os.pathsep) if p], "VK_ICD_FILENAMES")
    system = system_icds()
    if system:
        return VulkanChoice(system, "system")
    icd = private_dir() / "lvp_icd.json"
    if icd.is_file():
        return VulkanChoice([str(icd)], "private")
    return VulkanChoice([], "none")


def icd_problem(path: str) -> Optional[str]:
    """Why the ICD json at `path` cannot work, or None when it looks usable."""
    if not os.path.isfile(path):
        return f"Vulkan ICD file {path} does not exist"
    try:
        library = json.loads(Path(path).read_text())["ICD"]["library_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"Vulkan ICD file {path} is not a valid ICD json ({exc})"
    if os.path.isabs(library) and not os.path.isfile(library):
        return f"Vulkan ICD file {path} names driver {library}, which does not exist"
    return None


def problems(choice: VulkanChoice) -> List[str]:
    """Human-readable reasons the chosen driver cannot work (empty: looks fine)."""
    if not choice.icds:
        return [
            f"no Vulkan driver (ICD) found: VK_ICD_FILENAMES is unset, no system ICD in "
            f"{', '.join(SYSTEM_ICD_DIRS)}, no private lavapipe at {private_dir()}; {SETUP_HINT}"
        ]
    found = [icd_problem(p) for p in choice.icds]
    bad = [p for p in found if p]
    if len(bad) == len(found):  # the loader only needs one usable ICD
        return [f"{b} (from {choice.source}); {SETUP_HINT}" for b in bad]
    return []


def activate(setting: str = "auto") -> VulkanChoice:
    """Point the Vulkan loader at the chosen ICDs and preload their private libraries."""
    choice = choose(setting)
    if choice.source in ("private", "config"):
        os.environ["VK_ICD_FILENAMES"] = os.pathsep.join(choice.icds)
    for icd in choice.icds:
        lib_dir = _driver_dir(icd)
        if lib_dir and not lib_dir.startswith(SYSTEM_LIB_PREFIXES) and any(Path(lib_dir).glob("lib*.so*")):
            _preload(lib_dir)
            choice.lib_dirs.append(lib_dir)
    return choice


def _driver_dir(icd: str) -> Optional[str]:
    if icd_problem(icd):
        return None
    library = json.loads(Path(icd).read_text())["ICD"]["library_path"]
    return os.path.dirname(library) if os.path.isabs(library) else None


def _preload(lib_dir: str) -> None:
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    if lib_dir not in paths:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([lib_dir] + [p for p in paths if p])
    # This process read LD_LIBRARY_PATH when it started, so load the folder's libraries by path: the
    # driver's dependencies then resolve by soname. Retry until no progress (dependencies first).
    pending = sorted({os.path.realpath(p) for p in Path(lib_dir).glob("lib*.so*") if p.is_file()})
    while pending:
        failed = []
        for path in pending:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(path)
        if len(failed) == len(pending):
            break  # left for the Vulkan loader to report
        pending = failed
    loader = os.path.join(lib_dir, "libvulkan.so.1")
    if os.path.isfile(loader):
        # SAPIEN sees this folder in LD_LIBRARY_PATH and dlopens "libvulkan.so.1" by name, which this
        # process cannot resolve; give it the full path instead.
        os.environ["SAPIEN_VULKAN_LIBRARY_PATH"] = loader
