"""A run's progress as `vlaslurm run` and `submit --follow` show it, and the summary at its end.

Everything shown is read from the run directory: the trainer's metric line per update
(`rundir.read_metrics`) and each rank's heartbeat, so one display follows a local run and a
Slurm job alike. On a terminal it is a live `rich` display; elsewhere (a pipe, a log file, a
test) it is plain lines, and errors are printed as they come in both.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from vlaslurm.rundir import DamagedRunDir, RunDir, read_heartbeats, read_info, read_metrics

ROLE_ORDER = ("simulator", "generator", "trainer")  # the path of one sample
SILENT_S = 30.0  # a rank whose heartbeat is older is shown as silent
REFRESH_S = 0.5  # the live display reads the run directory at most this often
LINE_EVERY_S = 10.0  # plain mode: at most one progress line this often


@dataclass
class Latest:
    """What the trainer's metric lines say so far: the newest line and the segments trained on over all."""

    row: Dict[str, Any] = field(default_factory=dict)
    used_segments: int = 0

    def add(self, row: Dict[str, Any]) -> None:
        self.row = row
        self.used_segments += int(row.get("trainer/batch_segments", 0))

    @property
    def version(self) -> Optional[int]:
        return self.row.get("version")

    @property
    def version_text(self) -> str:
        return "-" if self.version is None else f"v{self.version}"

    @property
    def env_steps(self) -> int:
        return int(self.row.get("env_steps", 0))

    @property
    def success(self) -> float:
        value = self.row.get("rollout/success_rate")
        return float("nan") if value is None else float(value)

    @property
    def sps(self) -> float:
        return float(self.row.get("charts/SPS", 0.0))

    @property
    def lag_mean(self) -> float:
        return float(self.row.get("staleness/mean", 0.0))

    @property
    def lag_max(self) -> int:
        return int(self.row.get("staleness/max", 0))

    @property
    def dropped_share(self) -> float:
        """Segments dropped as stale over every segment the trainer took."""
        dropped = int(self.row.get("staleness/dropped_segments", 0))
        taken = dropped + self.used_segments
        return dropped / taken if taken else 0.0

    def line(self, total: Optional[int] = None) -> str:
        """One line: version, env steps, success, SPS, Δv, dropped share."""
        steps = f"{self.env_steps:,}" + (f"/{total:,}" if total else "")
        return (
            f"{self.version_text}  env steps {steps}  success {fmt_success(self.success)}  SPS {self.sps:,.0f}  "
            f"Δv mean {self.lag_mean:.2f} max {self.lag_max}  dropped {self.dropped_share:.1%}"
        )


def latest_metrics(run_dir: Path) -> Latest:
    """Every metric line of a run, folded."""
    latest = Latest()
    for row in read_metrics(run_dir):
        latest.add(row)
    return latest


def fmt_success(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def beat_version(beat: Dict[str, Any]) -> Optional[int]:
    """A heartbeat's policy version; None before a rank's first weights (-1) or once it finished."""
    version = beat.get("version")
    return version if isinstance(version, int) and version >= 0 else None


def fmt_version(beat: Dict[str, Any]) -> str:
    """'v7', or '-' for a heartbeat without a version."""
    version = beat_version(beat)
    return "-" if version is None else f"v{version}"


class MetricsTail:
    """The trainer's metric lines as they are appended (a line still being written waits for the next read;
    a file rewritten shorter, as a resumed trainer does, is read again from the start)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunDir(run_dir).metrics
        self.offset = 0
        self.latest = Latest()

    def read(self) -> Latest:
        try:
            size = self.path.stat().st_size
        except OSError:
            return self.latest
        if size < self.offset:
            self.offset, self.latest = 0, Latest()
        if size > self.offset:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read(size - self.offset)
            complete = data[: data.rfind(b"\n") + 1]
            self.offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                try:
                    self.latest.add(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return self.latest


class ErrorTail:
    """ERROR lines of every rank's log, each once, as they are written."""

    def __init__(self, run_dir: Path) -> None:
        self.paths = RunDir(run_dir)
        self.offsets: Dict[Path, int] = {}

    def read(self) -> List[str]:
        found = []
        for path in self.paths.role_logs():
            try:
                size = path.stat().st_size
            except OSError:
                continue
            offset = self.offsets.get(path, 0)
            if size <= offset:
                continue
            with path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read(size - offset)
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = offset + len(complete)
            found += [line for line in complete.decode(errors="replace").splitlines() if " ERROR [" in line]
        return found


def role_states(run_dir: Path, ranks: Dict[str, int], now: Optional[float] = None) -> List[Tuple[str, str]]:
    """(role, state) per role from its ranks' heartbeats: versions, the first rank's progress, who is silent."""
    now = time.time() if now is None else now
    beats: Dict[str, Dict[int, dict]] = {}
    for name, beat in read_heartbeats(run_dir).items():  # a damaged one: that rank is shown as silent
        role, _, rank = name.rpartition("-")
        if rank.isdigit():
            beats.setdefault(role, {})[int(rank)] = beat
    states = []
    for role in sorted(set(ranks) | set(beats), key=lambda r: (ROLE_ORDER + (r,)).index(r)):
        count, seen = ranks.get(role, len(beats.get(role, {}))), beats.get(role, {})
        if not count:
            continue
        if not seen:
            states.append((role, f"starting ({_ranks(count)})"))
            continue
        versions = sorted({v for v in map(beat_version, seen.values()) if v is not None})
        version = "" if not versions else f"v{versions[0]}" + (f"-{versions[-1]}" if len(versions) > 1 else "")
        first = seen[min(seen)]
        silent = [
            r
            for r, b in seen.items()
            if now - b.get("time", 0) > SILENT_S and not str(b.get("progress", "")).startswith("finished")
        ]
        parts = [version, str(first.get("progress", "")) + (f" (rank {min(seen)})" if count > 1 else "")]
        if len(seen) < count:
            parts.append(f"{count - len(seen)} of {_ranks(count)} not started")
        if silent:
            parts.append(f"{len(silent)} silent > {SILENT_S:.0f} s")
        states.append((role, "  ".join(p for p in parts if p)))
    return states


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


class Display:
    """The progress of one run: `live` (a terminal), `lines` (plain lines) or `quiet` (someone else echoes)."""

    def __init__(self, console: Console, total: int, mode: str, show_run_dir: bool = True) -> None:
        self.console, self.total, self.mode = console, total, mode
        self.show_run_dir = show_run_dir  # live mode: say where the run is before the display starts
        self.run_dir: Optional[Path] = None
        self.ranks: Dict[str, int] = {}
        self.state: Optional[str] = None
        self.started = time.time()
        self._metrics: Optional[MetricsTail] = None
        self._errors: Optional[ErrorTail] = None
        self._live: Optional[Live] = None
        self._next_read = 0.0
        self._next_line = 0.0
        self._last_line_version: Optional[int] = None

    @classmethod
    def choose(cls, console: Console, total: int, echoed: bool = False) -> Display:
        """Live on a terminal; else plain lines, or nothing where the caller already echoes progress."""
        return cls(console, total, "live" if console.is_terminal else ("quiet" if echoed else "lines"))

    @property
    def live(self) -> bool:
        return self.mode == "live"

    def __enter__(self) -> Display:
        if self.live:
            self._live = Live(Text(""), console=self.console, auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            if self.run_dir is not None:
                self._read(force=True)
            self._live.__exit__(*exc)
            self._live = None

    def tick(self, run_dir: Path, state: Optional[str] = None) -> None:
        """Read what is new in the run directory (at most every REFRESH_S) and show it."""
        if self.run_dir is None:
            self._attach(Path(run_dir))
        if self.mode == "quiet":
            return
        if state != self.state:
            self.state = state
            if self.mode == "lines" and state:
                self.console.print(f"state: {state}", markup=False)
        self._read()

    def _attach(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._metrics, self._errors = MetricsTail(run_dir), ErrorTail(run_dir)
        try:
            info = read_info(run_dir)
            self.ranks, self.started = dict(info.ranks), info.created or self.started
        except DamagedRunDir:
            pass  # a display shows what it can; `vlaslurm status` names the damage
        if self.live and self.show_run_dir:
            self.console.print(f"run dir: {run_dir}", markup=False, highlight=False)

    def _read(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_read:
            return
        self._next_read = now + REFRESH_S
        assert self._metrics is not None and self._errors is not None and self.run_dir is not None
        latest = self._metrics.read()
        for line in self._errors.read():
            self.console.print(line, markup=False, highlight=False)
        if self._live is not None:
            self._live.update(self.render(latest, role_states(self.run_dir, self.ranks)), refresh=True)
        elif (
            self.mode == "lines"
            and latest.row
            and latest.version != self._last_line_version
            and (force or now >= self._next_line)
        ):
            self._next_line, self._last_line_version = now + LINE_EVERY_S, latest.version
            self.console.print("progress " + latest.line(self.total), markup=False, highlight=False)

    def render(self, latest: Latest, states: List[Tuple[str, str]]) -> Group:
        steps, total = latest.env_steps, max(1, self.total)
        head = Table.grid(padding=(0, 2))
        head.add_row(
            ProgressBar(total=total, completed=min(steps, total), width=32),
            Text(
                f"{steps:,} / {self.total:,} env steps  {min(1.0, steps / total):.0%}  "
                f"ETA {eta(steps, self.total, latest.sps)}"
            ),
        )
        figures = Columns(
            [  # a narrow terminal flows them onto more lines, none cut in half
                f"success {fmt_success(latest.success)}",
                f"SPS {latest.sps:,.0f}",
                f"policy {latest.version_text}",
                f"Δv mean {latest.lag_mean:.2f} max {latest.lag_max}",
                f"dropped {latest.dropped_share:.1%}",
            ]
            + ([f"state {self.state}"] if self.state else []),
            padding=(0, 2),
        )
        roles = Table.grid(padding=(0, 2))
        for role, text in states:
            roles.add_row(Text(role, style="bold"), Text(text))
        return Group(head, figures, roles)

    def summary(self, outcome: str, spec_uri: Optional[str]) -> None:
        """The end: outcome, final success and SPS, the run directory, the MLflow run and how to open it
        (`spec_uri`: the spec's tracking.uri)."""
        if self.run_dir is None:
            return
        for line in summary_lines(self.run_dir, outcome, spec_uri, self.total, time.time() - self.started):
            self.console.print(line, markup=False, highlight=False)


def eta(steps: int, total: int, sps: float) -> str:
    """Time left at the run's average SPS, as h:mm:ss."""
    if steps >= total:
        return "0:00:00"
    if sps <= 0:
        return "-"
    return clock((total - steps) / sps)


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else clock(seconds)


def summary_lines(run_dir: Path, outcome: str, spec_uri: Optional[str], total: int, elapsed_s: float) -> List[str]:
    from vlaslurm.tracking.tracker import SWITCH_ENV, read_run_id, tracking_uri

    latest = latest_metrics(run_dir)
    figures = (
        (
            f": {latest.env_steps:,} of {total:,} env steps, success {fmt_success(latest.success)}, "
            f"SPS {latest.sps:,.0f}, policy {latest.version_text}"
        )
        if latest.row
        else ": no update yet"
    )
    lines = [f"{outcome} after {duration(elapsed_s)}{figures}", f"run dir  {run_dir}"]
    run_id = read_run_id(run_dir)
    if run_id:
        uri = tracking_uri(spec_uri, run_dir)
        lines.append(f"MLflow   run {run_id} in {uri}")
        lines.append(f"         open it: {ui_command(uri)}")
    elif os.environ.get(SWITCH_ENV) == "off":
        lines.append(f"MLflow   off (${SWITCH_ENV}=off)")
    else:
        lines.append("MLflow   no run recorded (see the trainer's log)")
    return lines


def ui_command(uri: str) -> str:
    """How to look at the runs of `uri`: a server is opened in a browser, a local store through `mlflow ui`."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)}"


def local_outcome(code: int) -> str:
    """A local run's end in words, from the launcher's exit code."""
    return {0: "completed", 124: "stopped at its deadline", 130: "interrupted"}.get(code, f"failed (exit code {code})")


def follow_job(
    console: Console, run_dir: Path, total: int, spec_uri: Optional[str], poll_s: float = 2.0, forgotten_s: float = 60.0
) -> int:
    """`submit --follow`: show a job's progress until it ends (0 if it completed, else its exit code or 1).

    Ctrl-C stops following; the job goes on."""
    from vlaslurm.slurm.state import is_active, run_state

    info = read_info(run_dir)
    display = Display.choose(console, total)
    display.show_run_dir = False  # submit said it
    unknown_since: Optional[float] = None
    with display:
        try:
            while True:
                state = run_state(info)
                display.tick(run_dir, state)
                if state == "UNKNOWN":  # neither Slurm nor the exit record knows: give it a while
                    unknown_since = unknown_since or time.monotonic()
                    if time.monotonic() - unknown_since > forgotten_s:
                        break
                elif not is_active(state):
                    break
                else:
                    unknown_since = None
                time.sleep(poll_s)
        except KeyboardInterrupt:
            console.print(f"stopped following; the job goes on: vlaslurm status {info.job_id or run_dir}", markup=False)
            return 130
    display.summary(state, spec_uri)
    return job_exit_code(state)


def job_exit_code(state: str) -> int:
    """COMPLETED -> 0, FAILED(n) -> n, anything else -> 1."""
    if state == "COMPLETED":
        return 0
    if state.startswith("FAILED(") and state[7:-1].lstrip("-").isdigit():
        return int(state[7:-1]) or 1
    return 1
