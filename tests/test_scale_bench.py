"""``benchmarks/scale_bench.py``'s messages table: its three ways of running a ring all-reduce give one run.

Not a timed test: the rates are not checked, only that the runs it compares agree and what it counts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from simdist.comm import batched, lane

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_the_messages_table_compares_one_run_done_three_ways(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(_BENCHMARKS))  # scale_bench imports its neighbours by name
    spec = importlib.util.spec_from_file_location("scale_bench", _BENCHMARKS / "scale_bench.py")
    scale_bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scale_bench", scale_bench)
    spec.loader.exec_module(scale_bench)
    monkeypatch.setattr(batched, "MIN_MESSAGES", 1)  # the small run goes in arrays too
    made: list = []
    real = batched.make
    monkeypatch.setattr(
        batched, "make", lambda run, msgs: made.append(real(run, msgs) is not None) or real(run, msgs)
    )
    figures = scale_bench.message_rate((8,), numel=64)
    assert figures[8]["same"] and figures[8]["messages"] == 2 * 7 * 8
    assert any(made)  # the "arrays" run did run in arrays
    assert batched.ENABLED and lane.ENABLED  # restored
    rows = capsys.readouterr().out.splitlines()
    assert rows[-1].split()[0] == "8" and rows[-1].split()[-1] == "yes"
