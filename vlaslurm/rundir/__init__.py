"""The run directory: its file names, typed readers and writers, atomic writes (the bottom layer).

Nothing outside this package spells a run-directory file name; see `layout.py` for the tree.
"""

from vlaslurm.rundir import layout
from vlaslurm.rundir.files import append_line, fsync_quietly, read_jsonl, write_atomic
from vlaslurm.rundir.info import (
    RunInfo,
    RunNotFound,
    append_index,
    claim_run_dir,
    create_run,
    list_runs,
    new_run_dir,
    read_info,
    resolve_run,
    write_info,
)
from vlaslurm.rundir.layout import RunDir, comparisons_dir, index_path, profiles_dir
from vlaslurm.rundir.records import (
    Counters,
    EventLog,
    Heartbeat,
    append_exit_record,
    append_metrics,
    append_restart,
    exit_records,
    job_outcome,
    read_events,
    read_heartbeat,
    read_ledger,
    read_metrics,
    read_resolved_spec,
    restart_records,
    write_table,
)

__all__ = [
    "Counters",
    "EventLog",
    "Heartbeat",
    "RunDir",
    "RunInfo",
    "RunNotFound",
    "append_exit_record",
    "append_index",
    "append_line",
    "append_metrics",
    "append_restart",
    "claim_run_dir",
    "comparisons_dir",
    "create_run",
    "exit_records",
    "fsync_quietly",
    "index_path",
    "job_outcome",
    "layout",
    "list_runs",
    "new_run_dir",
    "profiles_dir",
    "read_events",
    "read_heartbeat",
    "read_info",
    "read_jsonl",
    "read_ledger",
    "read_metrics",
    "read_resolved_spec",
    "resolve_run",
    "restart_records",
    "write_atomic",
    "write_info",
    "write_table",
]
