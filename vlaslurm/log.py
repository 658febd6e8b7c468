"""One logger for the package; every line says which role, rank and policy version.

Level from $VLASLURM_LOG_LEVEL (default INFO).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

_CONTEXT = {"role": "-", "rank": "-", "version": "-"}
_FORMAT = "%(asctime)s %(levelname)s [%(role)s:%(rank)s v%(version)s] %(name)s: %(message)s"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def get_logger(name: str = "vlaslurm") -> logging.Logger:
    """A child of the package logger (configured once, on first use)."""
    root = logging.getLogger("vlaslurm")
    if not getattr(root, "_vlaslurm_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_ContextFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("VLASLURM_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        root._vlaslurm_configured = True  # type: ignore[attr-defined]
    return logging.getLogger(name)


def set_context(role: Optional[str] = None, rank: Optional[int] = None, version: Optional[int] = None) -> None:
    """Set what every later log line of this process reports."""
    for key, value in (("role", role), ("rank", rank), ("version", version)):
        if value is not None:
            _CONTEXT[key] = str(value)
