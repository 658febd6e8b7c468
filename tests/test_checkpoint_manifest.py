"""Checkpoint manifests: a folder counts once its manifest is written, loads only if every file verifies, and a
resume falls back past a torn newest checkpoint to the newest one that verifies (fast: no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest
import torch

from vlaslurm.rundir import RunDir, layout
from vlaslurm.rundir.records import checkpoint_fallback_line, checkpoint_fallbacks
from vlaslurm.runtime import checkpoint as ckpt
from vlaslurm.runtime.checkpoint import CheckpointError

CPU = torch.device("cpu")


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    policy(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # so that the optimizer has state worth saving
    return policy, optimizer


def save(run_dir: Path, version: int, keep: int = 3) -> Path:
    policy, optimizer = tiny()
    return ckpt.save(
        run_dir, ckpt.TrainerState(version=version, received_steps=10 * version), policy, optimizer, [], keep
    )


def test_save_writes_a_manifest_that_verifies_and_loads(tmp_path: Path) -> None:
    folder = save(tmp_path, 2)
    manifest = json.loads((folder / layout.CKPT_MANIFEST).read_text())
    listed = {entry["path"]: entry for entry in manifest["files"]}
    assert set(listed) == {layout.CKPT_STATE, layout.CKPT_MODEL, layout.CKPT_RNG, layout.CKPT_OPTIM}
    assert all(listed[name]["size"] == (folder / name).stat().st_size for name in listed)
    assert [e.path for e in ckpt.verify(folder)] == sorted(listed)
    assert ckpt.list_checkpoints(tmp_path) == [folder] and ckpt.latest(tmp_path) == folder

    policy = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    state = ckpt.load(folder, policy, optimizer, CPU)
    assert state.version == 2 and state.received_steps == 20
    assert ckpt.param_checksum(policy) == ckpt.param_checksum(tiny()[0])
    assert optimizer.state_dict()["state"], "the optimizer state was restored"


def test_the_manifest_is_what_marks_a_folder_complete(tmp_path: Path) -> None:
    folder = save(tmp_path, 2)
    (folder / layout.CKPT_MANIFEST).unlink()
    assert ckpt.list_checkpoints(tmp_path) == [] and ckpt.latest(tmp_path) is None


@pytest.mark.parametrize(
    "name, damage, problem",
    [
        (layout.CKPT_OPTIM, lambda p: p.unlink(), "missing"),
        (layout.CKPT_MODEL, lambda p: p.write_bytes(p.read_bytes()[:-7]), "bytes, the manifest says"),
        (layout.CKPT_MODEL, lambda p: p.write_bytes(flipped(p.read_bytes())), "sha256"),
    ],
    ids=["missing optim", "truncated model", "flipped byte"],
)
def test_a_damaged_file_is_a_checkpoint_error_naming_it(tmp_path: Path, name: str, damage, problem: str) -> None:
    folder = save(tmp_path, 2)
    damage(folder / name)
    policy = torch.nn.Linear(4, 3)
    before = ckpt.param_checksum(policy)
    with pytest.raises(CheckpointError) as raised:
        ckpt.load(folder, policy, torch.optim.Adam(policy.parameters()), CPU)
    assert raised.value.path == folder / name and problem in str(raised.value) and name in str(raised.value)
    assert ckpt.param_checksum(policy) == before, "nothing was loaded from a checkpoint that does not verify"


def flipped(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def test_an_optimizer_without_its_saved_state_is_refused(tmp_path: Path) -> None:
    """A checkpoint saved without an optimizer cannot resume a learner that has one (no fresh optimizer)."""
    policy = torch.nn.Linear(4, 3)
    folder = ckpt.save(tmp_path, ckpt.TrainerState(version=1), policy, None, [], keep=3)
    with pytest.raises(CheckpointError, match="optim.pt: missing: the manifest does not list it"):
        ckpt.load(folder, policy, torch.optim.Adam(policy.parameters()), CPU)
    assert ckpt.load(folder, policy, None, CPU).version == 1


def test_a_torn_newest_checkpoint_falls_back_to_the_older_one(tmp_path: Path, package_warnings: List[str]) -> None:
    older, newer = save(tmp_path, 2), save(tmp_path, 4)
    (newer / layout.CKPT_MODEL).write_bytes(b"torn")
    point = ckpt.latest_verified(tmp_path)
    assert point.path == older and list(point.skipped) == [newer.name]
    assert point.skipped[newer.name].startswith(f"{layout.CKPT_MODEL}: 4 bytes, the manifest says")

    assert ckpt.resume_point(tmp_path, record=True) == older
    warnings = package_warnings
    assert len(warnings) == 1 and newer.name in warnings[0] and older.name in warnings[0]
    assert layout.CKPT_MODEL in warnings[0]
    records = checkpoint_fallbacks(tmp_path)
    assert RunDir(tmp_path).checkpoint_fallbacks.parent == ckpt.checkpoints_dir(tmp_path)
    assert [(r["resumed_from"], [s["checkpoint"] for s in r["skipped"]]) for r in records] == [
        (older.name, [newer.name])
    ]
    line = checkpoint_fallback_line(tmp_path)
    assert line is not None and line.startswith(f"resumed from {older.name} ({newer.name} skipped: ")


def test_a_follower_rank_does_not_record_and_a_clean_resume_records_nothing(tmp_path: Path) -> None:
    older, newer = save(tmp_path, 2), save(tmp_path, 4)
    assert ckpt.resume_point(tmp_path, record=True) == newer
    (newer / layout.CKPT_RNG).unlink()
    assert ckpt.resume_point(tmp_path, record=False) == older
    assert checkpoint_fallbacks(tmp_path) == [] and checkpoint_fallback_line(tmp_path) is None
    assert ckpt.resume_point(tmp_path / "fresh", record=True) is None  # no checkpoints: a fresh run


def test_an_old_checkpoint_without_a_manifest_is_refused(tmp_path: Path) -> None:
    """Backward compatibility: state.json but no manifest (written before manifests) is not loaded unverified;
    with nothing else to resume from, the resume stops with an error naming it instead of starting over."""
    folder = save(tmp_path, 2)
    (folder / layout.CKPT_MANIFEST).unlink()
    assert (folder / layout.CKPT_STATE).exists()
    assert ckpt.latest_verified(tmp_path).skipped[folder.name].startswith(f"{layout.CKPT_MANIFEST}: missing")
    with pytest.raises(CheckpointError, match=f"no checkpoint verifies \\({folder.name}: manifest.json: missing"):
        ckpt.resume_point(tmp_path, record=True)
    assert checkpoint_fallbacks(tmp_path)[0]["resumed_from"] is None
    with pytest.raises(CheckpointError, match="older than manifests"):
        ckpt.load(folder, torch.nn.Linear(4, 3), None, CPU)


def test_ranks_hash_their_own_files_and_the_parts_merge(tmp_path: Path) -> None:
    for rank in range(2):
        (tmp_path / f"shard-{rank}.bin").write_bytes(bytes([rank]) * (100 + rank))
    parts = [ckpt.hash_files(tmp_path, [f"shard-{rank}.bin"]) for rank in (1, 0)]
    entries = ckpt.merge_entries(parts)
    assert [(e.path, e.size) for e in entries] == [("shard-0.bin", 100), ("shard-1.bin", 101)]
    ckpt.write_manifest(tmp_path, entries)
    assert ckpt.read_manifest(tmp_path) == entries
    ckpt.verify_files(tmp_path, entries)
    with pytest.raises(ValueError, match="shard-0.bin is in two ranks' parts"):
        ckpt.merge_entries([parts[1], parts[1]])


def test_pruning_keeps_the_newest_complete_ones_and_removes_older_torn_folders(tmp_path: Path) -> None:
    torn = save(tmp_path, 1)
    (torn / layout.CKPT_MANIFEST).unlink()
    kept = [save(tmp_path, version, keep=2) for version in (2, 3, 4)][1:]
    assert ckpt.list_checkpoints(tmp_path) == kept and not torn.exists()
