"""Collocated layout: models and optimizer state leave the device once per rollout phase, not per step.

The runs are real local runs (every rank a process). On this CPU-only machine the device is the
host, so a move is made and recorded but frees nothing; that GPU memory really moves is checked by
the CUDA test, which runs only on a machine with a GPU. The unit test moves to the `meta` device:
a real second device for where tensors live, but it keeps no data (nothing comes back from it) and
`Module.to` makes new Parameter objects for it, where between CPU and CUDA it keeps them: the CUDA
test checks that the optimizer still holds the model's parameters after a round trip.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from runtime_helpers import RANKS_2, Run, run_spec, synthetic_spec
from torch import nn

from vlaslurm.rundir import EventLog, read_events
from vlaslurm.runtime.offload import Offloader, OffloadReports, OffloadTimeout, move_module


def trained_model(device: str = "cpu") -> tuple:
    """A small model with a buffer, gradients and Adam state after one step."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(16, 4, device=device)).pow(2).sum().backward()
    opt.step()
    return model, opt


def sizes(model: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, int]:
    def b(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    return {"model": sum(map(b, tensors)), "optimizer": sum(map(b, moments))}


def test_offload_moves_parameters_gradients_buffers_and_optimizer_state(tmp_path: Path) -> None:
    model, opt = trained_model()
    expected = sizes(model, opt)
    events = EventLog(tmp_path, "trainer", 0)
    off = Offloader(True, "cpu", events, clock=lambda: 1.0, module=model, optimizer=opt, host="meta")
    off.offload(version=3)
    off.offload(version=3)  # already off: nothing moves, nothing is recorded
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    assert all(p.grad.device.type == "meta" for p in model.parameters())
    for state in opt.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        assert state["step"].device.type == "cpu"  # torch keeps Adam's step on the host
    got = read_events(tmp_path)
    assert [(e["ev"], e["v"], e["what"], e["parts"], e["bytes"], e["to"]) for e in got] == [
        ("offload", 3, ["model", "optimizer"], expected, sum(expected.values()), "meta")
    ]


def test_trainer_drops_gradients_instead_of_moving_them(tmp_path: Path) -> None:
    model, opt = trained_model()
    expected = sizes(model, opt)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    off = Offloader(
        True,
        "cpu",
        EventLog(tmp_path, "trainer", 0),
        clock=lambda: 0.0,
        module=model,
        optimizer=opt,
        host="meta",
        drop_grads=True,
    )
    off.offload(0)
    assert all(p.grad is None for p in model.parameters())
    assert read_events(tmp_path)[0]["parts"] == {"model": expected["model"] - grads, "optimizer": expected["optimizer"]}


def test_offloader_reports_each_move_off_once_its_event_is_written(tmp_path: Path) -> None:
    model, _ = trained_model()
    seen = []

    class Report:  # stands in for OffloadReporter (its socket is exercised by the real runs below)
        def __call__(self, version: int) -> None:
            seen.append((version, [e["ev"] for e in read_events(tmp_path)]))

        def close(self) -> None:
            seen.append("closed")

    off = Offloader(
        True,
        "cpu",
        EventLog(tmp_path, "generator", 1),
        clock=lambda: 0.0,
        module=model,
        host="meta",
        on_device=False,
        report=Report(),
    )
    off.offload(0)  # built in host memory: nothing moves, nothing is reported
    off.onload(0)
    off.offload(0)
    off.offload(0)  # already off
    off.close()
    assert seen == [(0, ["onload", "offload"]), "closed"]


def test_disabled_offloader_moves_nothing(tmp_path: Path) -> None:
    model, opt = trained_model()
    off = Offloader(False, "cpu", EventLog(tmp_path, "generator", 0), clock=lambda: 0.0, module=model, host="meta")
    off.offload(0)
    off.onload(1)
    assert not any(p.is_meta for p in model.parameters()) and read_events(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: here the device is the host")
def test_round_trip_frees_gpu_memory_and_training_continues_identically(tmp_path: Path) -> None:
    model, opt = trained_model("cuda")
    twin = {k: v.clone() for k, v in model.state_dict().items()}
    off = Offloader(True, "cuda", EventLog(tmp_path, "trainer", 0), clock=lambda: 0.0, module=model, optimizer=opt)
    before = torch.cuda.memory_allocated()
    off.offload(0)
    assert torch.cuda.memory_allocated() < before and next(model.parameters()).device.type == "cpu"
    off.onload(1)
    assert all(a is b for a, b in zip(model.parameters(), opt.param_groups[0]["params"]))
    assert all(torch.equal(v, twin[k]) for k, v in model.state_dict().items())
    assert all(s["exp_avg"].is_cuda for s in opt.state.values())
    opt.step()  # the optimizer works on the moved-back state
    assert [e["ev"] for e in read_events(tmp_path)] == ["offload", "onload"]


def test_move_module_counts_what_it_moved() -> None:
    model = nn.Linear(3, 2)
    assert move_module(model, torch.device("cpu")) == (3 * 2 + 2) * 4


# ------------------------------------------------------------------ real runs


def moves(run: Run, role: str, kind: str) -> Dict[int, List[int]]:
    """rank -> versions of its `kind` events, in order."""
    out: Dict[int, List[int]] = {}
    for event in run.events(kind, role):
        out.setdefault(event["rank"], []).append(event["v"])
    return out


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> Dict[str, Run]:
    runs = {}
    for name, mode, layout, extra in (
        ("sync", "sync", "collocated", {}),
        ("pipelined", "pipelined", "collocated", {"pipeline_depth": 2}),
        ("disaggregated", "sync", "disaggregated", {}),
    ):
        spec = synthetic_spec(mode, **extra)
        spec["resources"] = {"layout": layout}
        runs[name] = run_spec(tmp_path_factory.mktemp(name), spec, [RANKS_2], name=name)
    return runs


@pytest.mark.parametrize("name", ["sync", "pipelined"])
def test_collocated_moves_once_per_rollout_phase_per_rank(layout_runs: Dict[str, Run], name: str) -> None:
    run = layout_runs[name]
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    updates = sorted({e["v"] for e in run.events("update", "trainer")})
    phases = list(range(len(updates)))
    assert updates == phases and len(phases) >= 3
    steps = Counter(e["v"] for e in run.events("batch", "generator"))
    assert all(steps[v] > 2 for v in phases)  # many forwards per phase, yet one move each way

    # Generators: built in host memory, on with each version's weights (the first included), off once
    # the trainer took the phase's batch.
    assert moves(run, "generator", "offload") == {0: phases, 1: phases}
    assert moves(run, "generator", "onload") == {0: phases, 1: phases}
    # Trainers: off during each phase (before its publication), on for its update. A data-parallel
    # follower learns that the run is over only while waiting off the device: one more offload at the end.
    assert moves(run, "trainer", "onload") == {0: phases, 1: phases}
    assert moves(run, "trainer", "offload") == {0: phases, 1: phases + [len(phases)]}
    for event in run.events("offload") + run.events("onload"):
        assert event["bytes"] > 0 and event["what"] == ["model"] and event["s"] >= 0  # synthetic: no optimizer

    # The order in time, per generator: batches of phase v, then its offload, then the onload of v + 1.
    for rank in (0, 1):
        events = sorted(
            (
                e
                for e in read_events(run.run_dir, f"generator-{rank}.jsonl")
                if e["ev"] in ("batch", "offload", "onload")
            ),
            key=lambda e: e.get("t0", e.get("t", 0)),
        )
        for v in phases:
            off_at = next(e["t0"] for e in events if e["ev"] == "offload" and e["v"] == v)
            assert all(e["t1"] <= off_at for e in events if e["ev"] == "batch" and e["v"] == v)
            assert all(e["t0"] >= off_at for e in events if e["ev"] == "batch" and e["v"] > v)


@pytest.mark.parametrize("name", ["sync", "pipelined"])
def test_each_role_moves_onto_the_gpu_only_after_the_other_left_it(layout_runs: Dict[str, Run], name: str) -> None:
    """The handshake: every move onto the device starts after every move off it by the other role for
    that phase ended, on the one clock of the run (strictly: the two never hold the GPU at once)."""
    run = layout_runs[name]
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    phases = sorted({e["v"] for e in run.events("update", "trainer")})
    assert len(phases) >= 3

    def of(role: str, kind: str, v: int) -> List[dict]:
        return [e for e in run.events(kind, role) if e["v"] == v]

    for v in phases:
        generators_off, trainers_off = of("generator", "offload", v), of("trainer", "offload", v)
        assert sorted(e["rank"] for e in generators_off) == [0, 1]
        assert sorted(e["rank"] for e in trainers_off) == [0, 1]
        trainers_on, generators_on = of("trainer", "onload", v), of("generator", "onload", v)
        assert sorted(e["rank"] for e in trainers_on) == [0, 1] and sorted(e["rank"] for e in generators_on) == [0, 1]
        # The rollout of v: the generators come on only once both trainer ranks are off ...
        assert min(e["t0"] for e in generators_on) > max(e["t1"] for e in trainers_off), (v, trainers_off)
        # ... and the update of v: the trainers come on only once both generators are off.
        assert min(e["t0"] for e in trainers_on) > max(e["t1"] for e in generators_off), (v, generators_off)


def test_offload_reports_wait_for_every_rank_of_a_role() -> None:
    reports = OffloadReports()
    reports.add(2, "generator", 0)  # an older phase's report: no use for version 3, and forgotten once it is met
    # generator[1] reports twice (a restarted rank reports again: the report names the rank, not the process)
    arrivals = iter([("generator", 1), ("trainer", 0), ("generator", 1), ("generator", 0), ("generator", 2)])
    pumped = []

    def pump() -> None:
        got = next(arrivals)
        pumped.append(got)
        reports.add(3, *got)

    reports.wait(3, "generator", range(2), 10.0, pump, "the test")
    assert pumped == [("generator", 1), ("trainer", 0), ("generator", 1), ("generator", 0)]  # done at the last one
    assert list(reports.by_version) == [3]


def test_offload_wait_names_the_ranks_that_never_reported() -> None:
    reports = OffloadReports()
    reports.add(5, "generator", 2)
    reports.add(5, "trainer", 1)  # another role's report does not count for the generators
    names = r"generator\[0\], generator\[1\], generator\[3\] did not say .* for version 5"
    with pytest.raises(OffloadTimeout, match=names):
        reports.wait(5, "generator", range(4), 0.05, lambda: None, "the test")


def test_disaggregated_never_moves(layout_runs: Dict[str, Run]) -> None:
    run = layout_runs["disaggregated"]
    assert run.rc == 0, run.log("trainer", 0)[-3000:]
    assert run.events("update", "trainer") and run.events("offload") == [] and run.events("onload") == []
