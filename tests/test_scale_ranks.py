"""``benchmarks/scale_ranks.py`` runs and reports what a separate run of its step measures.

Not a timed test: its figures' arithmetic and its simulated step are checked, against a run made here.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch

import simdist

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # scale_ranks imports engine_bench by name, as it does run from benchmarks/
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", ["switch", "ring"])
def test_rank_scaling_reports_the_step_a_separate_run_simulates(
    shape: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine_bench = _load("engine_bench")
    scale_ranks = _load("scale_ranks")
    rows = scale_ranks.rank_scaling((2, 3), shape)
    assert [r["ranks"] for r in rows] == [2, 3]
    for r in rows:
        if shape == "switch":
            cluster = simdist.Cluster.switch(r["ranks"], bandwidth="50GB/s", latency="5us", device="H100")
            step = engine_bench.mlp_step
        else:
            cluster = simdist.Cluster.ring(r["ranks"], device="H100", algorithms={"all_reduce": "ring"})
            step = scale_ranks.mlp_grads_step
        expected = simdist.run(step, cluster, trace="collectives", races="off")
        assert r["sim_step_s"] == expected.sim_time > 0
        assert r["messages"] == expected.messages
        assert r["ratio"] == r["wall_s"] / r["torch_s"]
        assert r["cpu_ratio"] == r["cpu_s"] / r["torch_cpu_s"]
        assert r["ops_ratio"] == r["wall_s"] / r["ops_s"]
        assert r["ops_cpu_ratio"] == r["cpu_s"] / r["ops_cpu_s"]
    if shape == "ring":  # four all-reduces of 2(n-1) messages per rank
        assert [r["messages"] for r in rows] == [4 * 2 * 1 * 2, 4 * 2 * 2 * 3]
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"{shape} cluster"
    assert table[1].split()[:3] == ["ranks", "messages", "wall"]
    assert [line.split()[0] for line in table[2:]] == ["2", "3"]


def test_thread_floor_runs_the_plain_step_in_as_many_threads(capsys: pytest.CaptureFixture[str]) -> None:
    engine_bench = _load("engine_bench")
    scale_ranks = _load("scale_ranks")
    calls: list[tuple[int, int, int]] = []
    step = engine_bench.mlp_local

    def counted(rank: int) -> object:
        calls.append((rank, threading.get_ident(), threading.active_count()))
        return step(rank)

    scale_ranks.mlp_local = counted
    alive = threading.active_count()
    row = scale_ranks.thread_floor(3)
    # each rank's step in a thread of its own, the earlier ranks' threads still alive; then again in this thread
    assert [c[0] for c in calls] == [0, 1, 2, 0, 1, 2]
    assert len({c[1] for c in calls[:3]}) == 3 and threading.get_ident() not in {c[1] for c in calls[:3]}
    assert [c[2] - alive for c in calls] == [1, 2, 3, 0, 0, 0]
    assert row["ratio"] == row["threads_cpu_s"] / row["torch_cpu_s"]
    assert capsys.readouterr().out.startswith("thread floor: 3 live threads")


def test_the_reference_seeded_as_in_a_rank_draws_what_plain_torch_and_a_rank_draw() -> None:
    """The second reference does the same work: the same gradients as plain torch's seeding and as a rank's."""
    engine_bench = _load("engine_bench")
    original = torch.manual_seed
    plain = [engine_bench.mlp_local(r) for r in range(3)]
    with engine_bench.seeded_as_in_a_rank():
        assert torch.manual_seed is not original
        seeded = [engine_bench.mlp_local(r) for r in range(3)]
    assert torch.manual_seed is original
    in_ranks = simdist.run(
        lambda: engine_bench.mlp_local(torch.distributed.get_rank()), simdist.Cluster.switch(3)
    )
    for a, b, c in zip(plain, seeded, in_ranks.returns):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError), engine_bench.seeded_as_in_a_rank():
        raise ValueError
    assert torch.manual_seed is original


def test_per_op_reports_the_rank_and_a_pass_through_mode_against_plain_torch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    scale_ranks = _load("scale_ranks")
    row = scale_ranks.per_op(calls=2, batches=1)
    assert row["ops"] == 48  # the step's ops, as a dispatch mode sees them
    assert row["per_op_us"] == pytest.approx((row["step_us"] - row["torch_step_us"]) / row["ops"])
    assert row["mode_per_op_us"] == pytest.approx((row["mode_step_us"] - row["torch_step_us"]) / row["ops"])
    assert min(row["step_us"], row["torch_step_us"], row["mode_step_us"]) > 0
    assert capsys.readouterr().out.startswith("per op: 48 ops per step;")
