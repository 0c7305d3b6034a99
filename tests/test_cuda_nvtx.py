"""NVTX ranges on a simulated GPU: named spans in the trace and the run report, nested, at simulated times.

Oracles: closed forms over charged durations and the cost model's price of a matmul (where each range starts and
ends on the host and on the device), the nesting the program wrote.
"""

from __future__ import annotations

import math

import torch
from torch.cuda import nvtx

import simdist
from simdist.compute import op_cost
from simdist.compute.devices import H100
from simdist.report import data
from simdist.trace.trace import NVTX, NVTX_DEVICE

ONE = simdist.Cluster.switch(1, device="H100")
A, B, C = 3e-6, 5e-6, 7e-6


def _ranges():
    torch.cuda.set_device(0)
    x = torch.ones(256, 256, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    simdist.charge(A)
    with nvtx.range("step {}", 1):
        simdist.charge(B)
        depth_in = nvtx.range_push("matmul")
        x @ x
        torch.cuda.synchronize()  # the host reaches the device here
        depth_out = nvtx.range_pop()
        simdist.charge(C)
        nvtx.mark("charged")
    handle = nvtx.range_start("by handle")
    nvtx.range_end(handle)
    return t0, depth_in, depth_out, nvtx.range_pop()


def test_nvtx_ranges_are_nested_spans_on_the_host_and_projected_on_the_device():
    res = simdist.run(_ranges, ONE)
    t0, depth_in, depth_out, unmatched = res.returns[0]
    assert (depth_in, depth_out, unmatched) == (1, 1, -1)
    a = torch.empty(256, 256)
    mm = op_cost(torch.ops.aten.mm.default, (a, a), {}, a @ a, H100)
    spans = {
        (s.stream, s.name): (s.start - t0, s.end - t0, s.args["depth"])
        for s in res.trace.spans
        if s.stream in (NVTX, NVTX_DEVICE)
    }
    close = lambda got, want: all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-15) for g, w in zip(got, want))
    # on the device: from where the stream was at the push to where it was at the pop
    assert close(spans[(NVTX_DEVICE, "step 1")], (A, A + B + mm + C, 0))
    assert close(spans[(NVTX_DEVICE, "matmul")], (A + B, A + B + mm, 1))
    assert close(spans[(NVTX_DEVICE, "charged")], (A + B + mm + C, A + B + mm + C, 1))
    # on the host, which runs ahead: it opened both ranges at once and reached the device at the synchronize
    assert close(spans[(NVTX, "step 1")], (0, A + B + mm, 0))
    assert close(spans[(NVTX, "matmul")], (0, A + B + mm, 1))
    assert (NVTX, "by handle") in spans and (NVTX_DEVICE, "by handle") in spans
    chrome = res.trace.to_chrome()["traceEvents"]
    assert {e["cat"] for e in chrome if e.get("name") == "step 1"} == {"user_annotation"}


def test_the_report_timeline_draws_ranges_one_row_per_depth_and_does_not_count_them_as_communication(
    tmp_path,
):
    res = simdist.run(_ranges, ONE)
    timeline = data.timeline(res.trace, [0], {})
    rows = [name for _, name in timeline["rows"]]
    assert rows == ["compute", "nvtx", "nvtx 1", "nvtx:device", "nvtx:device 1"]
    labels = {(rows[s[0]], s[4]) for s in timeline["spans"]}
    assert {("nvtx", "step 1"), ("nvtx 1", "matmul"), ("nvtx:device 1", "charged")} <= labels
    (breakdown,) = data.breakdowns(res.trace, res.finish_times)
    assert breakdown.communication == 0 and breakdown.compute > 0
    page = res.save_report(tmp_path / "run.html").read_text()
    assert '"nvtx:device 1"' in page and '"step 1"' in page and "nvtx range" in page


@torch.profiler.record_function("helper")
def _helper(x: torch.Tensor) -> torch.Tensor:
    return x @ x


def _record_functions():
    torch.cuda.set_device(0)
    model = torch.nn.Linear(256, 256).to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(256, 256, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    with torch.profiler.record_function("outer"):
        simdist.charge(A)
        _helper(x)
        _helper(x)
    model(x).sum().backward()
    opt.step()  # torch opens its own record_function range here: not the program's
    return t0


def test_record_function_ranges_of_the_program_are_spans_and_torchs_own_are_not():
    res = simdist.run(_record_functions, ONE)
    t0 = res.returns[0]
    a = torch.empty(256, 256)
    mm = op_cost(torch.ops.aten.mm.default, (a, a), {}, a @ a, H100)
    device = [
        (s.name, s.start - t0, s.end - t0, s.args["depth"])
        for s in res.trace.spans
        if s.stream == NVTX_DEVICE
    ]
    # the first matmul starts once the charge is done and the host has launched it; the second, launched while
    # the first runs, right after it
    first = max(A, H100.host_overhead)
    assert mm > H100.host_overhead
    expected = [("helper", A, first + mm, 1), ("helper", first + mm, first + 2 * mm, 1), ("outer", 0.0, first + 2 * mm, 0)]
    assert [d[0] for d in device] == [e[0] for e in expected]
    for got, want in zip(device, expected):
        assert all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-15) for g, w in zip(got[1:], want[1:]))
