"""A few failed episodes per task kept as animated GIFs, for a human to look at.

Trainer rank 0 (and `vlaslurm eval`) offers every segment to a `FailureKeeper`; the last piece of
an episode that ended without success becomes ``<run_dir>/failures/<task>/<traj_id>.gif``, at
most `tracking.failures_per_task` per task, written on a writer thread and renamed into place.
Details: docs/runtime.md
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np

from vlaslurm.log import get_logger
from vlaslurm.rundir import RunDir, layout, write_atomic

if TYPE_CHECKING:  # the tracker imports this module: keep it light
    from vlaslurm.runtime.messages import Segment

log = get_logger("vlaslurm.failures")

FAILURES_DIR = layout.FAILURES
MIN_SIDE = 128  # small images (the toy env's 32 px) are scaled up by a whole factor, so they can be seen
FRAME_MS = 200


def task_folder(task: str) -> str:
    """A task name (free text) as a folder name."""
    return re.sub(r"[^\w.-]", "_", str(task)) or "_"


def is_failed_end(seg: Segment) -> bool:
    """The last segment of an episode that ended without success."""
    return seg.episode_done and not seg.success


def frames_of(images: np.ndarray) -> np.ndarray:
    """[T, cams, H, W, 3] uint8 -> [T, H*s, cams*W*s, 3]: cameras side by side, scaled up by a whole factor s."""
    steps, cams, height, width, _ = images.shape
    tiled = np.ascontiguousarray(images.transpose(0, 2, 1, 3, 4)).reshape(steps, height, cams * width, 3)
    scale = max(1, MIN_SIDE // height)
    return tiled.repeat(scale, axis=1).repeat(scale, axis=2) if scale > 1 else tiled


def gif_bytes(images: np.ndarray, frame_ms: int = FRAME_MS) -> bytes:
    """An animated GIF (looping) of `images` [T, cams, H, W, 3] uint8."""
    from PIL import Image

    frames = [Image.fromarray(f) for f in frames_of(np.asarray(images, dtype=np.uint8))]
    out = io.BytesIO()
    # Pillow merges equal consecutive frames into one longer frame: fewer frames, the same timing.
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=frame_ms, loop=0)
    return out.getvalue()


class FailureKeeper:
    """Writes at most `per_task` failed episodes per task under `<run_dir>/failures/` (see the module docstring)."""

    def __init__(self, run_dir: Path, per_task: int, background: bool = True) -> None:
        self.root = RunDir(run_dir).failures
        self.per_task = per_task
        self.kept: Dict[str, int] = defaultdict(int)
        for folder in self.root.glob("*") if self.root.is_dir() else []:  # a resumed run keeps counting
            self.kept[folder.name] = len(list(folder.glob("*.gif")))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vlaslurm-failures") if background else None
        self._pending: List[Future] = []

    def wants(self, task: str) -> bool:
        return self.kept[task_folder(task)] < self.per_task

    def offer(self, seg: Segment) -> Optional[Path]:
        """Keep `seg` if it ends a failed episode, has images, and its task has room; the file's path if kept."""
        if seg.images is None or not is_failed_end(seg):
            return None
        return self.keep(seg.task, seg.traj_id, seg.images)

    def keep(self, task: str, name: str, images: np.ndarray) -> Optional[Path]:
        """Write `images` [T, cams, H, W, 3] as `failures/<task>/<name>.gif` unless the task has its share."""
        if not self.wants(task) or len(images) == 0:
            return None
        folder = task_folder(task)
        self.kept[folder] += 1
        path = self.root / folder / f"{task_folder(name)}.gif"
        if self._pool is None:
            _write(path, images)
        else:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._pool.submit(_write, path, np.array(images, copy=True)))
        return path

    def close(self) -> None:
        """Wait for the files being written (a few small GIFs)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _write(path: Path, images: np.ndarray) -> None:
    try:
        data = gif_bytes(images)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data, mode=0o644)
    except Exception as exc:  # a picture for humans must never cost the run
        log.warning("could not write %s: %s", path, exc)
