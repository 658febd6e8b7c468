"""MLflow tracking: a run's writer (`Tracker`, started by trainer rank 0) and `vlaslurm compare`.

Importing this package does not import MLflow; the writer thread does, off the training path.
"""

from vlaslurm.tracking.tracker import NoTracker, Tracker, default_uri, open_tracker, read_run_id, sync_run, tracking_uri

__all__ = ["Tracker", "NoTracker", "open_tracker", "sync_run", "tracking_uri", "default_uri", "read_run_id"]
