"""The run directory: its file names, typed readers and writers, atomic writes (the bottom layer).

Nothing outside this package spells a run-directory file name; see `layout.py` for the tree.

Damaged files: every reader raises `DamagedRunDir(path, what)` for a file that is there but unusable (not JSON or
YAML, the wrong shape, a directory). In JSON-lines record files a line that does not parse is skipped (a crash
tore it), while a line that parses to the wrong shape (not an object, a key missing) raises; see `checked.py`.
`run.json`'s own `run_dir` is never followed: `read_info` answers with the directory it read.
"""

from vlaslurm.rundir import layout
from vlaslurm.rundir.checked import DamagedRunDir
from vlaslurm.rundir.files import append_line, fsync_quietly, read_jsonl, write_atomic
from vlaslurm.rundir.info import (
    RunInfo,
    RunListing,
    RunNotFound,
    append_index,
    claim_run_dir,
    create_run,
    list_runs,
    new_run_dir,
    read_info,
    replace_spec,
    resolve_run,
    scan_runs,
    write_info,
)
from vlaslurm.rundir.layout import RunDir, comparisons_dir, index_path, profiles_dir
from vlaslurm.rundir.records import (
    Counters,
    EventLog,
    Heartbeat,
    append_checkpoint_fallback,
    append_exit_record,
    append_metrics,
    append_restart,
    beat_age_s,
    checkpoint_fallback_line,
    checkpoint_fallbacks,
    exit_records,
    final_env_steps,
    job_outcome,
    keep_metrics_through,
    read_eval,
    read_events,
    read_heartbeat,
    read_heartbeats,
    read_ledger,
    read_metrics,
    read_resolved_spec,
    restart_records,
    write_final_summary,
    write_table,
)

__all__ = [
    "Counters",
    "DamagedRunDir",
    "EventLog",
    "Heartbeat",
    "RunDir",
    "RunInfo",
    "RunListing",
    "RunNotFound",
    "append_checkpoint_fallback",
    "append_exit_record",
    "append_index",
    "append_line",
    "append_metrics",
    "append_restart",
    "beat_age_s",
    "checkpoint_fallback_line",
    "checkpoint_fallbacks",
    "claim_run_dir",
    "comparisons_dir",
    "create_run",
    "exit_records",
    "final_env_steps",
    "fsync_quietly",
    "index_path",
    "job_outcome",
    "keep_metrics_through",
    "layout",
    "list_runs",
    "new_run_dir",
    "profiles_dir",
    "read_eval",
    "read_events",
    "read_heartbeat",
    "read_heartbeats",
    "read_info",
    "read_jsonl",
    "read_ledger",
    "read_metrics",
    "read_resolved_spec",
    "replace_spec",
    "resolve_run",
    "restart_records",
    "scan_runs",
    "write_atomic",
    "write_info",
    "write_final_summary",
    "write_table",
]
