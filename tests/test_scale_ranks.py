"""``benchmarks/scale_ranks.py`` runs and reports what a separate run of its step measures.

Not a timed test: its figures' arithmetic and its simulated step are checked, against a run made here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import simdist

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # scale_ranks imports engine_bench by name, as it does run from benchmarks/
    spec.loader.exec_module(module)
    return module


def test_rank_scaling_reports_the_step_a_separate_run_simulates(capsys: pytest.CaptureFixture[str]) -> None:
    engine_bench = _load("engine_bench")
    scale_ranks = _load("scale_ranks")
    rows = scale_ranks.rank_scaling((2, 3))
    assert [r["ranks"] for r in rows] == [2, 3]
    for r in rows:
        cluster = simdist.Cluster.switch(r["ranks"], bandwidth="50GB/s", latency="5us", device="H100")
        expected = simdist.run(engine_bench.mlp_step, cluster, trace="collectives", races="off").sim_time
        assert r["sim_step_s"] == expected > 0
        assert r["ratio"] == r["wall_s"] / r["torch_s"]
        assert r["cpu_ratio"] == r["cpu_s"] / r["torch_cpu_s"]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["ranks", "wall"]
    assert [line.split()[0] for line in table[1:]] == ["2", "3"]
