"""A private, single-host Slurm cluster for tests and local development.

Everything (config, munge key and socket, state, logs, pid files, fake GPU devices) lives under
one root folder (``$VLASLURM_LOCAL_SLURM`` or ``/tmp/vlaslurm-local-slurm``); nothing of the
machine's own Slurm or munge is read, written or stopped.

    python -m vlaslurm.slurm.local_cluster start|env|stop [--root DIR] [--nodes 4 --gpus 8 --cpus 32]

Details, and the Slurm 22.05 behaviour observed on it: docs/local-cluster.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ENV_ROOT = "VLASLURM_LOCAL_SLURM"
ENV_PORT = "VLASLURM_LOCAL_SLURM_PORT"
FALLBACK_ROOT = Path("/tmp/vlaslurm-local-slurm")
CLUSTER_NAME = "vlaslurm"
# AF_UNIX socket paths are limited to 108 bytes (sun_path) on Linux.
_MAX_SOCKET_PATH = 100


@dataclass(frozen=True)
class ClusterShape:
    """What the fake cluster looks like: identical nodes plus partitions."""

    nodes: int = 4
    cpus: int = 32
    gpus: int = 8
    mem_mb: int = 256000
    partitions: tuple[str, ...] = ("gpu", "cpu", "gpu-inference")
    default_partition: str = "gpu"
    features: tuple[str, ...] = ("h100",)  # node features every node has (specs' --constraint)
    node_prefix: str = "n"
    base_port: int = 16817
    cred_expire_s: int = 10
    min_job_age_s: int = 300
    kill_wait_s: int = 10
    select_params: str = "CR_Core_Memory"

    def node_names(self) -> list[str]:
        """Node names, e.g. ``['n0', 'n1', 'n2', 'n3']``."""
        return [f"{self.node_prefix}{i}" for i in range(self.nodes)]

    def slurmd_port(self, index: int) -> int:
        """Port of the slurmd serving node number ``index``."""
        return self.base_port + 1 + index

    def validate(self) -> None:
        """Raise ValueError on shapes slurm would reject or we cannot host."""
        if self.nodes < 1 or self.cpus < 1 or self.gpus < 0 or self.mem_mb < 1:
            raise ValueError(f"nodes/cpus/mem must be >= 1 and gpus >= 0: {self}")
        if not self.partitions:
            raise ValueError("at least one partition is required")
        if self.default_partition not in self.partitions:
            raise ValueError(f"default partition {self.default_partition!r} not in {self.partitions}")
        if not (1024 <= self.base_port and self.base_port + self.nodes < 65536):
            raise ValueError(f"base_port {self.base_port} out of range")

    def to_json(self) -> str:
        """Stable JSON form, stored in the root to detect shape changes."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterShape:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        data["partitions"] = tuple(data["partitions"])
        data["features"] = tuple(data.get("features", ()))
        return cls(**data)


DEFAULT_SHAPE = ClusterShape(base_port=int(os.environ.get(ENV_PORT) or ClusterShape.base_port))


@dataclass(frozen=True)
class ClusterInfo:
    """Where a started cluster lives and how to talk to it."""

    root: Path
    slurm_conf: Path
    shape: ClusterShape
    hostname: str
    env: dict[str, str]

    @property
    def nodes(self) -> list[str]:
        """Node names of the cluster."""
        return self.shape.node_names()


@dataclass
class ClusterStatus:
    """Liveness of each daemon and the state slurmctld reports per node."""

    root: Path
    configured: bool
    daemons: dict[str, int | None] = field(default_factory=dict)
    node_states: dict[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        """True when munged, slurmctld and every slurmd are alive."""
        return self.configured and bool(self.daemons) and all(pid is not None for pid in self.daemons.values())

    @property
    def ready(self) -> bool:
        """True when running and every node is usable (idle/mixed/allocated)."""
        return self.running and bool(self.node_states) and all(_node_usable(s) for s in self.node_states.values())

    def describe(self) -> str:
        """Human-readable multi-line summary."""
        lines = [
            f"root: {self.root}",
            f"configured: {self.configured}",
            f"running: {self.running}",
            f"ready: {self.ready}",
        ]
        lines += [f"  {name}: {'pid ' + str(pid) if pid else 'not running'}" for name, pid in self.daemons.items()]
        lines += [f"  node {n}: {s}" for n, s in self.node_states.items()]
        return "\n".join(lines)


class LocalClusterError(RuntimeError):
    """Start/stop failed; the message names the daemon and its log file."""


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    """All paths under the private root."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        return self.etc / "gres.conf"

    @property
    def plugstack(self) -> Path:
        return self.etc / "plugstack.conf"

    @property
    def shape_file(self) -> Path:
        return self.etc / "shape.json"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def munge_seed(self) -> Path:
        return self.munge_dir / "munged.seed"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    def pid_file(self, daemon: str) -> Path:
        """Pid file of ``munged``, ``slurmctld`` or ``slurmd-<node>``."""
        return self.run / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        """Log file of ``munged``, ``slurmctld`` or ``slurmd-<node>``."""
        return self.log / f"{daemon}.log"


def default_root() -> Path:
    """``$VLASLURM_LOCAL_SLURM`` if set, else ``/tmp/vlaslurm-local-slurm``."""
    value = os.environ.get(ENV_ROOT)
    return Path(value) if value else FALLBACK_ROOT


def _resolve(root: Path | str | None) -> _Layout:
    return _Layout(Path(root).absolute() if root else default_root().absolute())


# ---------------------------------------------------------------- config


def _hostname() -> str:
    """Short hostname; slurmctld refuses to run unless it matches SlurmctldHost."""
    return socket.gethostname().split(".")[0]


def render_slurm_conf(lay: _Layout, shape: ClusterShape, hostname: str) -> str:
    """Text of slurm.conf for ``shape`` rooted at ``lay.root``."""
    sockets_opt = f"socket={lay.munge_socket},cred_expire={shape.cred_expire_s}"
    lines = [
        "# Generated by vlaslurm.slurm.local_cluster -- do not edit, re-run start.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={shape.base_port}",
        f"SlurmdPort={shape.slurmd_port(0)}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo={sockets_opt}",
        f"StateSaveLocation={lay.state}",
        f"SlurmdSpoolDir={lay.spool}/slurmd-%n",
        f"SlurmctldPidFile={lay.pid_file('slurmctld')}",
        f"SlurmdPidFile={lay.run}/slurmd-%n.pid",
        f"SlurmctldLogFile={lay.log_file('slurmctld')}",
        f"SlurmdLogFile={lay.log}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"PlugStackConfig={lay.plugstack}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SchedulerType=sched/backfill",
        # Hetjobs are only started by backfill; poll it every second.
        "SchedulerParameters=bf_interval=1,sched_interval=2",
        "SelectType=select/cons_tres",
        f"SelectTypeParameters={shape.select_params}",
        f"DefMemPerCPU={max(1, shape.mem_mb // shape.cpus)}",
        "GresTypes=gpu",
        # Nodes declare more CPUs/GPUs/memory than this machine has.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "JobRequeue=1",
        f"MinJobAge={shape.min_job_age_s}",
        f"KillWait={shape.kill_wait_s}",
        "InactiveLimit=0",
        "MailProg=/bin/true",
        f"TmpFS={lay.root / 'tmp'}",
    ]
    for i, node in enumerate(shape.node_names()):
        gres = f" Gres=gpu:{shape.gpus}" if shape.gpus else ""
        features = f" Feature={','.join(shape.features)}" if shape.features else ""
        lines.append(
            f"NodeName={node} NodeHostname={hostname} NodeAddr=127.0.0.1 "
            f"Port={shape.slurmd_port(i)} CPUs={shape.cpus} Boards=1 "
            f"SocketsPerBoard=1 CoresPerSocket={shape.cpus} ThreadsPerCore=1 "
            f"RealMemory={shape.mem_mb}{gres}{features} State=UNKNOWN"
        )
    nodelist = ",".join(shape.node_names())
    for part in shape.partitions:
        default = "YES" if part == shape.default_partition else "NO"
        lines.append(f"PartitionName={part} Nodes={nodelist} Default={default} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def render_gres_conf(lay: _Layout, shape: ClusterShape) -> str:
    """gres.conf giving every node its own fake GPU device files."""
    lines = ["AutoDetect=off"]
    if shape.gpus:
        for node in shape.node_names():
            last = shape.gpus - 1
            files = f"{lay.dev}/{node}/nvidia[0-{last}]" if last else f"{lay.dev}/{node}/nvidia0"
            lines.append(f"NodeName={node} Name=gpu File={files}")
    return "\n".join(lines) + "\n"


def _make_dirs(lay: _Layout, shape: ClusterShape) -> None:
    """Create the private tree; munged insists on non-world-writable dirs."""
    lay.root.mkdir(parents=True, exist_ok=True)
    os.chmod(lay.root, 0o755)
    for d in (lay.etc, lay.run, lay.log, lay.state, lay.spool, lay.dev, lay.root / "tmp"):
        d.mkdir(exist_ok=True)
    lay.munge_dir.mkdir(exist_ok=True)
    os.chmod(lay.munge_dir, 0o755)  # munged: socket dir must be o+x, not writable
    for node in shape.node_names():
        (lay.spool / f"slurmd-{node}").mkdir(exist_ok=True)


def _make_fake_gpus(lay: _Layout, shape: ClusterShape) -> None:
    """mknod char devices (1,3 == /dev/null) that slurm accepts as GPUs."""
    for node in shape.node_names():
        node_dir = lay.dev / node
        node_dir.mkdir(exist_ok=True)
        for g in range(shape.gpus):
            path = node_dir / f"nvidia{g}"
            if not path.is_char_device():
                if path.exists() or path.is_symlink():
                    path.unlink()
                os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))


def _make_munge_key(lay: _Layout) -> None:
    """A fresh 1 KiB key, mode 0400 as munged requires; kept across restarts."""
    if lay.munge_key.exists():
        return
    fd = os.open(lay.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as fh:
        fh.write(os.urandom(1024))


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _write_config(lay: _Layout, shape: ClusterShape, hostname: str) -> None:
    _write_if_changed(lay.slurm_conf, render_slurm_conf(lay, shape, hostname))
    _write_if_changed(lay.gres_conf, render_gres_conf(lay, shape))
    _write_if_changed(lay.plugstack, "# intentionally empty: no SPANK plugins\n")
    _write_if_changed(lay.shape_file, shape.to_json() + "\n")


# ---------------------------------------------------------------- processes


def _daemon_names(shape: ClusterShape) -> list[str]:
    return ["munged", "slurmctld"] + [f"slurmd-{n}" for n in shape.node_names()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _live_pid(lay: _Layout, daemon: str) -> int | None:
    """Pid from the daemon's pid file if that process is ours and alive.

    A pid is only trusted when its command line mentions this root, so a
    stale pid file whose pid was recycled never makes us signal a stranger.
    """
    try:
        pid = int(lay.pid_file(daemon).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    cmd = _cmdline(pid)
    if not cmd or str(lay.root) not in cmd:
        return None
    try:
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return None  # zombie: dead but not yet reaped
    except OSError:
        return None
    return pid


def _require_binaries() -> None:
    missing = [
        b
        for b in ("munged", "slurmctld", "slurmd", "sinfo", "scontrol")
        if shutil.which(b) is None and not Path("/usr/sbin", b).exists()
    ]
    if missing:
        raise LocalClusterError(
            f"missing Slurm/munge binaries {missing}; install with "
            "`apt-get install slurm-wlm munge` (Debian) or put them on PATH"
        )


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    return str(Path("/usr/sbin") / name)


def _run_daemon(lay: _Layout, daemon: str, argv: list[str], env: dict[str, str]) -> None:
    """Launch a self-daemonizing daemon and wait for its pid file."""
    stale = lay.pid_file(daemon)
    if stale.exists():
        stale.unlink()  # not live (checked by caller): stale
    boot_log = lay.log / f"{daemon}.boot.log"
    with open(boot_log, "ab") as out:
        proc = subprocess.run(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False
        )
    if proc.returncode != 0:
        raise LocalClusterError(
            f"{daemon} failed to start (exit {proc.returncode}); see {boot_log} and {lay.log_file(daemon)}"
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _live_pid(lay, daemon) is not None:
            return
        time.sleep(0.1)
    raise LocalClusterError(
        f"{daemon} did not come up (no live pid in {lay.pid_file(daemon)}); see {lay.log_file(daemon)} and {boot_log}"
    )


def _port_free(port: int) -> bool:
    """True if nothing listens on ``port`` (slurm binds 0.0.0.0 with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _check_ports(lay: _Layout, shape: ClusterShape) -> None:
    """Fail early, and clearly, if a port we still need to bind is taken."""
    wanted = [] if _live_pid(lay, "slurmctld") else [("slurmctld", shape.base_port)]
    wanted += [
        (f"slurmd-{n}", shape.slurmd_port(i))
        for i, n in enumerate(shape.node_names())
        if _live_pid(lay, f"slurmd-{n}") is None
    ]
    busy = [f"{d} port {p}" for d, p in wanted if not _port_free(p)]
    if busy:
        raise LocalClusterError(
            f"ports in use: {', '.join(busy)} (another Slurm or local cluster?); "
            "stop it or pick another base port with --port / ClusterShape(base_port=...)"
        )


def _start_munged(lay: _Layout, env: dict[str, str]) -> None:
    _run_daemon(
        lay,
        "munged",
        [
            _binary("munged"),
            f"--socket={lay.munge_socket}",
            f"--key-file={lay.munge_key}",
            f"--pid-file={lay.pid_file('munged')}",
            f"--log-file={lay.log_file('munged')}",
            f"--seed-file={lay.munge_seed}",
        ],
        env,
    )


def _start_slurmctld(lay: _Layout, env: dict[str, str]) -> None:
    # -c: clear saved job state so every start is a clean, predictable cluster.
    _run_daemon(lay, "slurmctld", [_binary("slurmctld"), "-c", "-f", str(lay.slurm_conf)], env)


def _start_slurmd(lay: _Layout, node: str, env: dict[str, str]) -> None:
    _run_daemon(lay, f"slurmd-{node}", [_binary("slurmd"), "-N", node, "-f", str(lay.slurm_conf)], env)


def _slurm_env(lay: _Layout) -> dict[str, str]:
    """Process environment for daemons and clients of this cluster."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(env(lay.root))
    return base


def _node_usable(state: str) -> bool:
    s = state.upper()
    bad = ("DOWN", "DRAIN", "FAIL", "UNKNOWN", "NOT_RESPONDING", "INVAL", "FUTURE")
    return not any(b in s for b in bad) and any(g in s for g in ("IDLE", "MIXED", "ALLOCATED", "COMPLETING"))


def _query_node_states(lay: _Layout) -> dict[str, str]:
    """``{node: State}`` from ``scontrol -o show nodes``; {} if unreachable."""
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "nodes"],
            env=_slurm_env(lay),
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states: dict[str, str] = {}
    for line in out.stdout.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "NodeName" in fields:
            states[fields["NodeName"]] = fields.get("State", "?")
    return states


def _wait_ready(lay: _Layout, shape: ClusterShape, timeout_s: float) -> None:
    """Block until every node is idle; otherwise explain which one is not."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        for daemon in _daemon_names(shape):
            if _live_pid(lay, daemon) is None:
                raise LocalClusterError(f"{daemon} died during start-up; see {lay.log_file(daemon)}")
        states = _query_node_states(lay)
        if states and all(_node_usable(states.get(n, "")) for n in shape.node_names()):
            return
        time.sleep(0.5)
    if not states:
        raise LocalClusterError(f"slurmctld did not answer within {timeout_s:.0f}s; see {lay.log_file('slurmctld')}")
    bad = {n: states.get(n, "missing") for n in shape.node_names() if not _node_usable(states.get(n, ""))}
    hints = ", ".join(f"{n}={s} (log {lay.log_file('slurmd-' + n)})" for n, s in bad.items())
    raise LocalClusterError(f"nodes not idle after {timeout_s:.0f}s: {hints}; also see {lay.log_file('slurmctld')}")


# ---------------------------------------------------------------- public API


def env(root: Path | str | None = None) -> dict[str, str]:
    """Environment variables that point Slurm clients at this cluster."""
    lay = _resolve(root)
    return {"SLURM_CONF": str(lay.slurm_conf), ENV_ROOT: str(lay.root)}


def status(root: Path | str | None = None) -> ClusterStatus:
    """Which daemons are alive and what slurmctld says about each node."""
    lay = _resolve(root)
    if not lay.shape_file.exists():
        return ClusterStatus(root=lay.root, configured=False)
    shape = ClusterShape.from_json(lay.shape_file.read_text())
    st = ClusterStatus(root=lay.root, configured=True, daemons={d: _live_pid(lay, d) for d in _daemon_names(shape)})
    if st.daemons.get("slurmctld"):
        st.node_states = _query_node_states(lay)
    return st


def start(root: Path | str | None = None, shape: ClusterShape = DEFAULT_SHAPE, timeout_s: float = 60.0) -> ClusterInfo:
    """Start (or reuse) the private cluster and wait until all nodes are idle.

    Idempotent: daemons already running from this root are left alone. A
    running cluster with a different shape is an error (stop it first).
    """
    shape.validate()
    _require_binaries()
    lay = _resolve(root)
    if len(str(lay.munge_socket)) > _MAX_SOCKET_PATH:
        raise LocalClusterError(f"root {lay.root} is too long for a unix socket path; pick a shorter --root")
    hostname = _hostname()
    current = status(lay.root)
    if current.configured and any(current.daemons.values()):
        old = ClusterShape.from_json(lay.shape_file.read_text())
        if old != shape:
            raise LocalClusterError(
                f"a cluster with a different shape is running at {lay.root}; "
                f"run `python -m vlaslurm.slurm.local_cluster stop --root {lay.root}` first"
            )
    _check_ports(lay, shape)
    _make_dirs(lay, shape)
    _make_fake_gpus(lay, shape)
    _make_munge_key(lay)
    _write_config(lay, shape, hostname)
    denv = _slurm_env(lay)
    if _live_pid(lay, "munged") is None:
        _start_munged(lay, denv)
    if _live_pid(lay, "slurmctld") is None:
        _start_slurmctld(lay, denv)
    for node in shape.node_names():
        if _live_pid(lay, f"slurmd-{node}") is None:
            _start_slurmd(lay, node, denv)
    _wait_ready(lay, shape, timeout_s)
    return ClusterInfo(root=lay.root, slurm_conf=lay.slurm_conf, shape=shape, hostname=hostname, env=env(lay.root))


def _cancel_all_jobs(lay: _Layout) -> None:
    """scancel every job so slurmstepd/job processes do not outlive slurmd."""
    senv = _slurm_env(lay)
    try:
        subprocess.run(["scancel", "--full", "--user", "root"], env=senv, capture_output=True, timeout=15, check=False)
        subprocess.run(["scancel", "--full"] + _job_ids(senv), env=senv, capture_output=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _job_ids(senv):
        time.sleep(0.5)


def _job_ids(senv: dict[str, str]) -> list[str]:
    try:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%A"], env=senv, capture_output=True, text=True, timeout=15, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def _kill(lay: _Layout, daemon: str, timeout_s: float = 15.0) -> None:
    """SIGTERM then SIGKILL one of our daemons, identified by its pid file."""
    pid = _live_pid(lay, daemon)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _live_pid(lay, daemon) == pid:
            time.sleep(0.1)
        if _live_pid(lay, daemon) == pid:
            os.kill(pid, signal.SIGKILL)
    lay.pid_file(daemon).unlink(missing_ok=True)


def stop(root: Path | str | None = None) -> None:
    """Cancel jobs and stop this root's daemons (only those, by pid file)."""
    lay = _resolve(root)
    if not lay.shape_file.exists():
        return
    shape = ClusterShape.from_json(lay.shape_file.read_text())
    if _live_pid(lay, "slurmctld") is not None:
        _cancel_all_jobs(lay)
    # slurmds first, then the controller, munged last (others need it to exit).
    for node in shape.node_names():
        _kill(lay, f"slurmd-{node}")
    _kill(lay, "slurmctld")
    _kill(lay, "munged")


# ---------------------------------------------------------------- CLI


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m vlaslurm.slurm.local_cluster", description="Private local Slurm cluster for vlaslurm."
    )
    p.add_argument("command", choices=["start", "stop", "status", "env", "restart"])
    p.add_argument("--root", type=Path, default=None, help=f"private folder (default ${ENV_ROOT} or {FALLBACK_ROOT})")
    d = DEFAULT_SHAPE
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--cpus", type=int, default=d.cpus, help="CPUs per node")
    p.add_argument("--gpus", type=int, default=d.gpus, help="fake GPUs per node")
    p.add_argument("--mem", type=int, default=d.mem_mb, help="MB per node")
    p.add_argument(
        "--partitions", default=",".join(d.partitions), help="comma list; the first is the default partition"
    )
    p.add_argument(
        "--features",
        default=",".join(d.features),
        help="comma list of node features (for --constraint); empty for none",
    )
    p.add_argument("--port", type=int, default=d.base_port, help="slurmctld port; slurmd i listens on port+1+i")
    p.add_argument("--min-job-age", type=int, default=d.min_job_age_s)
    p.add_argument("--timeout", type=float, default=60.0, help="start deadline (s)")
    return p.parse_args(argv)


def _shape_from_args(a: argparse.Namespace) -> ClusterShape:
    parts = tuple(x for x in a.partitions.split(",") if x)
    return ClusterShape(
        nodes=a.nodes,
        cpus=a.cpus,
        gpus=a.gpus,
        mem_mb=a.mem,
        partitions=parts,
        default_partition=parts[0] if parts else "",
        features=tuple(x for x in a.features.split(",") if x),
        base_port=a.port,
        min_job_age_s=a.min_job_age,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    a = _parse(argv)
    try:
        if a.command in ("stop", "restart"):
            stop(a.root)
        if a.command in ("start", "restart"):
            info = start(a.root, _shape_from_args(a), timeout_s=a.timeout)
            print(
                f"local slurm cluster ready at {info.root} "
                f"({info.shape.nodes} nodes x {info.shape.gpus} GPUs); "
                f'eval "$(python -m vlaslurm.slurm.local_cluster env'
                f'{" --root " + str(info.root) if a.root else ""})"'
            )
        elif a.command == "status":
            st = status(a.root)
            print(st.describe())
            return 0 if st.ready else 1
        elif a.command == "env":
            for k, v in env(a.root).items():
                print(f"export {k}={shlex.quote(v)}")
    except LocalClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
