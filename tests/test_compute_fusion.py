"""Regions ``torch.compile`` compiled: their chains of elementwise ops are priced as one fused kernel each (one pass
over what the chain reads from outside it and what it writes for later), their values those of the eager code.
Closed forms in bytes on a device that prices bytes only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import simdist
from simdist.compute import DeviceSpec

N = 1 << 16
F32 = 4
BANDWIDTH = 1e12
KERNEL = 1e-6
#: a GPU whose ops cost their bytes at 1 TB/s plus 1 us, launched in no host time: a span is bytes / 1e12 + 1e-6
CHIP = DeviceSpec(
    "fusion-chip", peak_flops={torch.float32: 1e18}, memory_bandwidth=BANDWIDTH, launch_overhead=KERNEL
)


def seconds(nbytes: int) -> float:
    return nbytes / BANDWIDTH + KERNEL


def compiled(fn):
    """``fn`` compiled in rank code, where the run's torch.compile fuses (the eager backend: the CPU twin's values)."""
    return lambda *args: torch.compile(fn, backend="eager")


def kernels(make, *args) -> tuple[list[tuple[str, float]], object]:
    """``make(*args)`` in a simulated rank makes a function; run it on ``args`` (after one warm-up call): its compute
    spans (name, seconds) and result."""

    def rank():
        fn = make(*args)
        fn(*args)
        simdist.synchronize()
        start = simdist.now()
        out = fn(*args)
        simdist.synchronize()
        return start, out

    res = simdist.run(rank, simdist.Cluster.switch(1, device=CHIP), trace="collectives")
    start, out = res.returns[0]
    spans = [(s.name, s.end - s.start) for s in res.trace.spans if s.stream == "compute" and s.start >= start]
    return spans, out


def chain(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x * 2 + 1) * 3


def test_an_elementwise_chain_is_one_pass_over_its_input_and_output() -> None:
    x = torch.randn(N)
    fused, out = kernels(compiled(chain), x)
    assert fused == [("fused::mul_add_gelu_mul", pytest.approx(seconds(2 * N * F32), rel=1e-12))]
    eager, eager_out = kernels(lambda *args: chain, x)
    # eagerly each op reads its input and writes its output
    assert eager == [
        (f"aten::{op}", pytest.approx(seconds(2 * N * F32), rel=1e-12))
        for op in ("mul", "add", "gelu", "mul")
    ]
    assert torch.equal(out, eager_out) and torch.equal(out, chain(x))


def keeps_an_intermediate(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x * y
    return h, torch.relu(h + x)


def test_what_the_region_returns_is_written_and_each_input_read_once() -> None:
    x, y = torch.randn(N), torch.randn(N)
    fused, _ = kernels(compiled(keeps_an_intermediate), x, y)
    # reads x and y once each (x twice in the code); writes h and the result
    assert fused == [("fused::mul_add_relu", pytest.approx(seconds(4 * N * F32), rel=1e-12))]


def around_a_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.sigmoid(x) * 2
    return torch.tanh(h @ w) + 1


def test_a_matmul_splits_the_chains_and_what_it_reads_is_written() -> None:
    m = 256
    x, w = torch.randn(m, m), torch.randn(m, m)
    fused, _ = kernels(compiled(around_a_matmul), x, w)
    tile = m * m * F32
    # the matmul is priced when it runs, the chains when the region returns; the first writes h, which the
    # matmul reads
    assert fused == [
        ("aten::mm", pytest.approx(seconds(3 * tile), rel=1e-12)),
        ("fused::sigmoid_mul", pytest.approx(seconds(2 * tile), rel=1e-12)),
        ("fused::tanh_add", pytest.approx(seconds(2 * tile), rel=1e-12)),
    ]


def test_a_compiled_module_fuses_its_forward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.GELU(), torch.nn.Dropout(0.0))
    x = torch.randn(128, 64)
    fused, out = kernels(compiled(model), x)
    act = 128 * 64 * F32
    assert [name for name, _ in fused] == ["aten::mm", "fused::gelu"]
    assert fused[1][1] == pytest.approx(seconds(2 * act), rel=1e-12)
    assert torch.equal(out, model(x))
