"""Reports in a real browser (headless Chromium driven by playwright): no console errors, no network request,
hostile strings shown as text, and the interactions (sorting, hover, zoom, pan) working on the drawn data."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from browser import CHROMIUM

import simdist
from simdist.report import ScenarioReport, build_index, write_run_report

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # the dev extra installs it; a bare install of simdist does not need it
    sync_playwright = None

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="needs chromium on PATH and the playwright package (.ci/run installs both)",
)
HOSTILE = "<script>window.__pwned = 1</script>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Opened:
    """A page opened in the browser, with every console error, page error and request it made."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1300, "height": 1000})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-report-ready='1']")
        self.path = path

    def check_clean(self) -> None:
        """No script error, and the only request the page made is for its own file."""
        assert self.errors == [], self.errors
        assert self.requests == [self.path.as_uri()], self.requests
        assert self.page.evaluate("window.__pwned") is None

    def close(self, shot: Path) -> None:
        self.page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        self.page.close()


def step() -> dict[str, float]:
    """Compute, an async all-reduce overlapping it, a message ring, and a return value with a hostile key."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(256, 256)
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    torch.mm(x, x)
    work.wait()
    if rank % 2 == 0:
        dist.send(torch.ones(1024), (rank + 1) % world)
    else:
        dist.recv(torch.empty(1024), (rank - 1) % world)
    dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))
    return {HOSTILE: float(rank)}


@pytest.fixture(scope="module")
def run_result() -> simdist.RunResult:
    return simdist.run(step, simdist.Cluster.preset("dgx-h100", world_size=8), seed=3)


def span_point(opened: Opened, canvas: str, index: int) -> tuple[dict[str, Any], float, float]:
    """The timeline's span ``index`` and the viewport coordinates of its middle (the canvas scrolled into view),
    from the drawn canvas' layout."""
    opened.page.locator(canvas).scroll_into_view_if_needed()
    return opened.page.evaluate(
        """([sel, i]) => {
          const c = document.querySelector(sel), d = JSON.parse(document.getElementById(c.dataset.source).textContent);
          const lay = JSON.parse(c.dataset.layout), [t0, t1] = c.dataset.view.split(" ").map(Number);
          const r = c.getBoundingClientRect(), s = d.spans[i], w = c.clientWidth - lay.label - lay.right;
          const x = r.left + lay.label + ((s[1] + s[2]) / 2 - t0) / (t1 - t0) * w;
          const y = r.top + lay.axis + s[0] * lay.row + lay.row / 2;
          return [{row: d.rows[s[0]], label: s[4], detail: d.details[s[5]]}, x, y];
        }""",
        [canvas, index],
    )


def canvas_attr(page: Any, name: str) -> str:
    return page.locator("#timeline-canvas").get_attribute(name)


def test_a_run_report_is_clean_and_its_numbers_are_the_run_s(browser, run_result, tmp_path: Path) -> None:
    path = write_run_report(run_result, tmp_path / "run.html", program="step.py")
    opened = Opened(browser, path)
    opened.check_clean()
    page = opened.page
    assert page.text_content("#trace-hash") == run_result.trace_hash
    assert page.text_content("#rank-count") == "8"
    # the hostile return-value key is shown as text, not run
    assert HOSTILE in page.text_content("#returns")
    canvas = page.locator("#timeline-canvas")
    streams = {(s.rank, s.stream) for s in run_result.trace.spans}
    assert canvas.get_attribute("data-rows") == str(len(streams))
    assert canvas.get_attribute("data-spans-drawn") == str(len(run_result.trace.spans))
    opened.close(tmp_path / "run.png")


def test_sorting_a_column_orders_the_rows_by_its_values(browser, run_result, tmp_path: Path) -> None:
    opened = Opened(browser, write_run_report(run_result, tmp_path / "run.html"))
    page = opened.page
    times = "Array.from(document.querySelectorAll('#collective-table tbody tr')).map(r => +r.cells[7].dataset.value)"
    before = page.evaluate(times)
    assert len(before) == 2  # the all-reduce and the all-gather (send/recv are not collectives)
    page.click("#collective-table th:nth-child(8)")
    assert page.evaluate(times) == sorted(before)
    assert page.get_attribute("#collective-table th:nth-child(8)", "aria-sort") == "ascending"
    page.click("#collective-table th:nth-child(8)")
    assert page.evaluate(times) == sorted(before, reverse=True)
    ops = "Array.from(document.querySelectorAll('#collective-table tbody tr')).map(r => r.cells[0].textContent)"
    page.click("#collective-table th:nth-child(1)")
    assert page.evaluate(ops) == sorted(page.evaluate(ops))
    opened.check_clean()
    opened.close(tmp_path / "sorted.png")


def test_hover_names_the_span_and_zoom_and_pan_move_the_view(browser, run_result, tmp_path: Path) -> None:
    opened = Opened(browser, write_run_report(run_result, tmp_path / "run.html"))
    page = opened.page
    data = json.loads(page.text_content("#timeline-data"))
    # the longest communication span: wide enough to point at
    comm = max((i for i, s in enumerate(data["spans"]) if data["rows"][s[0]][1] != "compute"),
               key=lambda i: data["spans"][i][2] - data["spans"][i][1])
    span, x, y = span_point(opened, "#timeline-canvas", comm)
    page.mouse.move(x, y)
    tip = page.locator("#timeline .tooltip")
    assert tip.is_visible()
    text = tip.text_content()
    assert f"rank {span['row'][0]} · {span['row'][1]}" in text and span["detail"]["op"] in text
    assert f"algorithm {span['detail']['algorithm']}" in text
    # the collective's call site in the rank function (the longest span is the async all-reduce)
    assert f"at {__file__}:{step.__code__.co_firstlineno + 4} in step" in text, text
    # every rank's span of that all-reduce is outlined: the collective spans the ranks
    seq = span["detail"]["seq"]
    assert f"group {span['detail']['group']}, call #{seq}" in text
    assert canvas_attr(page, "data-highlighted") == f"{span['detail']['group']}#{seq} {run_result.world_size}"
    # a point-to-point send names its call site too
    send = next(i for i, s in enumerate(data["spans"]) if data["details"][s[5]]["op"] == "send")
    _, sx, sy = span_point(opened, "#timeline-canvas", send)
    page.mouse.move(sx, sy)
    assert f"at {__file__}:{step.__code__.co_firstlineno + 8} in step" in tip.text_content(), tip.text_content()
    page.mouse.move(x, y)
    canvas = page.locator("#timeline-canvas")
    t0, t1 = map(float, canvas.get_attribute("data-view").split())
    page.mouse.move(5, 5)  # off the canvas: no outline left
    assert canvas_attr(page, "data-highlighted") == ""
    page.mouse.move(x, y)
    page.mouse.wheel(0, -300)  # zoom in around the pointer
    z0, z1 = map(float, canvas.get_attribute("data-view").split())
    assert z1 - z0 < 0.9 * (t1 - t0) and t0 <= z0 < z1 <= t1
    page.mouse.down()
    page.mouse.move(x + 200, y)
    page.mouse.up()
    p0, p1 = map(float, canvas.get_attribute("data-view").split())
    assert p0 < z0 and abs((p1 - p0) - (z1 - z0)) < 1e-6 * (z1 - z0) + 1e-3  # panned back in time, same width
    page.mouse.dblclick(x, y)
    assert tuple(map(float, canvas.get_attribute("data-view").split())) == (t0, t1)
    opened.check_clean()
    opened.close(tmp_path / "zoomed.png")


def test_a_failed_run_shows_the_hostile_exception_as_text(browser, tmp_path: Path) -> None:
    def bad() -> None:
        if dist.get_rank() == 1:
            raise ValueError(HOSTILE)
        dist.barrier()

    try:
        simdist.run(bad, simdist.Cluster.switch(2))
    except simdist.RankError as e:
        error = e
    path = write_run_report(None, tmp_path / "bad.html", error=error, cluster=simdist.Cluster.switch(2))
    opened = Opened(browser, path)
    opened.check_clean()
    assert HOSTILE in opened.page.text_content("#diagnosis")
    opened.close(tmp_path / "bad.png")


def test_a_scenario_report_draws_its_runs_plots_and_verdicts(browser, run_result, tmp_path: Path) -> None:
    other = simdist.run(step, simdist.Cluster.preset("dgx-h100", world_size=8), seed=4)
    page_ = ScenarioReport(f"scenario {HOSTILE}", description="What it shows.\n\n(a) one\n(b) two", seed=3,
                           command="python x.py")
    page_.runs("Two seeds", {"seed 3": run_result, f"seed 4 {HOSTILE}": other}, ranks=[0, 1, 7])
    page_.line_plot("Drift", {HOSTILE: [(1, 0.0), (2, 1e-3), (3, 2e-2)]}, x_label="step", y_label="max |diff|",
                    log=True, marks={2: "first divergence"})
    page_.bar_plot("Time", {"a": {"step": 1e-3}, "b": {"step": 2e-3}}, y_label="time", unit="time")
    page_.table("Cases", ["case", "drift"], [[HOSTILE, 0.5], ["b", 0.25]])
    verdicts = [("held", True, "1.0x"), (HOSTILE, False, "detail")]
    path = page_.save(tmp_path / "scenario.html", verdicts)
    build_index(tmp_path)
    opened = Opened(browser, path)
    opened.check_clean()
    page = opened.page
    assert page.text_content("#scenario-verdict") == f"FAIL: 1 of 2 expectations failed, first: {HOSTILE}"
    rows = page.locator("#verdicts tbody tr")
    assert rows.count() == 2 and rows.nth(1).get_attribute("class") == "fail"
    # both timelines drawn, each with the three chosen ranks' rows and on one time scale
    canvases = page.locator("canvas.timeline-canvas")
    assert canvases.count() == 2
    views = {canvases.nth(i).get_attribute("data-view") for i in range(2)}
    assert views == {f"0.000 {max(run_result.sim_time, other.sim_time) * 1e6:.3f}"}
    for i, res in enumerate((run_result, other)):
        drawn = [s for s in res.trace.spans if s.rank in (0, 1, 7)]
        assert canvases.nth(i).get_attribute("data-spans-drawn") == str(len(drawn))
    # hovering the second timeline's all-reduce names its call site in the rank function
    all_reduce = json.loads(page.text_content("#two-seeds-1-data"))
    index = next(i for i, s in enumerate(all_reduce["spans"]) if all_reduce["details"][s[5]]["op"] == "all_reduce")
    _, x, y = span_point(opened, "#two-seeds-1-canvas", index)
    page.mouse.move(x, y)
    assert f"at {__file__}:{step.__code__.co_firstlineno + 4} in step" in page.locator("#two-seeds .tooltip").nth(1).text_content()
    assert page.locator("#drift-plot circle").count() == 3
    assert page.locator("#time-plot rect").count() == 2
    assert HOSTILE in page.text_content("#drift") and HOSTILE in page.text_content("#cases")
    opened.close(tmp_path / "scenario.png")
    # the index has no script of its own: opened plainly, it lists the page with its verdict and loads nothing
    listing = browser.new_page()
    requests: list[str] = []
    listing.on("request", lambda r: requests.append(r.url))
    listing.goto((tmp_path / "index.html").as_uri())
    assert "FAIL: 1 of 2 expectations failed" in listing.text_content("#reports")
    assert requests == [(tmp_path / "index.html").as_uri()]
    listing.close()
