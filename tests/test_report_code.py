"""Source lines under the call sites a report shows: diagnosis errors (deadlock, mismatch, rank tracebacks) and
race findings, read from the files (a file that is gone shows nothing) and escaped."""

from __future__ import annotations

import importlib.util
import inspect
import json
import linecache
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.errors import safe_str
from simdist.report import render_run_report
from simdist.report.data import code_lines

HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    """The line of this file that ends with ``# marker`` (so tests do not hard-code line numbers)."""
    return next(i for i, text in enumerate(HERE.read_text().splitlines(), 1) if text.endswith(f"# {marker}"))


def deadlocked() -> None:
    t = torch.ones(2)
    if dist.get_rank() == 0:
        dist.recv(t, 1)  # site-recv
    else:
        dist.all_reduce(t)  # site-all-reduce


def mismatched() -> None:
    dist.all_reduce(torch.ones(2 + dist.get_rank()))  # site-mismatch


def raising() -> None:
    raise ValueError("no such parameter")  # site-raise


def racing() -> None:
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)  # site-in-flight
    t.add_(1)  # site-racing
    work.wait()


def stopped_by(fn: object) -> BaseException:
    with pytest.raises(simdist.SimdistError) as info:
        simdist.run(fn, simdist.Cluster.preset("switch", world_size=2))
    return info.value


@pytest.mark.parametrize(
    ("fn", "markers"),
    [(deadlocked, ["site-recv", "site-all-reduce"]), (mismatched, ["site-mismatch"]), (raising, ["site-raise"])],
)
def test_the_call_sites_of_a_diagnosis_come_with_their_code(fn: object, markers: list[str]) -> None:
    error = stopped_by(fn)
    found = code_lines(safe_str(error))
    expected = [(f"{HERE}:{line_of(m)}", linecache.getline(str(HERE), line_of(m)).strip()) for m in markers]
    # the rank's traceback passes through simdist's own files: they are how it ran, not where it went wrong
    assert found == expected
    page = render_run_report(None, error=error, cluster=simdist.Cluster.preset("switch", world_size=2))
    section = re.search(r'<dl class="code-lines" id="diagnosis-code">.*?</dl>', page, re.DOTALL).group(0)
    for site, code in expected:
        assert f"<code>{site}</code>" in section
        assert code.replace('"', "&#34;") in section


def test_race_findings_show_both_call_sites_with_their_code() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = simdist.run(racing, simdist.Cluster.preset("switch", world_size=2), races="warn")
    assert result.races
    page = render_run_report(result)
    finding = re.search(r'<div class="finding">.*?</div>', page, re.DOTALL).group(0)
    for marker in ("site-in-flight", "site-racing"):
        code = linecache.getline(str(HERE), line_of(marker)).strip()
        assert f'<pre class="code" title="{HERE}:{line_of(marker)}">{code}</pre>' in finding


def test_hostile_source_is_escaped_and_missing_files_show_nothing(tmp_path: Path) -> None:
    src = tmp_path / "hostile_rank.py"
    src.write_text('def f():\n    x = "<script>alert(1)</script>"; raise RuntimeError(x)\n')
    text = f'rank 0 stuck at {src}:2 in f\n  File "{src}", line 2, in f\n and at {tmp_path}/gone.py:7 in g'
    assert code_lines(text) == [(f"{src}:2", 'x = "<script>alert(1)</script>"; raise RuntimeError(x)')]

    class Stopped(Exception):
        pass

    page = render_run_report(None, error=Stopped(text), cluster=simdist.Cluster.preset("switch", world_size=2))
    section = re.search(r'<section id="diagnosis">.*?</section>', page, re.DOTALL).group(0)
    assert "<script>alert" not in section
    assert "x = &#34;&lt;script&gt;alert(1)&lt;/script&gt;&#34;; raise RuntimeError(x)" in section
    assert "gone.py:7</code>" not in section


def test_torch_sites_are_read_from_torch_and_long_lists_are_cut() -> None:
    site = "torch/distributed/distributed_c10d.py:1 in <module>, called from nowhere.py:3 in main"
    ((shown, code),) = code_lines(site)
    assert shown == "torch/distributed/distributed_c10d.py:1" and code
    many = " ".join(f"{HERE}:{i}" for i in range(1, 200))
    assert len(code_lines(many)) == 40


def two_collectives() -> None:
    t = torch.ones(8)
    dist.all_reduce(t)  # site-hover-all-reduce
    dist.broadcast(t, 0)  # site-hover-broadcast


def test_the_timeline_hover_names_each_collectives_call_site_and_the_trace_hash_ignores_it(tmp_path: Path) -> None:
    cluster = simdist.Cluster.preset("switch", world_size=2)
    result = simdist.run(two_collectives, cluster)
    page = render_run_report(result)
    payload = json.loads(re.search(r'<script type="application/json" id="timeline-data">(.*?)</script>', page, re.DOTALL).group(1))
    sites = {d["op"]: d.get("site") for d in payload["details"] if "bytes" in d}
    assert sites["all_reduce"] == f"{HERE}:{line_of('site-hover-all-reduce')} in two_collectives"
    assert sites["broadcast"] == f"{HERE}:{line_of('site-hover-broadcast')} in two_collectives"
    # every collective span of every rank has its site, keyed as the span names its call
    for s in result.trace.collectives():
        assert (s.rank, s.args["Process Group Name"], s.args["Seq"]) in result.call_sites
    # the sites live beside the trace: the hash is the one a copy of the trace without them has
    assert all("site" not in s.args for s in result.trace.spans)
    # the same program in another file, its calls on other lines: other sites, the same trace and hash
    moved = tmp_path / "moved_program.py"
    moved.write_text("import torch\nimport torch.distributed as dist\n\n\n" + inspect.getsource(two_collectives))
    spec = importlib.util.spec_from_file_location("moved_program", moved)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    elsewhere = simdist.run(module.two_collectives, cluster)
    assert set(elsewhere.call_sites.values()) & set(result.call_sites.values()) == set()
    assert elsewhere.trace_hash == result.trace_hash
