"""The attention model: FlashAttention's FLOP count, torch's choice of kernel on a GPU, the tile model's shape
properties, its fitted constants, and what runs and ``estimate`` charge for ``scaled_dot_product_attention``.

Oracles: hand-computed FLOP counts (FlashAttention's 4 b h s_q s_k d forward, 2.5 times that backward, the causal
pairs counted one by one), torch's sdp_utils.cpp rules for the kernel it picks, the fit script's closed forms (the
constants must be its output, and the model must give back the rows they were fitted to), and the roofline (no
kernel is priced faster than its FLOPs at the device's rate).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import simdist
from simdist.compute import estimate, get_device, op_flops
from simdist.compute.attention import (
    AMPERE_ATTENTION,
    BACKENDS,
    HOPPER_ATTENTION,
    AttentionModel,
    KernelFit,
    sdpa_backend,
)
from simdist.errors import ClusterSpecError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # benchmarks/ is a folder of scripts, not a package

import fidelity_attention

aten = torch.ops.aten
H100 = get_device("H100")
A100 = get_device("A100")


def _qkv(b: int, h: int, s: int, d: int, dtype: torch.dtype = torch.bfloat16, sk: int | None = None) -> tuple:
    q = torch.empty(b, h, s, d, dtype=dtype, device="meta")
    kv = torch.empty(b, h, s if sk is None else sk, d, dtype=dtype, device="meta")
    return q, kv, kv


# ------------------------------------------------------------------------------------------------ FLOP counts
def test_forward_flops_are_flashattentions_count_by_hand() -> None:
    # 4 b h s_q s_k d: b=2, h=3, s=5, d=4 -> 4 * 2 * 3 * 5 * 5 * 4 = 2400
    q, k, v = _qkv(2, 3, 5, 4)
    out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    assert op_flops(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), {}, out) == 2400


def test_causal_forward_counts_the_pairs_the_mask_keeps_by_hand() -> None:
    # query i sees keys 0..i: 1 + 2 + 3 + 4 + 5 = 15 of 25 pairs, each 2 * (d + d) = 16 FLOPs over b h = 6 -> 1440
    q, k, v = _qkv(2, 3, 5, 4)
    args = (q, k, v, 0.0, True)
    out = aten._scaled_dot_product_flash_attention_for_cpu(*args)
    assert op_flops(aten._scaled_dot_product_flash_attention_for_cpu.default, args, {}, out) == 1440
    # longer keys than queries: query i sees i + 1 keys, 1 + 2 + 3 = 6 pairs -> 6 * 16 * 6 = 576
    q, k, v = _qkv(2, 3, 3, 4, sk=7)
    args = (q, k, v, 0.0, True)
    out = aten._scaled_dot_product_flash_attention_for_cpu(*args)
    assert op_flops(aten._scaled_dot_product_flash_attention_for_cpu.default, args, {}, out) == 576


def test_backward_flops_are_two_and_a_half_times_the_forward_by_hand() -> None:
    # 2.5 * 2400 = 6000 (five matmuls of 2 b h s s d where the forward has two)
    q, k, v = _qkv(2, 3, 5, 4)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    args = (out, q, k, v, out, lse, 0.0, False)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(*args)
    assert (
        op_flops(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, args, {}, grads) == 6000
    )


# --------------------------------------------------------------------------------------- torch's choice of kernel
HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize(
    ("capability", "dtype", "d", "masked", "causal", "expected"),
    [
        # cuDNN first on sm90 (check_prefer_cudnn_attention)
        (HOPPER, torch.bfloat16, 128, False, True, "cudnn"),
        (HOPPER, torch.float16, 64, True, False, "cudnn"),  # cuDNN takes a mask
        (HOPPER, torch.bfloat16, 256, False, False, "flash"),  # above cuDNN's 128: flash takes up to 256
        (HOPPER, torch.bfloat16, 256, True, False, "efficient"),  # flash takes no mask
        (HOPPER, torch.float32, 128, False, False, "efficient"),  # flash and cuDNN take only 16-bit floats
        (HOPPER, torch.float32, 30, False, False, "math"),  # 30 is no multiple of 4: no fused kernel
        (AMPERE, torch.bfloat16, 128, False, False, "flash"),  # sm80: flash first, cuDNN last
        (AMPERE, torch.bfloat16, 128, True, False, "efficient"),
        (AMPERE, torch.float32, 64, False, True, "efficient"),
        ((7, 5), torch.float16, 64, False, False, "efficient"),  # flash needs sm80
    ],
)
def test_backend_is_torchs_choice(
    capability: tuple[int, int], dtype: torch.dtype, d: int, masked: bool, causal: bool, expected: str
) -> None:
    q, k, v = _qkv(1, 2, 64, d, dtype)
    assert sdpa_backend(capability, dtype, q, k, v, masked, 0.0, causal) == expected


def test_backend_follows_torchs_switches_and_causal_rules() -> None:
    q, k, v = _qkv(1, 2, 64, 128)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert sdpa_backend(HOPPER, torch.bfloat16, q, k, v, False, 0.0, False) == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend(HOPPER, torch.bfloat16, q, k, v, False, 0.0, False) == "math"
    # flash refuses causal attention with fewer queries than keys; the memory-efficient kernel takes it
    q2, k2, v2 = _qkv(1, 2, 32, 128, sk=64)
    assert sdpa_backend(AMPERE, torch.bfloat16, q2, k2, v2, False, 0.0, True) == "efficient"
    # cuDNN's dropout comes in steps of 1/16
    assert sdpa_backend(HOPPER, torch.bfloat16, q, k, v, False, 0.1, False) == "flash"


# ---------------------------------------------------------------------------------------------- the tile model
MODELS = {"H100": (HOPPER_ATTENTION, H100), "A100": (AMPERE_ATTENTION, A100)}
seq = st.integers(min_value=1, max_value=20_000)


@settings(max_examples=60, deadline=None)
@given(
    arch=st.sampled_from(sorted(MODELS)),
    backend=st.sampled_from(BACKENDS[:3]),
    backward=st.booleans(),
    causal=st.booleans(),
    heads=st.integers(min_value=1, max_value=512),
    s1=seq,
    s2=seq,
    d=st.sampled_from([16, 32, 64, 80, 96, 128, 192, 256]),
)
def test_time_grows_with_sequence_length_and_never_beats_the_roofline(
    arch: str, backend: str, backward: bool, causal: bool, heads: int, s1: int, s2: int, d: int
) -> None:
    model, device = MODELS[arch]
    rate, sms = device.flops_for(torch.float16), device.multiprocessors
    short, long = sorted((s1, s2))
    t = {
        (sq, sk): model.seconds(backend, backward, heads, sq, sk, d, d, causal, rate, sms)
        for sq in (short, long)
        for sk in (short, long)
    }
    assert t[(short, short)] <= t[(long, short)] and t[(short, short)] <= t[(short, long)] <= t[(long, long)]
    # the FLOPs simdist charges (the pairs the mask keeps) at the device's rate: the fastest a kernel could be
    pairs = long * (long + 1) // 2 if causal else long * long
    flops = 2.0 * heads * pairs * 2 * d * (2.5 if backward else 1.0)
    assert t[(long, long)] >= flops / rate


@settings(max_examples=40, deadline=None)
@given(
    arch=st.sampled_from(sorted(MODELS)),
    backend=st.sampled_from(BACKENDS[:3]),
    backward=st.booleans(),
    blocks=st.integers(min_value=1, max_value=127),
    d=st.sampled_from([64, 128, 256]),
)
def test_throughput_rises_with_sequence_length(
    arch: str, backend: str, backward: bool, blocks: int, d: int
) -> None:
    # short sequences are far from peak: at a fixed number of tokens, a longer sequence runs at no lower FLOP/s
    model, device = MODELS[arch]
    rate, sms = device.flops_for(torch.float16), device.multiprocessors

    def tflops(s: int) -> float:
        heads = 16384 // s * 2048 // d
        return heads * s * s * d / model.seconds(backend, backward, heads, s, s, d, d, False, rate, sms)

    s = blocks * 128
    assert tflops(s + 128) >= tflops(s) * (1 - 1e-9)


def test_efficiency_interpolates_between_head_dims_and_holds_outside() -> None:
    fit = KernelFit(((64, 0.4), (128, 0.8)), 0.5, 0.1)
    assert (fit.at(32), fit.at(96), fit.at(256)) == (0.4, pytest.approx(0.6), 0.8)


@pytest.mark.parametrize(
    "bad",
    [
        {"efficiency": ()},
        {"efficiency": ((128, 0.5), (64, 0.5))},
        {"efficiency": ((64, 1.5),)},
        {"cta_tiles": -1.0},
        {"causal_efficiency": 0.0},
    ],
)
def test_a_bad_kernel_fit_is_refused(bad: dict) -> None:
    args = {"efficiency": ((64, 0.5),), "cta_tiles": 1.0, "diagonal_tiles": 0.0, **bad}
    with pytest.raises(ClusterSpecError, match="KernelFit"):
        KernelFit(**args)


def test_a_bad_attention_model_is_refused() -> None:
    fit = KernelFit(((64, 0.5),), 1.0, 0.0)
    with pytest.raises(ClusterSpecError, match="AttentionModel"):
        AttentionModel(kernels=(("flash", fit, fit), ("flash", fit, fit)))
    with pytest.raises(ClusterSpecError, match="attention must be"):
        simdist.compute.DeviceSpec("x", {torch.float32: 1e12}, 1e12, attention="fast")  # type: ignore[arg-type]


def test_a_device_with_an_attention_model_pickles_whole() -> None:
    # a DeviceSpec pickles by its fields: the attention model must survive the trip
    for spec in (H100, A100):
        again = pickle.loads(pickle.dumps(spec))
        assert again == spec and again.attention == spec.attention


# -------------------------------------------------------------------------------------------------- the fit
def test_the_constants_are_the_fit_scripts_output() -> None:
    hopper, ampere = fidelity_attention.fit()
    assert hopper == HOPPER_ATTENTION
    assert ampere == AMPERE_ATTENTION


def test_the_model_gives_back_the_rows_it_was_fitted_to() -> None:
    # the closed forms of the fit and the model's tile count must agree: each fitted row within the constants'
    # rounding (three digits) and the causal efficiency's cap at 1
    rows = [r for r in fidelity_attention.load() if fidelity_attention._key(r) in fidelity_attention.FIT_ROWS]
    assert len(rows) == len(fidelity_attention.FIT_ROWS)
    for row in rows:
        error = fidelity_attention.predict(row) / fidelity_attention.measured_seconds(row) - 1
        assert abs(error) < 0.015, (fidelity_attention._key(row), error)


# --------------------------------------------------------------------------------------- runs and estimate
def test_estimate_on_meta_tensors_prices_one_fused_kernel_each_way() -> None:
    q = torch.empty(4, 32, 2048, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)

    def step() -> None:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    _, charges = estimate(step, device="H100")
    names = [n for n, _ in charges]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 1
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == 1
    assert not {"aten::bmm", "aten::_softmax", "aten::_fused_sdp_choice"} & set(names)
    forward = dict(charges)["aten::_scaled_dot_product_flash_attention_for_cpu"]
    expected = HOPPER_ATTENTION.seconds(
        "cudnn", False, 4 * 32, 2048, 2048, 128, 128, True, H100.flops_for(torch.float16), 132
    )
    assert forward == pytest.approx(expected + H100.launch_overhead, rel=1e-12)


def test_estimate_keeps_the_math_path_where_the_cpu_takes_it() -> None:
    # a value head dim unlike the query's: the CPU has no fused kernel for it, and neither does the run
    q = torch.empty(2, 4, 256, 64, dtype=torch.float32, device="meta")
    v = torch.empty(2, 4, 256, 32, dtype=torch.float32, device="meta")
    names = [n for n, _ in estimate(F.scaled_dot_product_attention, q, q, v, device="H100")[1]]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in names and "aten::bmm" in names


def _attention_rank(dtype: torch.dtype, causal: bool, device: str = "cuda") -> None:
    q = torch.randn(2, 4, 256, 64, device=device, dtype=dtype)
    F.scaled_dot_product_attention(q, q, q, is_causal=causal)


@pytest.mark.parametrize(("device", "backend"), [("H100", "cudnn"), ("A100", "flash")])
def test_a_run_charges_the_kernel_torch_picks_on_the_device(device: str, backend: str) -> None:
    spec = get_device(device)
    res = simdist.run(_attention_rank, simdist.Cluster.switch(1, device=device), args=(torch.bfloat16, True))
    (span,) = [s for s in res.trace.spans if s.name == "aten::_scaled_dot_product_flash_attention_for_cpu"]
    expected = spec.attention.seconds(  # type: ignore[union-attr]
        backend, False, 8, 256, 256, 64, 64, True, spec.flops_for(torch.float16), spec.multiprocessors
    )
    assert span.end - span.start == pytest.approx(expected + spec.launch_overhead, rel=1e-9)


def test_a_cpu_cluster_still_charges_nothing_for_attention() -> None:
    res = simdist.run(
        _attention_rank, simdist.Cluster.switch(1, device="cpu"), args=(torch.float32, False, "cpu")
    )
    assert res.sim_time == 0


def test_where_no_fused_kernel_applies_on_the_gpu_the_math_path_pays_for_its_score_matrix() -> None:
    # float32 with head dim 30 (no multiple of 4): the CPU runs its fused kernel, a GPU the math path, which writes
    # and reads the (batch x heads x s x s) scores in the scale, mask and softmax kernels: at least 6 passes
    q = torch.empty(2, 4, 1024, 30, dtype=torch.float32, device="meta")
    _, charges = estimate(F.scaled_dot_product_attention, q, q, q, device="H100")
    (seconds,) = [s for n, s in charges if n == "aten::_scaled_dot_product_flash_attention_for_cpu"]
    scores = 2 * 4 * 1024 * 1024 * 4
    assert seconds >= 6 * scores / H100.memory_bandwidth + 3 * H100.launch_overhead
    # a head dim the memory-efficient kernel takes is one fused pass, far cheaper
    q32 = torch.empty(2, 4, 1024, 32, dtype=torch.float32, device="meta")
    assert estimate(F.scaled_dot_product_attention, q32, q32, q32, device="H100")[0] < seconds
