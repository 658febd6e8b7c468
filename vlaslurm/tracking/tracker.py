"""The run's MLflow writer: one per run, in trainer rank 0, never on the training path.

A background thread follows what the run already writes (metrics, counters,
see `follow.py`) into a bounded buffer and sends metrics, system counters, params and artifacts
to MLflow, retrying itself with a capped backoff and dropping (and counting) the oldest rows when
the buffer is full. `close(timeout_s)` flushes what it can before its deadline.
Details (what is sent when): docs/tracking.md
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from vlaslurm.log import get_logger
from vlaslurm.rundir import (
    RunDir,
    final_env_steps,
    index_path,
    layout,
    read_info,
    read_ledger,
    read_metrics,
    write_atomic,
)
from vlaslurm.tracking.buffer import Row, RowBuffer
from vlaslurm.tracking.follow import RunFollower, numeric
from vlaslurm.tracking.params import placement_params, run_tags, spec_params

log = get_logger("vlaslurm.tracking")

RUN_ID_FILE = layout.MLFLOW_RUN_ID
STATE_DIR = layout.TRACKING  # <run_dir>/tracking/: what the tracker writes besides mlflow_run_id
SWITCH_ENV = "VLASLURM_TRACKING"  # "off" turns tracking off
CLOSE_ENV = "VLASLURM_TRACKING_CLOSE_S"  # close deadline (default 10 s)
# The most a run's normal end waits for the writer's own start (MLflow's import, a new SQLite store's schema):
# seconds, tens on a busy node, and local work, not an outage that close's deadline is for.
STARTUP_WAIT_S = 120.0
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch
MAX_PARAMS = 100  # ... and of params
# MLflow error codes that mean "never": dropped (and counted) rather than retried.
REFUSED = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "PERMISSION_DENIED"}


def runs_root_of(run_dir: Path) -> Path:
    """`<runs_root>/<name>/<stamp>` -> `<runs_root>`: the nearest ancestor holding the runs index, else
    the grandparent (a `--run-dir` outside the runs root has no link to it: the run info does not name it)."""
    run_dir = Path(run_dir).resolve()
    for parent in run_dir.parents[:3]:
        if index_path(parent).exists():
            return parent
    return run_dir.parent.parent


def default_uri(runs_root: Path) -> str:
    """An embedded SQLite database under the runs root (fine for one machine; use a server on a cluster)."""
    return f"sqlite:///{Path(runs_root).resolve() / 'mlflow.db'}"


def tracking_uri(uri: Optional[str], run_dir: Path) -> str:
    """The spec's `tracking.uri`, else the SQLite database under the run's runs root."""
    return uri or default_uri(runs_root_of(run_dir))


def read_run_id(run_dir: Path) -> Optional[str]:
    """The MLflow run id of a run directory, if its tracker created one."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() or None if path.exists() else None


def metric_name(text: str) -> str:
    """`text` with what MLflow refuses in a metric key replaced by `_` (task names are free text)."""
    return re.sub(r"[^\w\-. :/]", "_", str(text))


def quiet_mlflow_client(timeout_s: int) -> None:
    """Make MLflow's HTTP client fail fast (no retries of its own, short timeout); process-wide."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(timeout_s)))
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def prepare_sqlite(uri: str) -> None:
    """Create a new SQLite database under a temporary name and link it into place when complete.

    Creating MLflow's schema runs every migration (seconds, more on a busy node); a
    run that ends meanwhile must not leave a half-migrated database behind, which
    MLflow would refuse for every later run. Concurrent creators: the first link wins.
    """
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///") :])
    if path.exists():
        return
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.init-{os.getpid()}")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


Task = Tuple[str, Callable[[Any], None]]  # (name, run it with the MlflowClient)


class Tracker:
    """Logs one run directory to MLflow from a background thread; see the module docstring."""

    def __init__(
        self,
        run_dir: Path,
        uri: str,
        experiment: str,
        capacity: int = 10_000,
        poll_s: float = 1.0,
        request_timeout_s: int = 5,
        max_backoff_s: float = 8.0,
        close_timeout_s: Optional[float] = None,
        follow: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.uri, self.experiment = uri, experiment
        self.poll_s, self.request_timeout_s, self.max_backoff_s = poll_s, request_timeout_s, max_backoff_s
        self.close_timeout_s = close_timeout_s if close_timeout_s is not None else float(os.environ.get(CLOSE_ENV, 10))
        self.buffer = RowBuffer(capacity)
        self._state = self._sent_state()
        sent, sent_evals = self._state.get("sent_line", 0), self._state.get("sent_eval_line", 0)
        self.follower: Optional[RunFollower] = RunFollower(self.run_dir, sent, sent_evals) if follow else None
        self.run_id = read_run_id(self.run_dir)
        self.sent_rows = 0
        self.failures = 0
        self.last_error: Optional[str] = None
        self._tasks: Deque[Task] = deque()
        self._client: Any = None  # the MlflowClient, made on first use (mlflow is imported lazily)
        self._next_try = 0.0
        self._backoff = 0.5
        self._failing = False
        self._deadline = float("inf")
        self._status: Optional[str] = None
        self._stop = threading.Event()
        self._started = threading.Event()  # the writer has made its MLflow client, or failed to
        self._thread = threading.Thread(target=self._loop, name="vlaslurm-tracker", daemon=True)

    # ----------------------------------------------------------------- the caller's side (never blocks)

    def start(self) -> Tracker:
        """Queue the params and the first artifacts, and start the writer thread."""
        self._tasks.append(("params", self._log_params))
        paths = RunDir(self.run_dir)
        for path in (paths.spec, paths.info, paths.job_script):
            self.log_artifact(path)
        for path in sorted(self.run_dir.glob(layout.PROFILE_ARTIFACTS)):
            self.log_artifact(path)
        self._thread.start()
        log.info("tracking to %s (experiment %r)", self.uri, self.experiment)
        return self

    def log(self, metrics: Dict[str, float], step: int, timestamp_ms: Optional[int] = None) -> None:
        """Queue metric values of one step (any thread; returns at once)."""
        row = Row(numeric(metrics), int(step), timestamp_ms or int(time.time() * 1000))
        if row.metrics:
            self.buffer.put(row)

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        """Queue a file or folder of the run for upload (skipped if it does not exist when its turn comes)."""
        self._tasks.append(
            (f"artifact {Path(path).name}", lambda client: self._upload(client, Path(path), artifact_path))
        )

    def close(
        self, timeout_s: Optional[float] = None, status: Optional[str] = None, wait_for_start: bool = True
    ) -> Dict[str, object]:
        """Add the final metrics and artifacts, flush until the deadline, and return a summary.

        The deadline counts from the writer's start: a run that ends normally first waits (up to
        `STARTUP_WAIT_S`) for the writer to import MLflow and open its store, if it has not yet; one that
        fails, or drains before a requeue (`wait_for_start=False`: Slurm's kill is near), does not.

        The run's MLflow status: `status`, else FAILED when called while an exception propagates
        (from a `finally`), KILLED for an interrupt or a run stopped short of rollout.total_env_steps
        (a drain before a requeue) whose final summary does not cover it (`_final_status`: a run that reached
        rollout.stop_at_success has one), FINISHED otherwise.
        """
        timeout_s = self.close_timeout_s if timeout_s is None else timeout_s
        exc = sys.exc_info()[1]
        if status is None and exc is not None:
            status = "KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "FAILED"
        self._status = status
        # A run shorter than the writer's start would otherwise end untracked (seen: a Slurm job whose MLflow import
        # took 17 s).
        starting = wait_for_start and exc is None and self._thread.is_alive()
        if starting and not self._started.wait(STARTUP_WAIT_S):
            log.warning("tracking: MLflow's client still not ready after waiting %g s at the run's end", STARTUP_WAIT_S)
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 1.0)
        summary = self.summary()
        lost = summary["pending_rows"] or summary["pending_tasks"]
        (log.warning if lost or summary["dropped_rows"] else log.info)(
            "tracking closed: run %s, %d rows sent, %d dropped from a full buffer, %d rows and %d uploads not sent%s",
            self.run_id,
            self.sent_rows,
            self.buffer.dropped_rows,
            summary["pending_rows"],
            summary["pending_tasks"],
            f" (last error: {self.last_error})" if lost else "",
        )
        return summary

    def summary(self) -> Dict[str, object]:
        return {
            "run_id": self.run_id,
            "uri": self.uri,
            "sent_rows": self.sent_rows,
            "dropped_rows": self.buffer.dropped_rows,
            "pending_rows": len(self.buffer),
            "pending_tasks": len(self._tasks),
            "failures": self.failures,
            "last_error": self.last_error,
        }

    # ----------------------------------------------------------------- the writer thread

    def _loop(self) -> None:
        try:
            quiet_mlflow_client(self.request_timeout_s)
            while not self._stop.is_set():
                self._collect()
                self._send()
                self._stop.wait(self.poll_s)
            self._collect()
            self._add_final()
            while time.monotonic() < self._deadline:
                self._send()
                if not len(self.buffer) and not self._tasks:
                    return
                time.sleep(max(0.05, min(self._next_try - time.monotonic(), self._deadline - time.monotonic())))
        except Exception:  # the writer must never take the run down
            log.exception("tracking writer stopped")

    def _collect(self) -> None:
        if self.follower is None:
            return
        try:
            for row in self.follower.poll():
                self.buffer.put(row)
            for path in self.follower.new_failures():  # failures/<task>/, or evals/v<version>/failures/<task>/
                self.log_artifact(path, path.parent.relative_to(self.follower.run_dir).as_posix())
        except OSError as exc:
            log.debug("tracking: cannot read the run directory yet: %s", exc)

    def _send(self) -> None:
        """Everything buffered, then the queued tasks; on failure back off (doubling, capped)."""
        if time.monotonic() < self._next_try:
            return
        try:
            client = self._ensure_run()
            while len(self.buffer):
                rows = self.buffer.head(MAX_BATCH)
                self._attempt(
                    functools.partial(self._send_rows, client, rows), functools.partial(self._reject_rows, rows)
                )
            while self._tasks:
                name, task = self._tasks[0]
                self._attempt(
                    functools.partial(task, client), functools.partial(log.warning, "tracking: gave up on %s", name)
                )
                self._tasks.popleft()
        except Exception as exc:  # MlflowException, requests' errors, sqlite's: all mean "later"
            self._failed(exc)
            return
        if self._failing:
            log.info("tracking server reachable again; the buffer caught up (%d rows sent so far)", self.sent_rows)
        self._failing, self._backoff = False, 0.5

    def _attempt(self, action: Callable[[], None], give_up: Callable[[], None]) -> None:
        """Run `action`; if the server refuses it for good (a bad value, a deleted run), `give_up` instead
        of retrying forever. Any other error propagates: the server is away, try again later."""
        try:
            action()
        except Exception as exc:
            if getattr(exc, "error_code", None) not in REFUSED:
                raise
            self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            give_up()

    def _reject_rows(self, rows: List[Row]) -> None:
        log.warning("tracking: the server refused %d metric rows (%s); dropped", len(rows), self.last_error)
        self.buffer.pop(rows)
        self.buffer.dropped_rows += len(rows)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if not self._failing:
            log.warning(
                "tracking server %s unavailable (%s); buffering (%d rows) and retrying",
                self.uri,
                self.last_error,
                len(self.buffer),
            )
        self._failing = True
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.max_backoff_s)

    def _send_rows(self, client, rows: List[Row]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, row.timestamp_ms, row.step) for row in rows for key, value in row.metrics.items()]
        client.log_batch(self.run_id, metrics=metrics)
        self.buffer.pop(rows)
        self.sent_rows += len(rows)
        sent = {
            "sent_line": [row.line for row in rows if row.line is not None],
            "sent_eval_line": [row.eval_line for row in rows if row.eval_line is not None],
        }
        if any(sent.values()):
            self._state.update({key: max(lines) for key, lines in sent.items() if lines})
            self._save_state(self._state)

    def _ensure_run(self):
        if self._client is None:
            try:
                from mlflow.tracking import MlflowClient

                prepare_sqlite(self.uri)
                self._client = MlflowClient(tracking_uri=self.uri)
            finally:
                self._started.set()
        if self.run_id is None:
            info = read_info(self.run_dir) if RunDir(self.run_dir).holds_run() else None
            run = self._client.create_run(
                self._experiment_id(),
                start_time=int((info.created if info else time.time()) * 1000),
                tags=run_tags(self.run_dir),
                run_name=f"{info.name if info else self.run_dir.parent.name}/{self.run_dir.name}",
            )
            self.run_id = run.info.run_id
            _write(self.run_dir / RUN_ID_FILE, self.run_id + "\n")
            log.info("MLflow run %s", self.run_id)
        return self._client

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:"):  # else MLflow would put artifacts in ./mlruns of the cwd
            location = (runs_root_of(self.run_dir) / layout.MLARTIFACTS).resolve().as_uri()
        try:
            return self._client.create_experiment(self.experiment, artifact_location=location)
        except MlflowException:  # another run created it meanwhile
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, client) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in {**spec_params(self.run_dir), **placement_params(self.run_dir)}.items()]
        for start in range(0, len(params), MAX_PARAMS):
            client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS])

    def _upload(self, client, path: Path, artifact_path: Optional[str]) -> None:
        if path.is_dir():
            client.log_artifacts(self.run_id, str(path), artifact_path or path.name)
        elif path.exists():
            client.log_artifact(self.run_id, str(path), artifact_path)

    def _add_final(self) -> None:
        """Metrics only the ledger knows, the end-of-run artifacts and the run's status."""
        step = self.follower.env_steps if self.follower else 0
        try:
            self._ledger_metrics(step)
        except Exception as exc:  # a missing or odd ledger must not cost the other metrics
            log.warning("tracking: no ledger metrics (%s)", exc)
        self.log({"tracking/dropped_rows": self.buffer.dropped_rows}, step)
        paths = RunDir(self.run_dir)
        for path in (paths.ledger, paths.metrics, paths.counters):
            self.log_artifact(path)
        self.log_artifact(paths.tracking / layout.TRACKER_FAILED, STATE_DIR)
        status = self._status or self._final_status(step)
        self._tasks.append(("terminate", lambda client: client.set_terminated(self.run_id, status)))

    def _ledger_metrics(self, step: int) -> None:
        from vlaslurm.tracking import stats

        if not RunDir(self.run_dir).ledger.exists():
            return
        ledger = read_ledger(self.run_dir)
        now = int(time.time() * 1000)
        self.log({f"ledger/{k}": v for k, v in stats.lag_stats(ledger).items()}, step, now)
        steps = sorted({row_step for row_step in self._metric_steps()})
        for task, rows in stats.task_success_by_step(ledger, steps).groupby("task"):
            for row in rows.itertuples():
                self.log({f"rollout/success_rate/{metric_name(task)}": row.success_rate}, int(row.step), now)
        failed = stats.failed_trajectories(ledger)
        if failed:
            _write(RunDir(self.run_dir).tracking / layout.TRACKER_FAILED, json.dumps(failed, indent=1))

    def _metric_steps(self) -> List[int]:
        return [int(r["env_steps"]) for r in read_metrics(self.run_dir) if isinstance(r.get("env_steps"), (int, float))]

    def _final_status(self, step: int) -> str:
        """FINISHED for a run that reached its total or whose final summary covers `step` (one that reached
        rollout.stop_at_success ends short of the total), else KILLED (drained before a requeue; a summary from
        an earlier end, before a resume to train longer, does not cover the steps since)."""
        total = spec_params(self.run_dir).get("rollout.total_env_steps")
        ended = total is None or step >= int(total) or final_env_steps(self.run_dir) >= step
        return "FINISHED" if ended else "KILLED"

    def _sent_state(self) -> Dict[str, int]:
        """The last metrics line and evals-log line an earlier tracker of this run sent (0 when none)."""
        path = RunDir(self.run_dir).tracking / layout.TRACKER_STATE
        try:
            saved = json.loads(path.read_text())
            return {key: int(saved.get(key, 0)) for key in ("sent_line", "sent_eval_line")}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save_state(self, state: Dict[str, int]) -> None:
        _write(RunDir(self.run_dir).tracking / layout.TRACKER_STATE, json.dumps(state))


class NoTracker:
    """What `open_tracker` returns when tracking is off: every call does nothing."""

    run_id = None

    def log(self, metrics: Dict[str, float], step: int, timestamp_ms: Optional[int] = None) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        pass

    def close(
        self, timeout_s: Optional[float] = None, status: Optional[str] = None, wait_for_start: bool = True
    ) -> Dict[str, object]:
        return {}


def open_tracker(tracking, run_dir: Path, **options) -> Tracker | NoTracker:
    """The started tracker of a run (trainer rank 0; `tracking`: the spec's TrackingConfig), or a no-op one
    when $VLASLURM_TRACKING=off.

    Never raises: a tracker that cannot start costs the run its MLflow records, not its training.
    """
    if os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return NoTracker()
    try:
        return Tracker(run_dir, tracking_uri(tracking.uri, run_dir), tracking.experiment, **options).start()
    except Exception as exc:
        log.warning("tracking disabled for this run: %s", exc)
        return NoTracker()


def sync_run(run_dir: Path, uri: Optional[str] = None, timeout_s: float = 120.0) -> Dict[str, object]:
    """Send what a run's tracker did not (tracking was off, or the server was away at the end).

    Resumes after the last metrics row the tracker sent (its state file under `RunDir.tracking`) into the
    run's MLflow run (`mlflow_run_id`), or a new one; the final metrics and artifacts again.
    """
    import yaml

    run_dir = Path(run_dir)
    tracking = (yaml.safe_load(RunDir(run_dir).spec.read_text()) or {}).get("tracking") or {}
    tracker = Tracker(
        run_dir,
        uri or tracking_uri(tracking.get("uri"), run_dir),
        tracking.get("experiment", "vlaslurm"),
        poll_s=0.05,
        close_timeout_s=timeout_s,
    ).start()
    return tracker.close()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode(), mode=0o644)
