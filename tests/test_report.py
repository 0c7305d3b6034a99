"""HTML run reports: content read from the generated page, escaping of user strings, the index, the CLI, and the
page opened in headless Chromium (its script ran without errors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from browser import chromium, needs_chromium

import simdist
from simdist import cli
from simdist.bench import bench
from simdist.report import build_index, data, render_run_report, write_run_report

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def overlapped_step() -> dict[str, float]:
    """Compute overlapped with an async all-reduce, an all-gather and a message, returning a hostile key."""
    rank = dist.get_rank()
    t = torch.ones(1 << 14)
    w = torch.randn(128, 128)
    h = dist.all_reduce(t, async_op=True)
    w = w @ w
    h.wait()
    dist.all_gather([torch.empty(256), torch.empty(256)], t[:256])
    if rank == 0:
        dist.send(t[:8], 1)
    else:
        dist.recv(t[:8], 0)
    return {HOSTILE: float(t[0])}


def failing_step() -> None:
    raise ValueError(f"bad parameter {HOSTILE}")


@pytest.fixture(scope="module")
def result() -> simdist.RunResult:
    return simdist.run(overlapped_step, simdist.Cluster.preset("switch", world_size=2), memory=True)


@pytest.fixture(scope="module")
def page(result: simdist.RunResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return result.save_report(tmp_path_factory.mktemp("reports") / "step.html")


def test_the_page_has_its_sections_and_the_runs_facts(result: simdist.RunResult, page: Path) -> None:
    text = page.read_text()
    for section in ("timeline", "collectives", "breakdown", "memory", "races", "returns"):
        assert f'<section id="{section}">' in text
    assert f'<code id="trace-hash">{result.trace_hash}</code>' in text
    assert '<span id="rank-count">2</span>' in text
    assert 'id="program">overlapped_step<' in text
    assert not re.search(r"https?://", text), "a report must load nothing from the network"
    assert "<link" not in text and " src=" not in text


def test_user_strings_are_escaped(page: Path, tmp_path: Path) -> None:
    assert HOSTILE not in page.read_text() and ESCAPED in page.read_text()
    cluster = simdist.Cluster.preset("switch", world_size=2)
    with pytest.raises(simdist.RankError) as info:
        simdist.run(failing_step, cluster)
    failed = render_run_report(None, error=info.value, cluster=cluster, seed=0, program=HOSTILE, title=HOSTILE)
    assert HOSTILE not in failed
    assert failed.count(ESCAPED) >= 3  # title, program, the diagnosis text
    assert '<section id="diagnosis">' in failed and '<section id="timeline">' not in failed


def test_the_collective_table_matches_nccl_tests_figures_from_simdist_bench() -> None:
    cluster = simdist.Cluster.preset("switch", world_size=4)
    (row,) = bench(cluster, "all_reduce", 1 << 16, 1 << 16)

    def one_all_reduce() -> None:
        dist.all_reduce(torch.ones((1 << 16) // 4))

    res = simdist.run(one_all_reduce, cluster, compute=False)
    (mine,) = data.collective_rows(res.trace)
    assert (mine.op, mine.nbytes, mine.ranks) == ("all_reduce", row.size, 4)
    assert mine.time * 1e6 == pytest.approx(row.time_us)
    assert mine.busbw / 1e9 == pytest.approx(row.busbw)
    assert mine.busbw == pytest.approx(mine.algbw * 2 * 3 / 4)


def test_the_breakdown_agrees_with_the_traces_busy_times(result: simdist.RunResult) -> None:
    for b in data.breakdowns(result.trace, result.finish_times):
        assert b.compute == pytest.approx(result.trace.busy_time(b.rank, "compute"))
        comm = sum(result.trace.busy_time(b.rank, p) for p in ("comm", "p2p"))
        assert comm >= b.communication - 1e-15
        assert 0 <= b.exposed <= b.communication + 1e-15
        assert b.exposed < b.communication, "the async all-reduce overlaps the matmul"


def test_large_runs_draw_a_sample_that_keeps_the_first_and_last_rank() -> None:
    ranks = data.sampled_ranks(1024)
    assert len(ranks) == data.MAX_TIMELINE_RANKS and ranks[0] == 0 and ranks[-1] == 1023
    assert data.sampled_ranks(8) == list(range(8))


def test_the_cli_writes_a_report_and_the_index_lists_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch, torch.distributed as dist\ndef main():\n    dist.all_reduce(torch.ones(4))\n")
    bad = tmp_path / "bad.py"
    bad.write_text(f"def main():\n    raise ValueError({HOSTILE!r})\n")
    assert cli.main(["run", str(script), "--entry", "main", "--world-size", "2", "--report", str(tmp_path / "train.html")]) == 0
    assert cli.main(["run", str(bad), "--entry", "main", "--world-size", "2", "--report", str(tmp_path / "bad.html")]) == 1
    assert cli.main(["report", str(tmp_path)]) == 0
    index = (tmp_path / "index.html").read_text()
    assert re.search(r'<a href="train.html">\s*simdist run: train.py\s*</a>', index)
    assert re.search(r'<a href="bad.html">\s*simdist run: bad.py\s*</a>', index) and "FAILED (RankError)" in index
    assert "2 ranks of" in index
    assert ESCAPED in (tmp_path / "bad.html").read_text()
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@needs_chromium
def test_the_page_runs_in_a_browser_without_errors(result: simdist.RunResult, page: Path) -> None:
    dom = chromium("--dump-dom", page.as_uri())
    body = re.search(r"<body [^>]*>", dom).group(0)
    assert 'data-js-errors=""' in body and 'data-report-ready="1"' in body
    streams = {(s.rank, s.stream) for s in result.trace.spans}
    assert f'data-timeline-rows="{len(streams)}"' in body
    assert f'data-timeline-spans-drawn="{len(result.trace.spans)}"' in body
    assert HOSTILE not in dom.replace("<script>alert(1)<\\/script>", "") and ESCAPED in dom
    shot = page.with_suffix(".png")
    chromium("--window-size=1300,1400", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_chromium
def test_the_browser_check_sees_a_script_error(page: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("</body>", "<script>notDefinedAnywhere()</script></body>"))
    body = re.search(r"<body [^>]*>", chromium("--dump-dom", broken.as_uri())).group(0)
    assert "notDefinedAnywhere is not defined" in body


def test_write_run_report_refuses_nothing_to_report(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a RunResult"):
        write_run_report(None, tmp_path / "x.html")
    assert build_index(tmp_path).read_text().count("<li>") == 0


class Hostile(torch.nn.Module):
    """A model whose only parameter's name is markup."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_parameter("w<b>x</b>", torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ getattr(self, "w<b>x</b>")


def _train(summed: bool) -> None:
    """Each rank its half of the batch; gradients all-reduced, and averaged unless ``summed`` (the bug)."""
    model, world = Hostile(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(x.chunk(world)[dist.get_rank()]).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if not summed:
                p.grad /= world
        opt.step()


def _reference() -> None:
    model = Hostile()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_an_equivalence_report_shows_the_verdict_and_divergences_escaped(tmp_path: Path) -> None:
    cluster = simdist.Cluster.switch(2, device="cpu")
    bad = simdist.check_equivalence(_train, _reference, cluster, args=(True,), reference_args=())
    good = simdist.check_equivalence(_train, _reference, cluster, args=(False,), reference_args=())
    assert not bad.ok and good.ok
    page = bad.save_report(tmp_path / "bad.html")
    html = page.read_text()
    assert 'id="equivalence-verdict">Diverged at step 0<' in html and 'id="divergences"' in html
    assert "w&lt;b&gt;x&lt;/b&gt;" in html and "w<b>x</b>" not in html
    # the gradient row: its name (escaped), ranks, max |diff|, rel, and the factor by which the summed gradient
    # is the reference's (2 ranks)
    row = r"<td>grad</td><td><code>w&lt;b&gt;x&lt;/b&gt;</code></td><td>0-1</td>\s*<td>[^<]+</td><td>[^<]+</td><td>2</td>"
    assert re.search(row, html), html[html.index('id="divergences"'):][:800]
    assert 'id="timeline"' in html and f'id="trace-hash">{bad.parallel.trace_hash}<' in html
    ok_html = good.save_report(tmp_path / "good.html").read_text()
    assert 'id="equivalence-verdict">Equivalent<' in ok_html and 'id="divergences"' not in ok_html
    index = build_index(tmp_path).read_text()
    assert "DIVERGED" in index and "equivalent: " in index


@needs_chromium
def test_an_equivalence_report_runs_in_a_browser_without_errors(tmp_path: Path) -> None:
    rep = simdist.check_equivalence(_train, _reference, simdist.Cluster.switch(2, device="cpu"), args=(True,),
                                    reference_args=())
    page = rep.save_report(tmp_path / "check.html")
    body = re.search(r"<body [^>]*>", chromium("--dump-dom", page.as_uri())).group(0)
    assert 'data-js-errors=""' in body and 'data-report-ready="1"' in body
