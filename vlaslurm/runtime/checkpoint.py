"""Trainer checkpoints: save atomically, keep the last few, resume from the newest.

``<run>/checkpoints/v<8 digits>/`` holds the weights that are that policy version, the optimizer
and RNG states, counters and the ledger so far; it is written in a temporary folder and renamed,
so such a folder is always complete. Nothing is unpickled beyond ``torch.load(weights_only=True)``.
Details (the folder's files): docs/runtime.md
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vlaslurm.log import get_logger
from vlaslurm.rundir import RunDir, fsync_quietly, layout

log = get_logger("vlaslurm.checkpoint")

_NAME = layout.CHECKPOINT_NAME


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
    """Complete checkpoints, oldest first."""
    directory = checkpoints_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.fullmatch(p.name) and (p / layout.CKPT_STATE).exists()]
    return sorted(found, key=_version_of)


def _version_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    assert match is not None  # list_checkpoints keeps only the names that match
    return int(match.group(1))


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _state_dict(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out, seen = {}, set()
    for name, tensor in module.state_dict().items():
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
    directory = checkpoints_dir(run_dir)
    directory.mkdir(mode=0o700, exist_ok=True)
    for stale in directory.glob(".tmp-*"):  # a save that died half way
        shutil.rmtree(stale, ignore_errors=True)
    final = RunDir(run_dir).checkpoint(state.version)
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir(mode=0o700)
    state.python_rng = _jsonable(random.getstate())
    state.numpy_rng = _numpy_state()
    save_file(_state_dict(policy), str(tmp / layout.CKPT_MODEL))
    save_file({k: v.contiguous() for k, v in _rng_tensors().items()}, str(tmp / layout.CKPT_RNG))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / layout.CKPT_OPTIM)
    if ledger_rows:
        import pandas as pd

        from vlaslurm.runtime.ledger import COLUMNS

        buffer = io.BytesIO()
        pd.DataFrame(ledger_rows, columns=COLUMNS).to_parquet(buffer, index=False)
        (tmp / layout.CKPT_LEDGER).write_bytes(buffer.getvalue())
    (tmp / layout.CKPT_STATE).write_text(json.dumps(asdict(state)))  # last: its presence marks a complete folder
    for path in tmp.iterdir():
        fsync_quietly(path)
    if final.exists():  # the same version saved again (a signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_quietly(directory)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint v%d saved to %s", state.version, final)
    return final


def load(
    path: Path, policy: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], device: torch.device
) -> TrainerState:
    """Restore parameters, optimizer and RNG states from `path`; return the trainer's counters."""
    state = TrainerState(**json.loads((path / layout.CKPT_STATE).read_text()))
    weights = load_file(str(path / layout.CKPT_MODEL), device=str(device))
    policy.load_state_dict(weights)
    if optimizer is not None and (path / layout.CKPT_OPTIM).exists():
        optimizer.load_state_dict(torch.load(path / layout.CKPT_OPTIM, map_location=device, weights_only=True))
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
