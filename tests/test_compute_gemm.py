"""The GEMM shape model: matmuls priced by tiles and waves over a device's SMs, split-K and the memory-bound regime,
each checked against its closed form on a small device, and as properties on the presets."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.compute import DeviceSpec, GemmShapeModel, estimate, get_device
from simdist.errors import ClusterSpecError

RATE = 100e12
SMS = 4
TILE = 128
#: one 128 x 128 tile at full efficiency, no per-wave cost, operands that stream at the full bandwidth
ONE_TILE = GemmShapeModel(
    tiles=((TILE, TILE, 1.0),), wave_seconds=0.0, split_k_depth=256, memory_efficiency=1.0
)
#: compute-bound everywhere (its memory is nearly free), four SMs, no launch overhead: a charge is the GEMM alone
CHIP = DeviceSpec(
    "gemm-chip",
    peak_flops={torch.float32: RATE, torch.bfloat16: RATE},
    memory_bandwidth=1e18,
    launch_overhead=0.0,
    multiprocessors=SMS,
    gemm=ONE_TILE,
)


def mm_seconds(m: int, n: int, k: int, device: DeviceSpec = CHIP, batch: int = 0) -> float:
    """What the model charges for one bf16 [m, k] @ [k, n] (or a bmm of ``batch``), on meta tensors."""
    lead = (batch,) if batch else ()
    a = torch.empty(*lead, m, k, dtype=torch.bfloat16, device="meta")
    b = torch.empty(*lead, k, n, dtype=torch.bfloat16, device="meta")
    total, charges = estimate(torch.bmm if batch else torch.mm, a, b, device=device)
    assert len(charges) == 1
    return total


def tile_seconds(k: float) -> float:
    """One 128 x 128 tile of depth ``k`` on one of CHIP's SMs."""
    return 2.0 * TILE * TILE * k / (RATE / SMS)


@given(rows=st.integers(1, 6), cols=st.integers(1, 6), k=st.integers(1, 64).map(lambda x: 64 * x))
def test_whole_tiles_in_whole_waves_run_at_the_device_rate(rows: int, cols: int, k: int) -> None:
    if rows * cols % SMS:
        cols = SMS  # a whole number of waves
    m, n = TILE * rows, TILE * cols
    assert mm_seconds(m, n, k) == pytest.approx(2.0 * m * n * k / RATE, rel=1e-12)


def test_a_partial_wave_costs_a_whole_one() -> None:
    # SMS + 1 tiles: two waves, the second with one tile
    assert mm_seconds(TILE, TILE * (SMS + 1), 512) == pytest.approx(2 * tile_seconds(512), rel=1e-12)


def test_with_stream_k_a_partial_last_wave_costs_its_share_of_a_wave() -> None:
    chip = dataclasses.replace(CHIP, gemm=dataclasses.replace(ONE_TILE, stream_k=True, wave_seconds=1e-6))
    # SMS + 1 tiles: one whole wave, then one tile's multiply-adds over the SMS SMs; two waves' fixed costs
    expected = (1 + 1 / SMS) * tile_seconds(512) + 2 * 1e-6
    assert mm_seconds(TILE, TILE * (SMS + 1), 512, chip) == pytest.approx(expected, rel=1e-12)
    # whole waves cost what they cost without stream-K
    assert mm_seconds(TILE, TILE * 2 * SMS, 512, chip) == pytest.approx(
        2 * (tile_seconds(512) + 1e-6), rel=1e-12
    )


def test_stream_k_must_be_a_bool() -> None:
    with pytest.raises(ClusterSpecError, match="stream_k must be a bool"):
        GemmShapeModel(stream_k=1)  # type: ignore[arg-type]


def test_a_partial_tile_costs_a_whole_one() -> None:
    whole = mm_seconds(2 * TILE, 2 * TILE, 512)
    assert mm_seconds(TILE + 1, 2 * TILE, 512) == whole == pytest.approx(tile_seconds(512))


def test_k_is_split_over_idle_sms_in_pieces_no_shallower_than_split_k_depth() -> None:
    # one tile, K deep enough for every SM to take a piece: the four SMs share it
    assert mm_seconds(TILE, TILE, SMS * 1024) == pytest.approx(tile_seconds(1024), rel=1e-12)
    # K of two pieces: two SMs, each 256 deep
    assert mm_seconds(TILE, TILE, 512) == pytest.approx(tile_seconds(256), rel=1e-12)
    # K shallower than one piece is not split
    assert mm_seconds(TILE, TILE, 100) == pytest.approx(tile_seconds(100), rel=1e-12)


def test_the_library_picks_the_tile_that_finishes_first() -> None:
    small = GemmShapeModel(tiles=((TILE, TILE, 1.0), (64, 64, 0.5)), wave_seconds=0.0, memory_efficiency=1.0)
    chip = dataclasses.replace(CHIP, gemm=small)
    # 256 x 256 at K 256: four 128-tiles fill one wave (tile_seconds(256)); sixteen 64-tiles take four waves
    # of a quarter of the work at half the efficiency (2 x tile_seconds(256))
    assert mm_seconds(256, 256, 256, chip) == pytest.approx(tile_seconds(256), rel=1e-12)
    # 64 x 64 at K 256: one 128-tile, or one 64-tile at a quarter of the work and half the efficiency
    assert mm_seconds(64, 64, 256, chip) == pytest.approx(tile_seconds(256) / 2, rel=1e-12)


def test_each_wave_pays_its_fixed_cost() -> None:
    chip = dataclasses.replace(CHIP, gemm=dataclasses.replace(ONE_TILE, wave_seconds=1e-6))
    assert mm_seconds(TILE, TILE * (SMS + 1), 512, chip) == pytest.approx(2 * (tile_seconds(512) + 1e-6))


def test_a_skinny_gemm_streams_its_operands_at_the_models_share_of_the_bandwidth() -> None:
    chip = dataclasses.replace(
        CHIP,
        peak_flops={torch.float32: 1e18, torch.bfloat16: 1e18},
        memory_bandwidth=1e12,
        gemm=dataclasses.replace(ONE_TILE, memory_efficiency=0.5),
    )
    m, n, k = 1, 4096, 4096
    moved = 2 * (m * k + k * n + m * n)
    assert mm_seconds(m, n, k, chip) == pytest.approx(moved / 0.5e12, rel=1e-12)


def test_a_batch_multiplies_the_tiles() -> None:
    assert mm_seconds(TILE, TILE, 512, batch=SMS + 1) == pytest.approx(2 * tile_seconds(512), rel=1e-12)


@given(
    m=st.integers(1, 8192),
    n=st.integers(1, 8192),
    k=st.integers(1, 8192),
    dim=st.sampled_from(["m", "n", "k"]),
    grow=st.integers(1, 4096),
    device=st.sampled_from(["H100", "A100"]),
)
def test_no_gemm_gets_faster_as_a_dimension_grows(
    m: int, n: int, k: int, dim: str, grow: int, device: str
) -> None:
    spec = get_device(device)
    bigger = {"m": m, "n": n, "k": k}
    bigger[dim] += grow
    assert mm_seconds(**bigger, device=spec) >= mm_seconds(m, n, k, spec)


@given(m=st.integers(1, 8192), n=st.integers(1, 8192), k=st.integers(1, 8192))
def test_no_gemm_beats_the_roofline(m: int, n: int, k: int) -> None:
    h100 = get_device("H100")
    roofline = dataclasses.replace(h100, gemm=None)
    assert mm_seconds(m, n, k, h100) >= mm_seconds(m, n, k, roofline) * (1 - 1e-12)


def test_the_gpu_presets_use_the_shape_model_over_their_sms() -> None:
    for name, sms, stream_k in (
        ("H100", 132, True),
        ("H200", 132, True),
        ("A100", 108, False),
        ("A100-40GB", 108, False),
    ):
        spec = get_device(name)
        assert spec.gemm == GemmShapeModel(stream_k=stream_k) and spec.multiprocessors == sms
    assert get_device("cpu").gemm is None
    # a large bf16 GEMM on an H100: 4096^3 in 128 x 256 tiles is 512 tiles, three waves of 132 and 116 tiles
    # whose multiply-adds stream-K spreads over the 132 SMs; four waves' fixed costs
    h100 = get_device("H100")
    per_sm = h100.flops_for(torch.bfloat16) / 132
    expected = (3 + 116 / 132) * 2.0 * 128 * 256 * 4096 / per_sm + 4 * 0.5e-6 + h100.launch_overhead
    assert mm_seconds(4096, 4096, 4096, h100) == pytest.approx(expected, rel=1e-12)
    # on an A100 (no stream-K), 4096^3 is 512 tiles, 4.7 waves of 108 run as 5
    a100 = get_device("A100")
    per_sm = a100.flops_for(torch.bfloat16) / 108
    expected = 5 * (2.0 * 128 * 256 * 4096 / per_sm + 0.5e-6) + a100.launch_overhead
    assert mm_seconds(4096, 4096, 4096, a100) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tiles": ()}, "tiles must be"),
        ({"tiles": ((128, 128, 1.5),)}, "tiles must be"),
        ({"tiles": ((0, 128, 1.0),)}, "tiles must be"),
        ({"wave_seconds": -1.0}, "wave_seconds must be"),
        ({"wave_seconds": math.inf}, "wave_seconds must be"),
        ({"split_k_depth": 0}, "split_k_depth must be"),
        ({"memory_efficiency": 0.0}, "memory_efficiency must be"),
    ],
)
def test_an_invalid_shape_model_is_refused(change: dict, message: str) -> None:
    with pytest.raises(ClusterSpecError, match=message):
        dataclasses.replace(ONE_TILE, **change)


def test_a_device_refuses_a_shape_model_of_another_type_and_pickles_with_its_own() -> None:
    with pytest.raises(ClusterSpecError, match="gemm must be a simdist.compute.GemmShapeModel or None"):
        dataclasses.replace(CHIP, gemm={"tiles": ()})
    assert pickle.loads(pickle.dumps(CHIP)) == CHIP and pickle.loads(pickle.dumps(CHIP)).gemm == ONE_TILE
