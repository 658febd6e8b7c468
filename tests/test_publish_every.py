"""`rollout.publish_every: k` (async): only every k-th version's weights go out, and generators serve those."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import RANKS_2, check_trained_versions, run_spec, synthetic_spec


@pytest.mark.parametrize("stale_policy", ["drop", "hold"])
def test_generators_serve_only_published_versions(tmp_path: Path, stale_policy: str) -> None:
    spec = synthetic_spec("async", total_env_steps=1200, max_staleness=2, stale_policy=stale_policy, publish_every=2)
    run = run_spec(tmp_path, spec, [RANKS_2], timeout_s=120)
    assert run.rc == 0, run.log("trainer", 0)[-2000:]
    published = sorted({e["v"] for e in run.events("publish", "trainer")})
    assert published and all(v % 2 == 0 for v in published), published
    served = set(run.ledger["behavior_version"])
    assert served <= {0, *published}, f"served {sorted(served)}, published {published}"
    assert max(served) >= 4, "the generators never took newer weights"
    check_trained_versions(run, max_staleness=2)
