"""`rollout.stop_at_success` (vlaslurm/runtime/stopping.py): the rate a run's early end compares, and its spec check.
A real run that ends on it: tests/test_tracking.py (and the learning runs of tests/test_learning.py)."""

from __future__ import annotations

import json
from collections import deque

import pytest

from vlaslurm.rundir import keep_metrics_through, read_metrics
from vlaslurm.runtime.stopping import EPISODES_KEY, SUCCESS_KEY, SuccessTarget
from vlaslurm.spec import SpecError, load_spec


def test_the_rate_spans_the_episodes_of_the_last_reports_that_saw_any() -> None:
    target = SuccessTarget(0.5, window=3)
    target.add(4, 4)
    target.add(0, 0)  # a report without finished episodes neither counts nor breaks the window
    target.add(0, 4)
    assert target.rate is None and not target.reached  # two reports so far
    target.add(1, 12)  # weighted by episodes: 5 of 20, not the mean of the rates (1.0, 0.0, 0.08)
    assert target.rate == pytest.approx(5 / 20) and not target.reached
    target.add(12, 12)  # the first report leaves the window: 13 of 28
    assert target.rate == pytest.approx(13 / 28) and not target.reached
    target.add(8, 8)  # 21 of 32
    assert target.rate == pytest.approx(21 / 32) and target.reached
    assert "0.656 over the 32 episodes of the last 3 reports" in target.describe()


def test_without_a_target_the_run_never_ends_on_success() -> None:
    target = SuccessTarget(None, window=1)
    target.add(5, 5)
    assert target.rate == 1.0 and not target.reached


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("rollout.stop_at_success=0", "must be in (0, 1]"),
        ("rollout.stop_at_success=1.5", "must be in (0, 1]"),
        ("rollout.stop_window=0", "must be at least 1"),
    ],
)
def test_a_target_outside_the_rates_is_refused_naming_the_field(tmp_path, override: str, words: str) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: s\nenv: {type: synthetic}\nmodel: {type: synthetic}\nalgo: {type: synthetic}\n")
    with pytest.raises(SpecError) as err:
        load_spec(spec, [override])
    assert override.split("=")[0] in str(err.value) and words in str(err.value)


def test_a_resumed_run_goes_on_from_the_reports_before_its_checkpoint(tmp_path) -> None:
    """The trainer's resume refills the window from metrics.jsonl (what `keep_metrics_through` kept): a run that was
    at its target's edge when it was preempted need not sustain it for a whole window again."""
    rows = [
        {"version": 1, SUCCESS_KEY: 0.25, EPISODES_KEY: 8},  # leaves the window of 2
        {"version": 2, SUCCESS_KEY: float("nan"), EPISODES_KEY: 0},  # no episode finished: not a report
        {"version": 3, SUCCESS_KEY: 0.75, EPISODES_KEY: 4},
        {"version": 4, SUCCESS_KEY: 0.5, EPISODES_KEY: 6},  # past the checkpoint: forgotten
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = keep_metrics_through(tmp_path, 3)
    versions = [[r["version"] for r in lines] for lines in (kept, read_metrics(tmp_path))]
    assert versions == [[1, 2, 3], [1, 2, 3]]  # what it returns is what the file now holds
    target = SuccessTarget(0.5, window=2)
    target.add_reports(kept)
    assert target.reports == deque([(2, 8), (3, 4)]) and target.rate == pytest.approx(5 / 12) and not target.reached
    target.add(6, 6)  # the first report after the resume fills a window the old reports began
    assert target.rate == pytest.approx(9 / 10) and target.reached
