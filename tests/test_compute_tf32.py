"""TF32 in the cost model: float32 matmuls and convolutions priced at a device's TF32 rate where torch's switches
allow TF32, read when each op is priced; every other op and dtype keeps its own rate."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

import simdist
from simdist.compute import DeviceSpec, estimate
from simdist.errors import ClusterSpecError

#: a device whose three rates differ enough that a charge shows which one priced it
CHIP = DeviceSpec(
    "tf32-chip",
    peak_flops={torch.float32: 50e12, torch.bfloat16: 700e12},
    memory_bandwidth=3e12,
    launch_overhead=5e-6,
    tf32_flops=350e12,
)
#: a compute-bound float32 matmul, on the meta device (shapes only)
N = 4096
MM_FLOPS = 2.0 * N**3


def mm_seconds(rate: float) -> float:
    """The closed-form time of the N x N x N matmul at ``rate`` FLOP/s on CHIP."""
    return MM_FLOPS / rate + CHIP.launch_overhead


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.fixture
def tf32_switches() -> Iterator[None]:
    """Leaves torch's TF32 switches as the test found them (torch's defaults: matmuls off, cuDNN on)."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    # Through the newer API first: a setting made there makes the legacy getters raise until it is undone.
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (matmul, cudnn)


ALLOW_MATMUL_TF32: dict[str, Callable[[], None]] = {
    "allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "precision high": lambda: torch.set_float32_matmul_precision("high"),
    "precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    "fp32_precision tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
}


def test_float32_matmuls_run_at_the_float32_rate_by_default(tf32_switches: None) -> None:
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default
    a = meta(N, N)
    assert estimate(torch.mm, a, a, device=CHIP)[0] == pytest.approx(mm_seconds(50e12))


@pytest.mark.parametrize("allow", ALLOW_MATMUL_TF32.values(), ids=ALLOW_MATMUL_TF32.keys())
def test_each_way_of_allowing_tf32_prices_float32_matmuls_at_the_tf32_rate(
    allow: Callable[[], None], tf32_switches: None
) -> None:
    a, b16 = meta(N, N), meta(N, N, dtype=torch.bfloat16)
    allow()
    assert estimate(torch.mm, a, a, device=CHIP)[0] == pytest.approx(mm_seconds(350e12))
    # other dtypes keep their own rate, and a device without TF32 units keeps float32's
    assert estimate(torch.mm, b16, b16, device=CHIP)[0] == pytest.approx(mm_seconds(700e12))
    no_tf32 = dataclasses.replace(CHIP, tf32_flops=None)
    assert estimate(torch.mm, a, a, device=no_tf32)[0] == pytest.approx(mm_seconds(50e12))


@pytest.mark.parametrize(
    ("op", "shapes", "flops"),
    [
        ("addmm", [(N,), (N, N), (N, N)], MM_FLOPS),
        ("bmm", [(4, N, N), (4, N, N)], 4 * MM_FLOPS),
        ("baddbmm", [(4, N, N), (4, N, N), (4, N, N)], 4 * MM_FLOPS),
        ("addbmm", [(N, N), (4, N, N), (4, N, N)], 4 * MM_FLOPS),
    ],
)
def test_every_gemm_follows_the_switch(
    op: str, shapes: list[tuple[int, ...]], flops: float, tf32_switches: None
) -> None:
    inputs = [meta(*s) for s in shapes]
    off = estimate(getattr(torch, op), *inputs, device=CHIP)[0]
    torch.backends.cuda.matmul.allow_tf32 = True
    on = estimate(getattr(torch, op), *inputs, device=CHIP)[0]
    assert (off, on) == (
        pytest.approx(flops / 50e12 + CHIP.launch_overhead),
        pytest.approx(flops / 350e12 + CHIP.launch_overhead),
    )


def test_the_switch_is_read_when_each_op_is_priced(tf32_switches: None) -> None:
    a = meta(N, N)

    def flip_between_two_matmuls() -> None:
        torch.mm(a, a)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.mm(a, a)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.mm(a, a)

    _, charges = estimate(flip_between_two_matmuls, device=CHIP)
    assert [s for _, s in charges] == [
        pytest.approx(mm_seconds(50e12)),
        pytest.approx(mm_seconds(350e12)),
        pytest.approx(mm_seconds(50e12)),
    ]


def test_attention_ignores_the_switches(tf32_switches: None) -> None:
    # The fused attention kernels run float32 without TF32 whatever the switches say. CPU tensors, not meta
    # ones: on the meta device torch takes the unfused path (two bmms), as a CPU run never does.
    q = torch.randn(1, 2, 256, 64)
    flops = 4.0 * 2 * 256 * 256 * 64
    off = estimate(F.scaled_dot_product_attention, q, q, q, device=CHIP)
    torch.backends.cuda.matmul.allow_tf32 = True
    on = estimate(F.scaled_dot_product_attention, q, q, q, device=CHIP)
    assert (
        on
        == off
        == (
            pytest.approx(flops / 50e12 + CHIP.launch_overhead),
            [
                (
                    "aten::_scaled_dot_product_flash_attention_for_cpu",
                    pytest.approx(flops / 50e12 + CHIP.launch_overhead),
                )
            ],
        )
    )


def test_float32_convolutions_follow_cudnns_switch(tf32_switches: None) -> None:
    x, w = meta(64, 256, 56, 56), meta(256, 256, 3, 3)
    flops = 2.0 * 64 * 256 * 56 * 56 * 256 * 3 * 3  # stride 1, padding 1: the output has the input's size
    assert torch.backends.cudnn.allow_tf32  # torch's default: cuDNN may use TF32
    on = estimate(lambda: F.conv2d(x, w, padding=1), device=CHIP)[0]
    torch.backends.cudnn.allow_tf32 = False
    off = estimate(lambda: F.conv2d(x, w, padding=1), device=CHIP)[0]
    assert (on, off) == (
        pytest.approx(flops / 350e12 + CHIP.launch_overhead),
        pytest.approx(flops / 50e12 + CHIP.launch_overhead),
    )


@pytest.mark.parametrize("bad", [0.0, -1e12, True, "350e12"])
def test_invalid_tf32_rate_is_rejected(bad: object) -> None:
    with pytest.raises(ClusterSpecError, match="tf32_flops must be a positive FLOP/s figure or None"):
        dataclasses.replace(CHIP, tf32_flops=bad)


def test_tf32_rate_survives_pickling_and_counts_for_zero_cost() -> None:
    assert pickle.loads(pickle.dumps(CHIP)) == CHIP
    free = DeviceSpec(
        "free", peak_flops={torch.float32: float("inf")}, memory_bandwidth=float("inf"), launch_overhead=0
    )
    assert free.is_zero_cost
    assert dataclasses.replace(free, tf32_flops=float("inf")).is_zero_cost
    assert not dataclasses.replace(free, tf32_flops=1e12).is_zero_cost


# --- in rank code: each rank's switches are its own, as each process's are -----------------------------------

N_RANK = 1024


def matmul_in_rank(allow: str | None) -> tuple[float, bool, str]:
    """Rank code: allow TF32 the way ``allow`` names (or not), time one float32 matmul on the rank's GPU; return
    its simulated seconds and the switches as the rank reads them."""
    if allow is not None:
        ALLOW_MATMUL_TF32[allow]()
    a = torch.ones(N_RANK, N_RANK, device="cuda")
    simdist.synchronize()
    start = simdist.now()
    a @ a
    simdist.synchronize()
    return simdist.now() - start, torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()


@pytest.mark.parametrize("allow", ["allow_tf32", "precision high"])
def test_a_rank_that_allows_tf32_is_priced_at_tf32_and_no_other_rank_is(
    allow: str, tf32_switches: None
) -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())

    def rank_code() -> tuple[float, bool, str]:
        return matmul_in_rank(allow if torch.distributed.get_rank() == 0 else None)

    result = simdist.run(rank_code, simdist.Cluster.switch(2, device=CHIP))
    flops = 2.0 * N_RANK**3
    (tf32_s, tf32_allowed, tf32_precision), (fp32_s, fp32_allowed, fp32_precision) = result.returns
    assert tf32_s == pytest.approx(flops / 350e12 + CHIP.launch_overhead)
    assert fp32_s == pytest.approx(flops / 50e12 + CHIP.launch_overhead)
    assert tf32_allowed and tf32_precision == "high"
    assert (fp32_allowed, fp32_precision) == (False, "highest")  # rank 1 sees its own process's defaults
    # and the process's switches are as the run found them
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before
