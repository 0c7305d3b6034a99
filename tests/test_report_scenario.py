"""Scenario pages and their SVG plots: geometry against the data, escaping, and clear errors on bad input."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import simdist
from simdist.report import ScenarioReport, build_index, write_run_report
from simdist.report.plot import bar_plot, line_plot

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"

values = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.lists(st.tuples(st.integers(0, 50), values), min_size=1,
                                                                    max_size=12), min_size=1, max_size=4),
       st.booleans())
def test_every_point_lies_inside_the_axes_and_keeps_its_order(series, log) -> None:
    p = line_plot(series, x_label="step", y_label="diff", log=log)
    assert [line["label"] for line in p["lines"]] == list(series)
    for line, pts in zip(p["lines"], series.values()):
        assert len(line["dots"]) == len(pts)
        for d, (x, y) in zip(line["dots"], pts):
            assert p["left"] - 1e-6 <= d["x"] <= p["right"] + 1e-6
            assert p["top"] - 1e-6 <= d["y"] <= p["base"] + 1e-6
        # a larger value is never drawn lower (smaller y is higher): the scale is monotonic, on log scales too
        for (d1, (_, y1)), (d2, (_, y2)) in zip(zip(line["dots"], pts), zip(line["dots"][1:], pts[1:])):
            if y1 < y2:
                assert d1["y"] >= d2["y"] - 1e-9


def test_a_log_plot_draws_zero_on_a_floor_below_the_smallest_value() -> None:
    p = line_plot({"drift": [(0, 0.0), (1, 1e-6), (2, 1e-2)]}, x_label="step", y_label="diff", log=True,
                  marks={1: "first divergence"})
    zero, small, large = (d["y"] for d in p["lines"][0]["dots"])
    assert zero == p["floor"] and zero > small > large
    assert p["y_ticks"][0][1] == "0"  # the floor's tick says what it stands for
    assert [m["label"] for m in p["marks"]] == ["first divergence"]
    assert p["lines"][0]["dots"][0]["title"] == "drift: 0, 0"


def test_bars_are_as_tall_as_their_values() -> None:
    p = bar_plot({"DDP": {"step": 1.0, "comm": 0.5}, "FSDP": {"step": 2.0}}, y_label="time", unit="time")
    heights = {b["title"]: b["h"] for b in p["bars"]}
    assert heights["DDP, step: 1 s"] == pytest.approx(heights["FSDP, step: 2 s"] / 2)
    assert heights["DDP, comm: 500 ms"] == pytest.approx(heights["DDP, step: 1 s"] / 2)
    assert [s["label"] for s in p["series"]] == ["step", "comm"]


def test_bad_plot_and_table_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="at least one series"):
        line_plot({}, x_label="x", y_label="y")
    with pytest.raises(ValueError, match="unit 'furlongs'"):
        line_plot({"a": [(0, 1.0)]}, x_label="x", y_label="y", unit="furlongs")
    with pytest.raises(ValueError, match="at least one group"):
        bar_plot({}, y_label="y")
    page = ScenarioReport("t", command="")
    with pytest.raises(ValueError, match="a row has 1 cells for 2 columns"):
        page.table("T", ["a", "b"], [["only one"]])
    with pytest.raises(ValueError, match="at least one RunResult"):
        page.runs("R", {})


def test_the_page_escapes_every_string_and_sorts_numbers_by_value(tmp_path) -> None:
    page = ScenarioReport(HOSTILE, description=f"First {HOSTILE}.\n\n1. one\n2. two\n\n(a) case a\n    more\n\nUsage: x",
                          program="s.py", seed=7, command="python s.py")
    page.table(HOSTILE, ["case", "drift", "ok"], [[HOSTILE, 0.25, True], ["b", 3, ("FAIL", "fail")]])
    page.text("Diagnosis", HOSTILE, error=True)
    page.line_plot("Drift", {HOSTILE: [(1, 0.5)]}, x_label=HOSTILE, y_label="y")
    text = page.save(tmp_path / "s.html", [(HOSTILE, False, HOSTILE), ("ok", True, "")]).read_text()
    assert HOSTILE not in text and text.count(ESCAPED) >= 8
    assert '<meta name="simdist-summary" content="FAIL: 1 of 2 expectations failed, first: ' + ESCAPED + '">' in text
    assert '<meta name="simdist-status" content="fail">' in text
    # numbered lines become an ordered list, lettered cases a list keeping their letters; usage is dropped
    assert re.search(r'<ol class="description ol"><li>one</li><li>two</li></ol>', text)
    assert '<li>(a) case a more</li>' in text and "Usage" not in text
    assert '<td data-value="0.25">0.25</td>' in text and '<td data-value="3">3</td>' in text
    assert '<td class="fail">FAIL</td>' in text and "<td>yes</td>" in text
    assert text.count("<section id=") == 4 and 'id="verdicts"' in text


def test_the_index_marks_each_page_by_its_status(tmp_path) -> None:
    ScenarioReport("passing", command="").save(tmp_path / "a.html", [("x", True, "")])
    ScenarioReport("failing", command="").save(tmp_path / "b.html", [("x", True, ""), ("y", False, "")])
    (tmp_path / "c.html").write_text("<html><head><title>someone else's page</title></head></html>")
    write_run_report(None, tmp_path / "d.html", error=RuntimeError("stopped"), cluster=simdist.Cluster.switch(2))
    with pytest.warns(simdist.RaceWarning):  # the finding, read from the result
        write_run_report(simdist.run(racy, simdist.Cluster.switch(2), races="warn"), tmp_path / "e.html")
    text = build_index(tmp_path).read_text()
    items = re.findall(r'<li class="([a-z]*)">(?:<span class="pill [a-z]+">([a-z]+)</span>)?<a href="([a-z.]+)">', text)
    assert items == [("pass", "ok", "a.html"), ("fail", "failed", "b.html"), ("", "", "c.html"),
                     ("fail", "failed", "d.html"), ("warn", "races", "e.html")]
    assert "5 reports, <strong>2 failing</strong>." in text


def racy() -> None:
    """Rank code writing a buffer while its all-reduce is in flight: one race finding per rank."""
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    t.add_(1)
    work.wait()


def test_a_diagnosis_text_lists_the_code_at_its_call_sites(tmp_path) -> None:
    line = racy.__code__.co_firstlineno + 3  # the all-reduce in racy
    page = ScenarioReport("t", command="")
    page.text("Diagnosis", f"rank 0 waits in all_reduce (issued at {__file__}:{line} in racy)", error=True)
    text = page.save(tmp_path / "t.html", [("x", True, "")]).read_text()
    assert f'<dt><code>{__file__}:{line}</code></dt><dd><pre class="code">work = dist.all_reduce(t, async_op=True)</pre>' in text
