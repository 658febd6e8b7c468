"""The signals a rank acts on, and which incarnation of its worker this process is.

Slurm sends USR2 `slurm.signal_seconds` before the time limit (the batch script
forwards it to every step) and TERM on preemption, `scancel` or `scontrol requeue`.
The trainer treats both as "drain": it finishes the update in progress, saves a
checkpoint, tells every rank to stop and exits with `REQUEUE_EXIT`, which the
batch script turns into a requeue. Simulators and generators ignore USR2 (the
trainer's stop announcement ends them) and keep TERM's default (they hold no
state worth saving).
"""

from __future__ import annotations

import os
import signal
from typing import Optional

REQUEUE_EXIT = 75  # EX_TEMPFAIL: "checkpointed on a signal; run me again"
DRAIN_SIGNAL = signal.SIGUSR2  # what asks the trainer to drain without ending any rank at once
RESTART_ENV = "VLASLURM_WORKER_RESTART"

_received: Optional[str] = None
_ready = False  # the trainer's loop runs and will act on a drain signal


def _note(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _received
    if signum == signal.SIGTERM and not _ready:
        raise SystemExit(128 + signum)  # nothing to save yet (still meeting, loading): stop at once
    _received = _received or signal.Signals(signum).name


def install(drain_on_term: bool) -> None:
    """USR2 never kills a rank; with `drain_on_term` (the trainer) TERM is noted too instead of killing it."""
    signal.signal(DRAIN_SIGNAL, _note)
    if drain_on_term:
        signal.signal(signal.SIGTERM, _note)


def ready() -> None:
    """From now on TERM drains (checkpoint, stop) instead of ending the process."""
    global _ready
    _ready = True


def requested() -> Optional[str]:
    """The name of the first drain signal received (SIGUSR2, SIGTERM), or None."""
    return _received


def incarnation() -> int:
    """0 for a worker's first process, k for its k-th restart by the step's supervisor."""
    return int(os.environ.get(RESTART_ENV, "0") or 0)
