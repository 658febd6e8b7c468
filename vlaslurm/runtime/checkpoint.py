"""Trainer checkpoints: save atomically, keep the last few, resume from the newest that verifies.

``<run>/checkpoints/v<8 digits>/`` holds the weights that are that policy version, the optimizer
and RNG states, counters and the ledger so far. It is written in a temporary folder: every file is
fsynced, then ``manifest.json`` (each file's relative path, size and sha256) is written atomically,
last, and the folder is renamed into place. Only a folder with a manifest is a checkpoint; `load`
checks sizes and hashes first and raises `CheckpointError` naming the file and what is wrong. A
resume (`resume_point`) takes the newest checkpoint that verifies, warns about the newer ones it
skipped and records them for ``status`` (`rundir.records.append_checkpoint_fallback`). Hashing
works on a list of files (`hash_files`) and `merge_entries` joins the lists, so each rank of a
sharded checkpoint can hash its own shard: with `trainer.strategy: fsdp`, `save_sharded` and
`load_sharded` write and read torch.distributed.checkpoint (DCP) shards on every trainer rank, and
a run resumes on any number of ranks.

Older checkpoints (``state.json`` but no manifest) are refused, not loaded unverified: without a
manifest a torn save cannot be told from a whole one. A resume names them among the skipped and,
if nothing verifies, stops with a `CheckpointError` rather than silently starting from version 0.
Nothing is unpickled beyond ``torch.load(weights_only=True)``. Details (the folder's files):
docs/runtime.md
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vlaslurm.log import get_logger
from vlaslurm.models import load_trained_state, trained_state
from vlaslurm.rundir import RunDir, fsync_quietly, layout, write_atomic
from vlaslurm.rundir.records import append_checkpoint_fallback

log = get_logger("vlaslurm.checkpoint")

_NAME = layout.CHECKPOINT_NAME
MANIFEST_FORMAT = 1
_HASH_CHUNK = 8 << 20  # bytes read at a time while hashing
REQUIRED = (layout.CKPT_STATE, layout.CKPT_MODEL, layout.CKPT_RNG)  # in every checkpoint; optim.pt with an optimizer


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: `path` (a file, or the folder) and what is wrong with it."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem

    @property
    def reason(self) -> str:
        """The file's name and the problem, for a line naming the checkpoint folder already."""
        return f"{self.path.name}: {self.problem}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as its manifest records it."""

    path: str
    """Relative to the checkpoint folder."""
    size: int
    sha256: str


@dataclass
class TrainerState:
    """Everything besides tensors that the trainer needs to continue exactly where it was."""

    version: int
    """The policy version the saved parameters are (updates done so far)."""
    received_steps: int = 0
    consumed_steps: int = 0
    dropped: int = 0
    counters: Dict[str, float] = field(default_factory=dict)
    python_rng: Any = None
    numpy_rng: Any = None


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def list_checkpoints(run_dir: Path) -> List[Path]:
    """Complete checkpoints (their manifest is there; their files are not checked here), oldest first."""
    return [p for p in _numbered(run_dir) if (p / layout.CKPT_MANIFEST).is_file()]


def _numbered(run_dir: Path) -> List[Path]:
    """Every `v<version>` folder, complete or not, oldest first."""
    directory = checkpoints_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()), key=_version_of)


def _version_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    assert match is not None  # _numbered keeps only the names that match
    return int(match.group(1))


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint, or None (cheap: the manifest's presence, no hashing)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def hash_files(folder: Path, names: Iterable[str]) -> List[FileEntry]:
    """Size and sha256 of each file `folder / name`: what one rank contributes to the manifest."""
    return [_hash_file(folder, name) for name in names]


def _hash_file(folder: Path, name: str) -> FileEntry:
    digest = hashlib.sha256()
    with (folder / name).open("rb") as handle:  # hashlib.file_digest is Python 3.11+
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
        return FileEntry(name, os.fstat(handle.fileno()).st_size, digest.hexdigest())


def merge_entries(parts: Iterable[Sequence[FileEntry]]) -> List[FileEntry]:
    """One manifest's entries from each rank's `hash_files`, sorted by path; a path hashed twice is an error."""
    merged: Dict[str, FileEntry] = {}
    for entry in (entry for part in parts for entry in part):
        if entry.path in merged:
            raise ValueError(f"{entry.path} is in two ranks' parts of the checkpoint manifest")
        merged[entry.path] = entry
    return [merged[path] for path in sorted(merged)]


def write_manifest(folder: Path, entries: Sequence[FileEntry]) -> None:
    """Write the manifest atomically; it marks the folder complete, so fsync the files it lists first."""
    body = {"format": MANIFEST_FORMAT, "files": [asdict(entry) for entry in entries]}
    write_atomic(folder / layout.CKPT_MANIFEST, json.dumps(body, indent=1).encode(), mode=0o600)


def read_manifest(folder: Path) -> List[FileEntry]:
    """The entries of `folder`'s manifest; CheckpointError if it is missing or malformed."""
    path = Path(folder) / layout.CKPT_MANIFEST
    if not path.is_file():
        raise CheckpointError(path, "missing: a save that did not finish, or a checkpoint older than manifests")
    try:
        body = json.loads(path.read_text())
        if body.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {body.get('format')!r}, this vlaslurm reads format {MANIFEST_FORMAT}")
        return [FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in body["files"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(path, f"unreadable ({error})") from error


def verify_files(folder: Path, entries: Sequence[FileEntry]) -> None:
    """Check that each listed file is there with its size and sha256 (sizes of all first: they are cheap)."""
    for entry in entries:
        _check_size(folder, entry)
    for entry in entries:
        actual = _hash_file(folder, entry.path).sha256
        if actual != entry.sha256:
            problem = f"sha256 {actual[:16]}... differs from the manifest's {entry.sha256[:16]}... (corrupted)"
            raise CheckpointError(folder / entry.path, problem)


def _check_size(folder: Path, entry: FileEntry) -> None:
    path = folder / entry.path
    if not path.is_file():
        raise CheckpointError(path, f"missing (the manifest lists {entry.size} bytes)")
    size = path.stat().st_size
    if size != entry.size:
        raise CheckpointError(path, f"{size} bytes, the manifest says {entry.size} (truncated or overwritten)")


def verify(folder: Path, required: Sequence[str] = REQUIRED) -> List[FileEntry]:
    """Check a whole checkpoint folder: its manifest, the `required` files in it, every file's size and hash."""
    entries = read_manifest(folder)
    _require(folder, entries, required)
    verify_files(folder, entries)
    return entries


def _require(folder: Path, entries: Sequence[FileEntry], required: Sequence[str]) -> None:
    listed = {entry.path for entry in entries}
    for name in required:
        if name not in listed:
            raise CheckpointError(Path(folder) / name, "missing: the manifest does not list it")


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume starts, and why each newer checkpoint folder was skipped."""

    path: Optional[Path]
    """The newest checkpoint that verifies, None if there is none."""
    skipped: Dict[str, str] = field(default_factory=dict)
    """Folder name -> why it was skipped (`CheckpointError.reason`), newest first."""


def latest_verified(run_dir: Path, required: Sequence[str] = REQUIRED) -> ResumePoint:
    """The newest checkpoint folder that verifies (hashing each one tried), and the newer ones skipped."""
    skipped: Dict[str, str] = {}
    for folder in reversed(_numbered(run_dir)):
        try:
            verify(folder, required)
        except CheckpointError as error:
            skipped[folder.name] = error.reason
            continue
        return ResumePoint(folder, skipped)
    return ResumePoint(None, skipped)


def resume_point(run_dir: Path, record: bool, required: Sequence[str] = REQUIRED) -> Optional[Path]:
    """The checkpoint a trainer resumes from (verified; None for a fresh run). Skipped folders are logged and,
    with `record` (one rank), recorded for `status`; CheckpointError if there are checkpoints but none verifies."""
    point = latest_verified(run_dir, required)
    taken = point.path.name if point.path else None
    for name, why in point.skipped.items():
        log.warning("checkpoint %s skipped, resuming from %s instead: %s", name, taken or "nothing", why)
    if point.skipped and record:
        append_checkpoint_fallback(run_dir, taken, point.skipped)
    if point.path is None and point.skipped:
        reasons = "; ".join(f"{name}: {why}" for name, why in point.skipped.items())
        problem = f"no checkpoint verifies ({reasons}); move the folder away to start the run over"
        raise CheckpointError(checkpoints_dir(run_dir), problem)
    return point.path


def required_files(optimizer: Optional[torch.optim.Optimizer]) -> Sequence[str]:
    """What a checkpoint must hold to resume a learner with (or without) an optimizer."""
    return REQUIRED + ((layout.CKPT_OPTIM,) if optimizer is not None else ())


def _trained_state(policy: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """What a checkpoint saves of the policy (`models.trained_state`), as contiguous host tensors."""
    return _state_dict(policy, trained_state(policy))


def _state_dict(module: torch.nn.Module, state: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    out, seen = {}, set()
    for name, tensor in (module.state_dict() if state is None else state).items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t  # safetensors refuses shared storage
        seen.add(ptr)
    return out


def _rng_tensors() -> Dict[str, torch.Tensor]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    return tensors


def _numpy_state() -> list:
    state = np.random.get_state()
    assert isinstance(state, tuple)  # the global RandomState is MT19937, whose legacy state is a tuple
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def save(
    run_dir: Path,
    state: TrainerState,
    policy: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    ledger_rows: List[dict],
    keep: int,
) -> Path:
    """Write checkpoint `v<state.version>` atomically and prune all but the newest `keep`."""
    tmp = fresh_tmp(run_dir, state.version)
    tmp.mkdir(mode=0o700)
    save_file(_trained_state(policy), str(tmp / layout.CKPT_MODEL))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / layout.CKPT_OPTIM)
    return _finish(run_dir, tmp, state, ledger_rows, keep, [])


def fresh_tmp(run_dir: Path, version: int) -> Path:
    """The temporary folder (not made yet) a save of `version` writes in; removes those of saves that died."""
    directory = checkpoints_dir(run_dir)
    directory.mkdir(mode=0o700, exist_ok=True)
    for stale in directory.glob(".tmp-*"):  # a save that died half way
        shutil.rmtree(stale, ignore_errors=True)
    return directory / f".tmp-{RunDir(run_dir).checkpoint(version).name}-{os.getpid()}"


def _finish(
    run_dir: Path, tmp: Path, state: TrainerState, ledger_rows: List[dict], keep: int, hashed: List[FileEntry]
) -> Path:
    """Rank 0: write the trainer's own files into `tmp`, then the manifest (the files `tmp` holds that are not in
    `hashed`, the other ranks' parts, are hashed here), rename it into place and prune."""
    state.python_rng = _jsonable(random.getstate())
    state.numpy_rng = _numpy_state()
    save_file({k: v.contiguous() for k, v in _rng_tensors().items()}, str(tmp / layout.CKPT_RNG))
    if ledger_rows:
        import pandas as pd

        from vlaslurm.runtime.ledger import COLUMNS

        buffer = io.BytesIO()
        pd.DataFrame(ledger_rows, columns=COLUMNS).to_parquet(buffer, index=False)
        (tmp / layout.CKPT_LEDGER).write_bytes(buffer.getvalue())
    (tmp / layout.CKPT_STATE).write_text(json.dumps(asdict(state)))
    done = {entry.path for entry in hashed}
    names = sorted(path.name for path in tmp.iterdir() if path.name not in done)
    for name in names:
        fsync_quietly(tmp / name)
    write_manifest(tmp, merge_entries([hashed, hash_files(tmp, names)]))  # last: it marks the folder complete
    final = RunDir(run_dir).checkpoint(state.version)
    if final.exists():  # the same version saved again (a signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_quietly(checkpoints_dir(run_dir))
    _prune(run_dir, keep)
    log.info("checkpoint v%d saved to %s", state.version, final)
    return final


def _prune(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; remove every numbered folder older than those (torn ones too)."""
    complete = list_checkpoints(run_dir)
    if keep < 1 or len(complete) <= keep:
        return
    oldest_kept = _version_of(complete[len(complete) - keep])
    for old in _numbered(run_dir):
        if _version_of(old) < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)


def load(
    path: Path,
    policy: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    device: torch.device,
    verify_first: bool = True,
) -> TrainerState:
    """Restore parameters, optimizer and RNG states from `path`; return the trainer's counters.

    Sizes and hashes are checked first (CheckpointError naming the file); `verify_first=False` only right
    after `resume_point` or `latest_verified` checked this folder (the manifest's file list is still checked).
    """
    if verify_first:
        verify(path, required_files(optimizer))
    else:
        _require(path, read_manifest(path), required_files(optimizer))
    weights = load_file(str(path / layout.CKPT_MODEL), device=str(device))
    _load_trained(policy, weights, path / layout.CKPT_MODEL)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / layout.CKPT_OPTIM, map_location=device, weights_only=True))
    return _restore_state(path)


def _restore_state(path: Path) -> TrainerState:
    """The RNG states and the trainer's counters of checkpoint `path` (after its tensors were loaded)."""
    state = TrainerState(**json.loads((path / layout.CKPT_STATE).read_text()))
    rng = load_file(str(path / layout.CKPT_RNG))
    torch.set_rng_state(rng["torch_cpu"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    if state.python_rng is not None:
        random.setstate(_tuples(state.python_rng))
    if state.numpy_rng is not None:
        name, keys, pos, has_gauss, cached = state.numpy_rng
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    log.info("resumed from checkpoint %s (policy version %d, %d env steps)", path, state.version, state.received_steps)
    return state


def _load_trained(policy: torch.nn.Module, weights: Dict[str, torch.Tensor], file: Path) -> None:
    """Strictly the tensors `_trained_state` saved: all of them, or exactly the trained ones."""
    try:
        load_trained_state(policy, weights)
    except ValueError as err:
        raise CheckpointError(file, str(err)) from None


def ledger_rows(path: Path) -> List[dict]:
    """The ledger rows saved with a checkpoint."""
    file = path / layout.CKPT_LEDGER
    if not file.exists():
        return []
    import pandas as pd

    frame = pd.read_parquet(file)
    rows = frame.to_dict("records")
    for row in rows:
        row["step_ids"] = [int(x) for x in row["step_ids"]]
    return rows


def param_checksum(module: torch.nn.Module) -> str:
    """A hash of every parameter and buffer (names, dtypes, shapes, bytes): equal means the same weights."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(_state_dict(module).items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# --- sharded checkpoints (trainer.strategy: fsdp) -----------------------------------------------------------------
# torch.distributed.checkpoint's own names for its files in the folder: the coordinator's metadata (which tensors,
# which shards where) and each rank's shards, `__<rank in the trainers' group>_<n>.distcp`.
DCP_METADATA = ".metadata"
_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
SHARDED_REQUIRED = (layout.CKPT_STATE, layout.CKPT_RNG, DCP_METADATA)


def _owned(name: str, rank: int) -> bool:
    """Whether file `name` of a sharded save is rank `rank`'s to hash (its shards; the metadata is rank 0's)."""
    match = _DCP_SHARD.fullmatch(name)
    return int(match.group(1)) == rank if match else (rank == 0 and name == DCP_METADATA)


def _dcp_state(policy: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """Model and optimizer state keyed by parameter names (DTensor shards): what DCP saves and reshards on load.
    Frozen parameters (a LoRA policy's base: nearly all of a 7B model) are left out, as `_trained_state` leaves
    them out of a replicated checkpoint: a resume rebuilds them from `model.path`."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(policy, options=_dcp_options())}
    # a fresh optimizer gets zero state first (lr 0 step)
    model, optim = get_state_dict(policy, optimizer, options=_dcp_options())
    return {"model": model, "optim": optim}


def _dcp_options():
    """How DCP's state dicts treat frozen parameters (the import is heavy: built when needed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False on load: the frozen parameters are not in the state dict by design
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def save_sharded(
    run_dir: Path,
    tmp: Path,
    state: Optional[TrainerState],
    policy: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    ledger_rows: List[dict],
    keep: int,
    group,
) -> Optional[Path]:
    """Every trainer rank (a collective): write this rank's shards of model and optimizer into `tmp` (rank 0 made
    it with `fresh_tmp`), hash them and send the entries to rank 0, which writes the trainer's files (`state`,
    given on rank 0 only) and the manifest last, renames the folder and returns its path."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank(group)
    dcp.save(_dcp_state(policy, optimizer), storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=group)
    mine = sorted(name for name in os.listdir(tmp) if _owned(name, rank))
    for name in mine:
        fsync_quietly(tmp / name)
    parts = _gather_entries(hash_files(tmp, mine), group)
    if rank != 0:
        return None
    assert state is not None, "rank 0 saves the trainer state"
    return _finish(run_dir, tmp, state, ledger_rows, keep, merge_entries(parts))


def _gather_entries(entries: List[FileEntry], group) -> List[List[FileEntry]]:
    """Every rank's manifest entries, on every rank (msgpack bytes over the group: nothing is unpickled)."""
    import msgpack
    import torch.distributed as dist

    raw = msgpack.packb([[e.path, e.size, e.sha256] for e in entries])
    size = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    every = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(every, mine, group=group)
    return [
        [FileEntry(str(p), int(n), str(h)) for p, n, h in msgpack.unpackb(t[: int(s.item())].numpy().tobytes())]
        for t, s in zip(every, sizes)
    ]


def is_sharded(path: Path) -> bool:
    """Whether checkpoint `path` was saved by an fsdp trainer (its manifest lists DCP's metadata)."""
    return any(entry.path == DCP_METADATA for entry in read_manifest(path))


def load_sharded(
    path: Path, policy: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], group
) -> TrainerState:
    """Every trainer rank (a collective): restore a sharded checkpoint that `resume_point` verified, on any number
    of ranks (DCP reshards), then the RNG states and counters as `load` does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _require(path, read_manifest(path), SHARDED_REQUIRED)
    state = _dcp_state(policy, optimizer)
    dcp.load({"model": state["model"]}, checkpoint_id=str(path), process_group=group)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(policy, state["model"], options=_dcp_options())
        return _restore_state(path)
    # Parameters that never had optimizer state (GRPO's unused value head) are not in the checkpoint: load the
    # rest, then drop the zero state `_dcp_state` gave them, so the optimizer is exactly the saved one.
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
    dcp.load({"optim": state["optim"]}, checkpoint_id=str(path), process_group=group, planner=planner)
    set_state_dict(
        policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_dcp_options()
    )
    for name, param in policy.named_parameters():
        if not any(key.startswith(f"optim.state.{name}.") for key in saved):
            optimizer.state.pop(param, None)
    return _restore_state(path)


def check_sharding(run_dir: Path, sharded: bool) -> None:
    """A resume with the other trainer.strategy than the newest checkpoint's is refused with what to set (the files
    differ: whole tensors, or DCP shards); a damaged newest checkpoint is left to `resume_point`."""
    newest = latest(run_dir)
    try:
        saved = newest is not None and is_sharded(newest)
    except CheckpointError:
        return
    if newest is not None and saved != sharded:
        strategy = "fsdp" if saved else "replicate"
        raise CheckpointError(newest, f"saved with trainer.strategy: {strategy}; resume with that strategy")
