"""The typed placement profile: a saved profile round-trips through JSON, gives exactly the Costs the
dict-reading code gave (the numbers below are what it gave for this profile), and a profile of another
version, or one that lacks a field, is refused instead of read with fallbacks."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from vlaslurm.placement.costs import from_profile, summarize
from vlaslurm.placement.profile import read_profile
from vlaslurm.placement.profile_types import PROFILE_VERSION, Profile, ProfileError, StaleProfile

summary = summarize  # the profile's own summaries, as the profiling job writes them


def fabricated():
    rng = np.random.default_rng(7)
    rows = [
        [round(float(x), 7) for x in rng.lognormal(np.log(0.002 * (3 if i >= 3 else 1)), 0.3, 40)] for i in range(4)
    ]
    batch = {}
    for n in (1, 2, 4):
        samples = [round(float(x), 7) for x in rng.lognormal(np.log(0.002 * n**0.5), 0.2, 30)]
        batch[str(n)] = {**summary(samples), "samples": samples, "cpu_wait_mean_s": 1e-5}
    return {
        "version": 8,
        "key": "0123456789abcdef",
        "spec": "fabricated",
        "gpu": "cpu",
        "local": True,
        "created": 1700000000.0,
        "hosts": ["node-a"],
        "partitions": {"simulator": None, "generator": "gpu", "trainer": "gpu"},
        "capacity_bytes": 8.0e9,
        "cpu_count": 4,
        "simulator": {
            "counts": [1, 2, 4],
            "batch": batch,
            "per_instance": {
                "n": 4,
                "threaded": False,
                "dispatch_s": 0.0,
                "cpu_s": 0.0015,
                "cpu_wait_mean_s": 2e-5,
                "samples": rows,
                "summary": [summary(r) for r in rows],
            },
            "thread_safe": False,
            "reset_s": 0.003,
            "episode_len": [20, 24, 31, 18],
            "memory": {"base": 1.0e6, "per_env": 2.5e5},
            "run_chunk_cpu_s": 4e-6,
            "device_s_per_env": 0.0,
        },
        "generator": {
            "forward": {
                "sizes": [1, 2, 4, 8],
                "seconds": [0.001, 0.0012, 0.0011, 0.002],
                "cpu_seconds": [0.0009, 0.001, 0.0012, 0.0018],
                "cpu_wait_mean_s": [0.0, 0.0, 0.0, 0.0],
            },
            "weights_bytes": 4096.0,
            "request_s": 5e-5,
            "memory": {"base": 4096.0, "per_item": 100.0},
        },
        "trainer": {
            "update": {
                "sizes": [16, 32, 64],
                "seconds": [0.004, 0.007, 0.013],
                "cpu_seconds": [0.004, 0.0065, 0.012],
                "cpu_wait_mean_s": [0.0, 0.0, 0.0],
            },
            "optimizer_bytes": 8192.0,
            "memory": {"base": 16384.0, "per_step": 50.0},
        },
        "weights": {
            "bytes": 4096.0,
            "copy_bytes_per_s": 2.0e9,
            "h2d_bytes_per_s": 2.0e9,
            "filesystem_publish_s": 0.004,
            "filesystem_install_s": 0.003,
        },
        "transport": {
            "round_trip_s": 2.2e-4,
            "round_trip_p99_s": 4e-4,
            "hop_s": 1.1e-4,
            "client_cpu_s": 6e-5,
            "client_send_cpu_s": 2.5e-5,
            "client_recv_cpu_s": 3.5e-5,
            "server_cpu_s": 5e-5,
            "client_burst_cpu_s": 4e-5,
            "server_burst_cpu_s": 3e-5,
            "burst": 8,
            "idle_s": [0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05],
            "idle_round_trip_s": [2.0e-4, 2.1e-4, 2.6e-4, 2.4e-4, 3.5e-4, 5e-4, 6e-4],
            "load_average": 0.5,
        },
        "overhead": {
            "sim_request_cpu_s": 9e-5,
            "sim_reply_cpu_s": 4e-5,
            "record_cpu_s": 2e-5,
            "gen_serve_cpu_s": 3.5e-5,
            "gen_wake_cpu_s": 2e-5,
            "segment_cpu_s": 1e-4,
        },
    }


def spec_with(weight_sync: str):
    """The parts of a spec `from_profile` reads: the weight sync, and a model without a release folder (so the
    trainer's memory is the profile's measurement, not an estimate)."""
    return types.SimpleNamespace(rollout=types.SimpleNamespace(weight_sync=weight_sync), model=types.SimpleNamespace())


def test_a_profile_round_trips_through_json() -> None:
    data = fabricated()
    prof = Profile.from_dict(data)
    assert prof.version == PROFILE_VERSION == 8
    assert prof.simulator.batch["4"].n == 30 and prof.transport.idle_s[-1] == 0.05
    assert prof.to_dict() == data
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_costs_from_the_typed_profile_are_the_ones_the_dict_gave() -> None:
    costs = from_profile(Profile.from_dict(fabricated()), spec_with("nccl"))
    assert costs.step_rule == "batch" and costs.step_samples.shape == (4, 160)
    assert float(costs.step_samples.sum()) == 1.8770100471101248
    assert {k: float(v.sum()) for k, v in costs.batch_samples.items()} == {
        1: 0.05918129999999999,
        2: 0.0871487,
        4: 0.1148831,
    }
    assert (costs.hop_s, costs.dispatch_s, costs.publish_s, costs.install_s) == (
        4.500000000000001e-05,
        4.500000000000001e-05,
        0.000662048,
        0.000662048,
    )
    assert (costs.message_s, costs.reply_s, costs.record_s, costs.request_s, costs.batch_s) == (
        9e-05,
        4e-05,
        2e-05,
        3.5e-05,
        2e-05,
    )
    assert costs.wake_after_s(0.003) == 4.999999999999998e-05
    assert (costs.forward_s(3), costs.update_s(100)) == (0.00115, 0.01975)
    assert (costs.cpu.step_s, costs.cpu.forward_s(5)) == (0.0015, 0.0013499999999999999)
    assert (costs.host_cores, costs.swap_s, costs.on_gpu, costs.gpu_name) == (4.0, 0.0, False, "cpu")
    assert vars(costs.memory) == {
        "capacity": 8.0e9,
        "sim_base": 1.0e6,
        "sim_per_env": 2.5e5,
        "gen_base": 4096.0,
        "gen_per_item": 100.0,
        "train_base": 16384.0,
        "train_per_step": 50.0,
        "gen_offload": 4096.0,
        "train_offload": 16384.0,
        "trainer_at": None,  # no release folder: the profile's measured trainer memory stands
    }
    assert costs.episode_len.tolist() == [20, 24, 31, 18] and costs.reset_s == 0.003 and not costs.thread_safe
    fs = from_profile(Profile.from_dict(fabricated()), spec_with("filesystem"))
    assert (fs.publish_s, fs.install_s) == (0.004, 0.10300000000000001)


def test_a_device_part_leaves_the_instances_rows_and_queues_in_the_model() -> None:
    """A profile that measured a shared device (`device_s_per_env`, 1 ms here): each instance's row was
    stepped alone, so it holds one instance's device part, which the costs take out (group_step adds it back
    per instance stepped) and carry for the simulation's queue."""
    plain = from_profile(Profile.from_dict(fabricated()), spec_with("nccl"))
    data = fabricated()
    data["simulator"]["device_s_per_env"] = 0.001
    data["simulator"]["per_instance"]["samples"] = [
        [x + 0.001 for x in row] for row in data["simulator"]["per_instance"]["samples"]
    ]
    costs = from_profile(Profile.from_dict(data), spec_with("nccl"))
    assert costs.device_s_per_env == 0.001 and plain.device_s_per_env == 0.0
    assert np.allclose(costs.step_samples, plain.step_samples, rtol=1e-5)
    costs.step_rule = plain.step_rule = "max"
    ids = np.arange(4)
    with_device = [costs.group_step(np.random.default_rng(s), ids) for s in range(5)]
    without = [plain.group_step(np.random.default_rng(s), ids) for s in range(5)]
    assert np.allclose(np.subtract(with_device, without), 0.004)


def test_another_version_is_refused_and_is_a_cache_miss(tmp_path: Path) -> None:
    old = fabricated()
    old["version"] = 6
    del old["simulator"]["device_s_per_env"]
    with pytest.raises(StaleProfile, match=r"version 6, this vlaslurm reads version 8 .*vlaslurm profile --force"):
        Profile.from_dict(old)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert read_profile(path) is None and read_profile(tmp_path / "absent.json") is None
    path.write_text(json.dumps(fabricated()))
    assert read_profile(path) == Profile.from_dict(fabricated())


def test_a_missing_or_mistyped_field_names_its_dotted_key() -> None:
    data = fabricated()
    del data["overhead"]["sim_reply_cpu_s"]
    with pytest.raises(ProfileError, match="overhead lacks sim_reply_cpu_s"):
        Profile.from_dict(data, source="profile x.json")
    data = fabricated()
    data["simulator"]["per_instance"]["samples"][2][5] = "fast"
    with pytest.raises(ProfileError, match=r"simulator.per_instance.samples\[2\]\[5\] must be float, not str"):
        Profile.from_dict(data)
    data = fabricated()
    data["device"] = "cuda:0"
    with pytest.raises(ProfileError, match="has unknown fields device"):
        Profile.from_dict(data)


def test_the_models_quick_lookups_give_numpys_floats() -> None:
    """`quantile_of_sorted` and a flat `Curve` stand in for np.quantile and np.interp on the simulation's hot path
    (a placement search asked them ~10^6 times): the same floats, ends and measured points included."""
    from vlaslurm.placement.costs import Curve, quantile_of_sorted

    rng = np.random.default_rng(1)
    for _ in range(300):
        values = rng.lognormal(0, 1, int(rng.integers(1, 40)))
        ordered = np.sort(values).tolist()
        for q in [0.0, 0.5, 1.0, *rng.random(10)]:
            assert quantile_of_sorted(ordered, q) == float(np.quantile(values, q))
        sizes = sorted({float(x) for x in rng.integers(0, 100, 6)})
        if len(sizes) > 1:
            curve = Curve(sizes, rng.random(len(sizes)).tolist(), flat=True)
            for x in [*sizes, *rng.uniform(-10, 110, 10)]:
                assert curve(x) == float(np.interp(x, curve.sizes, curve.values))
