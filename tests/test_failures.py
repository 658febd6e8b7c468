"""Failed episodes kept as GIFs (`vlaslurm.runtime.failures`): which segments, how many, what the file holds."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import yaml
from PIL import Image

from vlaslurm.runtime.evaluate import evaluate
from vlaslurm.runtime.failures import FRAME_MS, MIN_SIDE, FailureKeeper, gif_bytes
from vlaslurm.runtime.messages import Segment
from vlaslurm.spec import load_spec
from vlaslurm.tracking.follow import RunFollower


def segment(
    traj_id: str,
    task: str = "reach",
    steps: int = 5,
    terminated: bool = False,
    truncated: bool = False,
    success: bool = False,
    images: Optional[np.ndarray] = None,
    cams: int = 1,
    side: int = 16,
) -> Segment:
    rng = np.random.default_rng(len(traj_id))
    if images is None:
        images = rng.integers(0, 256, (steps + 1, cams, side, side, 3), dtype=np.uint8)
    zeros = np.zeros((steps, 2), np.float32)
    return Segment(
        traj_id=traj_id,
        env_id=0,
        episode=0,
        index=0,
        task=task,
        instruction="go",
        version=0,
        images=images,
        state=None,
        actions=np.zeros((steps, 2, 2), np.float32),
        logprob=zeros,
        value=np.zeros(steps, np.float32),
        rewards=zeros,
        mask=np.ones((steps, 2), bool),
        step_ids=np.arange(steps),
        versions=np.zeros(steps, np.int64),
        terminated=terminated,
        truncated=truncated,
        success=success,
        t_start=0.0,
        t_end=1.0,
    )


def frames(path: Path) -> tuple:
    """(frame count, size, total duration in ms) of a GIF file."""
    with Image.open(path) as im:
        durations = []
        for i in range(im.n_frames):
            im.seek(i)
            durations.append(im.info["duration"])
        return im.n_frames, im.size, sum(durations)


@pytest.mark.parametrize("background", [True, False])
def test_keeper_keeps_only_failed_final_segments_with_images_up_to_the_limit(tmp_path: Path, background: bool):
    keeper = FailureKeeper(tmp_path, per_task=2, background=background)
    assert keeper.offer(segment("0-0-0", terminated=True, success=True)) is None  # succeeded
    assert keeper.offer(segment("0-0-1")) is None  # mid-episode piece (cut at a version change or length cap)
    no_images = segment("0-0-2", truncated=True)
    no_images.images = None
    assert keeper.offer(no_images) is None  # a state-only env: its ledger row only
    kept = [keeper.offer(segment("1-0-0", terminated=True)), keeper.offer(segment("2-3-1", truncated=True))]
    assert keeper.offer(segment("3-0-0", truncated=True)) is None  # the task has its two
    other = keeper.offer(segment("4-0-0", task="pick up/the cup", truncated=True))
    keeper.close()
    assert kept == [tmp_path / "failures" / "reach" / "1-0-0.gif", tmp_path / "failures" / "reach" / "2-3-1.gif"]
    assert other == tmp_path / "failures" / "pick_up_the_cup" / "4-0-0.gif"  # free-text task names as folders
    written = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "failures").rglob("*") if p.is_file())
    assert written == [
        "failures/pick_up_the_cup/4-0-0.gif",
        "failures/reach/1-0-0.gif",
        "failures/reach/2-3-1.gif",
    ]  # nothing else: no temporary file left behind


def test_gif_holds_every_step_at_the_scaled_size(tmp_path: Path):
    keeper = FailureKeeper(tmp_path, per_task=1, background=True)
    path = keeper.offer(segment("1-0-0", steps=7, cams=2, side=32, truncated=True))
    keeper.close()
    scale = MIN_SIDE // 32
    assert frames(path) == (8, (2 * 32 * scale, 32 * scale), 8 * FRAME_MS)  # T+1 frames, cameras side by side


def test_equal_steps_merge_into_longer_frames_and_keep_the_timing():
    images = np.zeros((6, 1, 16, 16, 3), np.uint8)
    images[3:] = 255  # three black steps, then three white ones
    with Image.open(io.BytesIO(gif_bytes(images))) as im:
        assert im.n_frames == 2
        total = 0
        for i in range(2):
            im.seek(i)
            total += im.info["duration"]
    assert total == 6 * FRAME_MS


def test_a_resumed_keeper_counts_what_is_there(tmp_path: Path):
    first = FailureKeeper(tmp_path, per_task=2, background=False)
    assert first.offer(segment("1-0-0", terminated=True))
    second = FailureKeeper(tmp_path, per_task=2, background=False)  # the trainer after a requeue
    assert second.offer(segment("2-0-0", terminated=True))
    assert second.offer(segment("3-0-0", terminated=True)) is None


def test_follower_names_each_new_gif_once_and_never_a_file_being_written(tmp_path: Path):
    keeper = FailureKeeper(tmp_path, per_task=3, background=False)
    keeper.offer(segment("1-0-0", terminated=True))
    follower = RunFollower(tmp_path)
    assert [p.name for p in follower.new_failures()] == ["1-0-0.gif"]
    (tmp_path / "failures" / "reach" / ".2-0-0.gif.123.ab.tmp").write_bytes(b"GIF8")  # write_atomic's temporary
    assert follower.new_failures() == []
    keeper.offer(segment("2-0-0", terminated=True))
    assert [p.name for p in follower.new_failures()] == ["2-0-0.gif"]
    assert follower.new_failures() == []


def test_eval_keeps_the_frames_of_its_failed_episodes(tmp_path: Path):
    """The toy env renders images and a synthetic (random) policy fails most episodes."""
    spec = {
        "name": "evtoy",
        "env": {"type": "toy", "num_envs": 2, "max_episode_steps": 12},
        "model": {"type": "synthetic", "action_chunk": 2, "forward_ms": {"base": 0.0, "per_item": 0.0}},
        "algo": {"type": "synthetic"},
    }
    (tmp_path / "ev.yaml").write_text(yaml.safe_dump(spec))
    directory = evaluate(load_spec(tmp_path / "ev.yaml"), tmp_path / "runs", episodes=6, keep_failed=2)
    npz = sorted(p.stem for p in (directory / "failed").glob("*.npz"))
    gifs = sorted(p.stem for p in (directory / "failures" / "reach").glob("*.gif"))
    assert npz == ["reach-0", "reach-1"] and gifs == ["0", "1"]
    for name in gifs:
        steps = len(np.load(directory / "failed" / f"reach-{name}.npz")["actions"])
        count, size, total = frames(directory / "failures" / "reach" / f"{name}.gif")
        assert size == (MIN_SIDE, MIN_SIDE) and count <= steps + 1 and total == (steps + 1) * FRAME_MS
