"""What the cluster offers (from `sinfo`); whether a plan fits it is `spec.plan.check_fits`."""

from __future__ import annotations

import re
import subprocess
from typing import Dict, List, Optional, Sequence

from vlaslurm.spec.plan import Node, check_fits


class SlurmUnavailable(RuntimeError):
    """Slurm's commands are missing or the controller does not answer."""


# What Slurm's clients say when they find no configuration or no controller: one line, not their stderr.
UNREACHABLE = (
    "Could not establish a configuration source",
    "Unable to process configuration file",
    "Unable to contact slurm controller",
    "Connection refused",
)
UNREACHABLE_FIX = "start the cluster (slurmctld) or point SLURM_CONF at its slurm.conf"


def run_slurm(args: Sequence[str], timeout: float = 30.0) -> str:
    """Run a Slurm command and return its stdout; raise SlurmUnavailable with its stderr on failure."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmUnavailable(f"{args[0]} not found: is Slurm installed and on PATH?") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{args[0]} did not answer within {timeout:.0f} s: is slurmctld running?") from None
    if proc.returncode != 0:
        said = proc.stderr.strip() or proc.stdout.strip()
        if any(marker in said for marker in UNREACHABLE):
            last = [line.strip() for line in said.splitlines() if line.strip()][-1]
            raise SlurmUnavailable(f"Slurm is not reachable ({last}): {UNREACHABLE_FIX}")
        raise SlurmUnavailable(f"{' '.join(args[:2])} failed: {said}")
    return proc.stdout


def query_nodes() -> List[Node]:
    """Every node with its partitions, CPUs, memory, GPUs and features."""
    out = run_slurm(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%f"])
    nodes: Dict[str, Node] = {}
    for line in out.splitlines():
        name, partition, cpus, mem, gres, features = line.split("|")
        partition = partition.rstrip("*")
        old = nodes.get(name)
        partitions = (old.partitions if old else frozenset()) | {partition}
        nodes[name] = Node(
            name,
            frozenset(partitions),
            int(cpus),
            _int(mem),
            _gpus(gres),
            frozenset(f for f in features.split(",") if f and f != "(null)"),
        )
    return list(nodes.values())


def default_partition() -> Optional[str]:
    """The partition sinfo marks with '*', if any."""
    for line in run_slurm(["sinfo", "-h", "-o", "%P"]).split():
        if line.endswith("*"):
            return line.rstrip("*")
    return None


def _int(text: str) -> int:
    digits = re.match(r"\d+", text)
    return int(digits.group()) if digits else 0


def _gpus(gres: str) -> int:
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item)
        if match:
            total += int(match.group(1))
    return total


__all__ = ["Node", "SlurmUnavailable", "check_fits", "default_partition", "query_nodes", "run_slurm"]
