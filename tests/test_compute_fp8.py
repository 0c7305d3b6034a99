"""FP8 and grouped GEMMs in the cost model: ``torch._scaled_mm`` and ``torch._grouped_mm`` (and its scaled form)
are priced by their FLOPs at the operands' rate, not as memory traffic."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from simdist.compute import DeviceSpec, estimate, get_device, op_flops

aten = torch.ops.aten
FP8 = torch.float8_e4m3fn
#: rates far enough apart that a charge shows which priced it; memory nearly free, so FLOPs set every time
CHIP = DeviceSpec(
    "fp8-chip",
    peak_flops={torch.float32: 50e12, torch.bfloat16: 500e12, FP8: 1000e12},
    memory_bandwidth=1e18,
    launch_overhead=0.0,
)
ONE = torch.tensor(1.0)


def fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(FP8)


def test_scaled_mm_counts_what_torchs_flop_counter_counts_at_the_fp8_rate() -> None:
    a, b = fp8(256, 512), fp8(128, 512).t()  # _scaled_mm takes its second operand column-major
    with FlopCounterMode(display=False) as counter:
        out = torch._scaled_mm(a, b, ONE, ONE, out_dtype=torch.bfloat16)
    flops = counter.get_total_flops()
    assert flops == 2 * 256 * 128 * 512
    assert op_flops(aten._scaled_mm.default, (a, b, ONE, ONE), {}, out) == flops
    _, charges = estimate(torch._scaled_mm, a, b, ONE, ONE, out_dtype=torch.bfloat16, device=CHIP)
    assert charges == [("aten::_scaled_mm", pytest.approx(flops / 1000e12, rel=1e-12))]


def test_an_fp8_gemm_on_an_h100_costs_its_flops_not_its_bytes() -> None:
    # On the meta device: the shape of an LLM's projection, far too large to run here
    a = torch.empty(8192, 8192, dtype=FP8, device="meta")
    b = torch.empty(8192, 8192, dtype=FP8, device="meta").t()
    h100 = get_device("H100")
    total, _ = estimate(
        torch._scaled_mm, a, b, ONE.to("meta"), ONE.to("meta"), out_dtype=torch.bfloat16, device=h100
    )
    flops = 2.0 * 8192**3
    assert total >= flops / h100.flops_for(FP8)
    # priced as memory traffic it took its operands' bytes (two FP8 inputs, a bf16 output) over the bandwidth
    memory = (2 * 8192 * 8192 + 2 * 8192 * 8192) / h100.memory_bandwidth
    assert total > 6 * memory


def grouped_flops(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> int:
    """The FLOPs of _grouped_mm as its groups' matmuls, one by one (offs cut the dimension the 2-D operands share)."""
    ends = offs.tolist() if offs is not None else None
    starts = [0, *ends[:-1]] if ends is not None else None
    total = 0
    if a.dim() == 3 and b.dim() == 3:
        for g in range(a.shape[0]):
            total += 2 * a.shape[1] * a.shape[2] * b.shape[2]
    elif a.dim() == 2 and b.dim() == 3:  # groups of rows of a, each with its own b[g]
        for g, (s, e) in enumerate(zip(starts, ends)):
            total += 2 * (e - s) * a.shape[1] * b.shape[2]
    elif a.dim() == 3 and b.dim() == 2:  # groups of columns of b, each with its own a[g]
        for g, (s, e) in enumerate(zip(starts, ends)):
            total += 2 * a.shape[1] * a.shape[2] * (e - s)
    else:  # both 2-D: groups of the shared K
        for s, e in zip(starts, ends):
            total += 2 * a.shape[0] * (e - s) * b.shape[1]
    return total


BF16 = torch.bfloat16
OFFS = torch.tensor([16, 40, 48], dtype=torch.int32)
GROUPED = {
    "3d x 3d": (torch.randn(3, 8, 32, dtype=BF16), torch.randn(3, 32, 16, dtype=BF16), None),
    "2d x 3d": (torch.randn(48, 32, dtype=BF16), torch.randn(3, 32, 16, dtype=BF16), OFFS),
    "3d x 2d": (torch.randn(3, 8, 32, dtype=BF16), torch.randn(32, 48, dtype=BF16), OFFS),
    "2d x 2d": (torch.randn(8, 48, dtype=BF16), torch.randn(48, 16, dtype=BF16), OFFS),
}


@pytest.mark.parametrize("case", GROUPED, ids=list(GROUPED))
def test_grouped_mm_counts_its_groups_matmuls(case: str) -> None:
    a, b, offs = GROUPED[case]
    out = torch._grouped_mm(a, b, offs)
    flops = grouped_flops(a, b, offs)
    assert op_flops(aten._grouped_mm.default, (a, b, offs), {}, out) == flops
    _, charges = estimate(torch._grouped_mm, a, b, offs, device=CHIP)
    assert charges == [("aten::_grouped_mm", pytest.approx(flops / 500e12, rel=1e-12))]
