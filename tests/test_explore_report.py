"""``simdist explore --report``: one self-contained page of an exploration (failures by kind with their replay
tokens, failures over runs, interleavings), linked from the report index."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import explore_fns as fns
import pytest
from test_explore_cli import SCRIPT

import simdist
from simdist.cli import main
from simdist.explore.report import save_exploration_page
from simdist.explore.shrink import shrink_kinds
from simdist.report import build_index


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "collect.py"
    path.write_text(SCRIPT)
    return path


def test_the_report_holds_each_kinds_first_failure_and_its_replay_token(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    page, tokens = out_dir / "explore.html", tmp_path / "tokens.json"
    status = main(["explore", str(script), "--world-size", "3", "--runs", "8", "--strategy", "pct", "--workers", "1",
                   "--tokens", str(tokens), "--report", str(page), "--", "--strict"])  # fmt: skip
    assert status == 1
    assert f"report written to {page}" in capsys.readouterr().out
    text = html.unescape(page.read_text())
    found = json.loads(tokens.read_text())
    kinds = {f["kind"] for f in found}
    assert kinds == {"RankError (AssertionError)"}
    first = found[0]
    assert f"{first['kind']}: run {first['run']}" in text
    assert json.dumps(first["replay"], sort_keys=True) in text  # the token, as --tokens wrote it
    assert "Failures by kind" in text and "Failures over runs" in text and "Interleavings" in text
    assert f"{len(found)} of 8 runs failed" in text
    # shrunk by default: under gloo-like progress the unperturbed run already fails, so no reordering is kept
    assert f"{first['kind']}: the minimal case after shrinking run {first['run']}" in text
    assert "shrunk to 0 decisions off the unperturbed order" in text
    assert "first differing trace event: none (the traces agree)" in text
    assert "<script src=" not in text and "https://" not in text.split("</style>")[0]  # self-contained
    index = build_index(out_dir).read_text()
    assert 'href="explore.html"' in index and "FAIL" in index


def test_an_exploration_without_failures_reports_a_pass(script: Path, tmp_path: Path) -> None:
    page = tmp_path / "ok.html"
    assert (
        main(
            [
                "explore",
                str(script),
                "--world-size",
                "3",
                "--runs",
                "4",
                "--workers",
                "1",
                "--report",
                str(page),
            ]
        )
        == 0
    )
    text = page.read_text()
    assert "PASS: 1 of 1 expectations held" in text and "Failures by kind" not in text


def test_a_bad_engine_is_refused_before_any_run(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["explore", str(script), "--world-size", "3", "--runs", "4", "--engine", "localhost:8786"]) == 2
    )
    assert "engine must be a distributed.Client, a Dask scheduler address" in capsys.readouterr().err


def test_a_failed_checks_run_is_drawn_beside_the_unperturbed_run(tmp_path: Path) -> None:
    cpu4 = simdist.Cluster.switch(4, device="cpu")
    ex = simdist.explore(fns.arrival_order, cpu4, runs=8, strategy="pct", seed=5, check=fns.order_is_sorted)
    first = ex.failures[0]
    assert first.kind == "check failed" and ex.outcomes[0].kind is None
    page = save_exploration_page(
        ex, tmp_path / "ex.html", program="arrival_order", cluster=cpu4, fn=fns.arrival_order
    )
    text = html.unescape(page.read_text())
    assert f"Run {first.run} beside the unperturbed run" in text
    # the timelines are the failing run's and run 0's: their trace hashes, as the exploration recorded them
    assert first.trace_hash[:16] in text.rsplit(f"Run {first.run} beside", 1)[1]
    assert ex.outcomes[0].trace_hash[:16] in text.rsplit(f"Run {first.run} beside", 1)[1]


def test_a_run_that_raised_has_no_timeline_to_draw(tmp_path: Path) -> None:
    cpu4 = simdist.Cluster.switch(4, device="cpu")
    ex = simdist.explore(fns.any_source_order, cpu4, runs=6, seed=1)
    assert ex.failures
    page = save_exploration_page(
        ex, tmp_path / "ex.html", program="any_source_order", cluster=cpu4, fn=fns.any_source_order
    )
    assert "beside the unperturbed run" not in page.read_text()


def test_the_page_shows_each_kinds_shrunk_case_and_where_it_departs(tmp_path: Path) -> None:
    cpu3 = simdist.Cluster.switch(3, device="cpu")
    ex = simdist.explore(fns.any_source_order, cpu3, runs=6, strategy="pct", seed=1)
    shrunk = shrink_kinds(ex, fns.any_source_order, cpu3)["RankError (AssertionError)"]
    assert isinstance(shrunk, simdist.Shrunk)
    page = save_exploration_page(ex, tmp_path / "ex.html", program="any_source_order", cluster=cpu3)
    text = html.unescape(page.read_text())
    section = text.rsplit("the minimal case after shrinking run", 1)[1]  # past the page's contents
    # one decision: rank 2 before rank 1 (or before rank 0, which then receives from rank 2 before rank 1 sent)
    assert re.search(r"ranks 0?,? ?1, 2 tied; rank 2 went first instead of rank [01]\n", section)
    assert "first differing trace event: rank 0 nccl:recv (src 2) on stream p2p at t=0 s" in section
    assert (
        shrunk.replay in section and "simdist.replay(explore_fns.any_source_order, cluster, token)" in section
    )
