"""Tests for simdist.compute: device table, roofline op costs, and the per-thread cost-charging dispatch mode."""

from __future__ import annotations

import dataclasses
import math
import pickle
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import simdist
from simdist.compute import DEVICES, ComputeCostMode, DeviceSpec, estimate, get_device, op_cost, op_flops
from simdist.errors import ClusterSpecError


def roofline_only(spec: DeviceSpec) -> DeviceSpec:
    """``spec`` without its GEMM shape model: every matmul at the roofline (tests/test_compute_gemm.py tests the
    shape model)."""
    return dataclasses.replace(spec, gemm=None)


H100 = roofline_only(get_device("H100"))
A100 = roofline_only(get_device("A100"))
CPU = get_device("cpu")
aten = torch.ops.aten


def roofline(flops: float, nbytes: float, dtype: torch.dtype, device: DeviceSpec) -> float:
    """The documented cost formula, written out independently of the implementation."""
    return (
        max(
            flops / device.peak_flops.get(dtype, device.peak_flops[torch.float32]),
            nbytes / device.memory_bandwidth,
        )
        + device.launch_overhead
    )


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Recorder(TorchDispatchMode):
    """Records the name of every op that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


class FlopSummer(TorchDispatchMode):
    """Sums simdist's op_flops over every op that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.total += op_flops(func, args, kwargs, out)
        return out


# --- device table -----------------------------------------------------------------------------------------


def test_get_device_is_case_insensitive_and_accepts_aliases() -> None:
    assert get_device("h100") is get_device("H100-SXM") is get_device("h100-sxm") is DEVICES["H100"]
    assert get_device("a100") is get_device("A100-SXM") is DEVICES["A100"]
    assert get_device("CPU") is DEVICES["cpu"]
    assert get_device("H200").memory_bandwidth > get_device("H100").memory_bandwidth


def test_unknown_device_lists_known_names() -> None:
    with pytest.raises(ClusterSpecError, match=r"unknown device 'V100'.*H100.*A100.*cpu"):
        get_device("V100")


def test_datasheet_figures_of_the_devices_not_measured() -> None:
    # The H100 and H200 figures come from a measurement: tests/test_gpu_calibration.py checks them.
    assert A100.flops_for(torch.float16) == pytest.approx(312e12)
    assert A100.flops_for(torch.float64) == pytest.approx(19.5e12)
    assert A100.memory_bandwidth == pytest.approx(2.039e12)
    for spec in DEVICES.values():
        assert spec.source


def test_flops_for_falls_back_to_float32() -> None:
    assert H100.flops_for(torch.int32) == H100.flops_for(torch.float32)
    assert A100.flops_for(torch.float8_e4m3fn) == A100.flops_for(torch.float32)
    assert H100.flops_for(torch.bfloat16) != H100.flops_for(torch.float32)


def test_zero_cost_flag() -> None:
    assert CPU.is_zero_cost
    assert not H100.is_zero_cost
    assert not dataclasses.replace(CPU, launch_overhead=1e-6).is_zero_cost


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peak_flops": {torch.bfloat16: 1e12}}, "no torch.float32 entry"),
        ({"peak_flops": {torch.float32: -1.0}}, "positive FLOP/s"),
        ({"memory_bandwidth": 0.0}, "memory_bandwidth must be a positive"),
        ({"launch_overhead": -1e-6}, "launch_overhead must be"),
        ({"launch_overhead": math.inf}, "launch_overhead must be"),
    ],
)
def test_invalid_spec_is_rejected(change: dict[str, Any], message: str) -> None:
    fields = {"name": "X", "peak_flops": {torch.float32: 1e12}, "memory_bandwidth": 1e12, **change}
    with pytest.raises(ClusterSpecError, match=message):
        DeviceSpec(**fields)


def test_spec_peak_table_is_read_only_and_spec_pickles() -> None:
    with pytest.raises(TypeError):
        H100.peak_flops[torch.float32] = 1.0  # type: ignore[index]
    for spec in DEVICES.values():
        copy = pickle.loads(pickle.dumps(spec))
        assert copy == spec and copy.is_zero_cost == spec.is_zero_cost
        assert hash(copy) == hash(spec)


# --- roofline cost ----------------------------------------------------------------------------------------


def test_large_matmul_is_compute_bound() -> None:
    a, b = torch.randn(512, 1024), torch.randn(1024, 768)
    total, charges = estimate(torch.mm, a, b, device=H100)
    flops = 2 * 512 * 1024 * 768
    moved = nbytes(a, b) + 512 * 768 * 4
    fp32 = H100.flops_for(torch.float32)
    assert flops / fp32 > moved / H100.memory_bandwidth  # the shape is in the compute-bound regime
    assert charges == [("aten::mm", pytest.approx(flops / fp32 + H100.launch_overhead, rel=1e-12))]
    assert total == charges[0][1]


def test_op_table_never_prices_an_op_as_another_that_had_its_id() -> None:
    # The per-op table is keyed by id(): an overload made after another was freed may get its id, and must then be
    # priced as itself. A view's entry left under the matmul's id stands in for the freed overload's.
    from simdist.compute import cost

    key = id(torch.ops.aten.mm.default)
    kept = cost._INFO.get(key)
    cost._INFO[key] = cost._OpInfo(torch.ops.aten.view.default)
    try:
        a, b = torch.randn(512, 1024), torch.randn(1024, 768)
        _, charges = estimate(torch.mm, a, b, device=H100)
    finally:
        if kept is None:
            cost._INFO.pop(key, None)
        else:
            cost._INFO[key] = kept
    flops = 2 * 512 * 1024 * 768
    expected = flops / H100.flops_for(torch.float32) + H100.launch_overhead
    assert charges == [("aten::mm", pytest.approx(expected, rel=1e-12))]


def test_elementwise_on_big_tensor_is_memory_bound() -> None:
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    _, charges = estimate(torch.add, x, y, device=A100)
    expected = 3 * (1 << 20) * 4 / 2.039e12 + A100.launch_overhead
    assert charges == [("aten::add", pytest.approx(expected, rel=1e-12))]
    _, charges = estimate(torch.relu, x, device=A100)
    assert charges == [("aten::relu", pytest.approx(2 * (1 << 20) * 4 / 2.039e12 + A100.launch_overhead))]


def test_bf16_and_fp32_use_their_own_peaks() -> None:
    # Meta tensors carry shapes only, so a large compute-bound matmul costs nothing to "run".
    def mm_cost(dtype: torch.dtype) -> float:
        a = torch.empty(4096, 4096, dtype=dtype, device="meta")
        return estimate(torch.mm, a, a, device=H100)[0]

    flops = 2 * 4096**3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert mm_cost(dtype) == pytest.approx(flops / H100.peak_flops[dtype] + H100.launch_overhead)
    assert mm_cost(torch.bfloat16) < mm_cost(torch.float32) and mm_cost(torch.float16) < mm_cost(torch.float32)


def test_views_cost_nothing_but_copies_do() -> None:
    x = torch.randn(4, 6, 8)

    def views() -> None:
        x.view(24, 8), x.transpose(0, 1), x.permute(2, 0, 1), x[0].t()
        x[1], x[:, 2:], x.unsqueeze(0).squeeze(0), x.split(2), x.chunk(3, dim=2), x.unbind(0)
        x.expand(3, 4, 6, 8), x.detach(), x.as_strided((2, 2), (1, 1)), x.reshape(4, 48), x.narrow(1, 0, 3)
        x.diagonal(dim1=1, dim2=2), x.view_as(x), torch.empty(10), torch.empty_like(x)

    recorder = Recorder()
    charges: list[tuple[float, str]] = []
    with recorder, ComputeCostMode(H100, lambda s, name: charges.append((s, name))):
        views()
    # The ops really went through the mode (the recorder sits behind it), and none was charged.
    for name in (
        "aten::view",
        "aten::transpose",
        "aten::permute",
        "aten::t",
        "aten::select",
        "aten::slice",
        "aten::split",
        "aten::unbind",
        "aten::expand",
        "aten::detach",
        "aten::as_strided",
        "aten::diagonal",
        "aten::empty",
        "aten::empty_like",
    ):
        assert name in recorder.names
    assert charges == []

    # A reshape that cannot alias copies: the clone is charged, the view of its result is not.
    total, charges_copy = estimate(lambda: x.transpose(0, 2).reshape(-1), device=H100)
    assert [name for name, _ in charges_copy] == ["aten::clone"]
    assert total == pytest.approx(2 * nbytes(x) / H100.memory_bandwidth + H100.launch_overhead)


def test_zero_cost_device_charges_nothing() -> None:
    a = torch.randn(64, 64, requires_grad=True)
    total, charges = estimate(lambda: (a @ a).relu().sum().backward(), device="cpu")
    assert (total, charges) == (0.0, [])
    assert op_cost(aten.mm.default, (a, a), {}, a @ a, CPU) == 0.0


def test_out_argument_is_counted_once() -> None:
    x, y, out = torch.randn(1000), torch.randn(1000), torch.empty(1000)
    _, charges = estimate(lambda: torch.add(x, y, out=out), device=H100)
    assert charges == [("aten::add", pytest.approx(3 * 4000 / H100.memory_bandwidth + H100.launch_overhead))]


def test_in_place_op_reads_and_writes_self() -> None:
    x, y = torch.randn(1000), torch.randn(1000)
    _, charges = estimate(lambda: x.add_(y), device=H100)
    assert charges == [("aten::add_", pytest.approx(3 * 4000 / H100.memory_bandwidth + H100.launch_overhead))]


@given(
    rows=st.integers(1, 5000),
    width=st.integers(1, 64),
    picks=st.integers(1, 5000),
    op=st.sampled_from(["embedding", "index_select", "index", "gather", "take"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_gathering_ops_read_only_what_they_gather(
    rows: int, width: int, picks: int, op: str, dtype: torch.dtype
) -> None:
    # An embedding lookup reads the rows it returns, not the whole table: the source counts as the output's
    # bytes, or the table's where indices repeat (it cannot read more than all of it from memory).
    table = torch.empty(rows, width, dtype=dtype, device="meta")
    idx = torch.empty(picks, dtype=torch.long, device="meta")
    calls = {
        "embedding": lambda: F.embedding(idx, table),
        "index_select": lambda: table.index_select(0, idx),
        "index": lambda: table[idx],
        "gather": lambda: table.gather(0, idx.view(-1, 1).expand(picks, width)),
        "take": lambda: table.take(idx),
    }
    _, charges = estimate(calls[op], device=H100)
    out_elems = picks if op == "take" else picks * width
    index_bytes = picks * width * 8 if op == "gather" else picks * 8
    written = out_elems * table.element_size()
    moved = index_bytes + min(nbytes(table), written) + written
    assert charges == [(f"aten::{op}", pytest.approx(moved / H100.memory_bandwidth + H100.launch_overhead))]


def test_collectives_are_left_to_the_network_model() -> None:
    t = torch.randn(1 << 16)
    assert op_cost(torch.ops._c10d_functional.all_reduce.default, (t, "sum", "0"), {}, t, H100) == 0.0


def test_cost_is_independent_of_tensor_values_and_wall_clock() -> None:
    a = torch.randn(128, 256)
    first = op_cost(aten.mm.default, (a, a.t()), {}, a @ a.t(), H100)
    b = torch.zeros(128, 256)
    assert op_cost(aten.mm.default, (b, b.t()), {}, b @ b.t(), H100) == first


@given(
    m=st.integers(1, 4096),
    n=st.integers(1, 4096),
    k=st.integers(1, 4096),
    batch=st.integers(1, 16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    op=st.sampled_from(["mm", "addmm", "bmm", "baddbmm"]),
    device=st.sampled_from(["H100", "A100", "H200"]),
)
def test_matmul_family_follows_roofline(
    m: int, n: int, k: int, batch: int, dtype: torch.dtype, op: str, device: str
) -> None:
    spec = roofline_only(get_device(device))

    def t(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    if op == "mm":
        inputs, flops, call = (t(m, k), t(k, n)), 2 * m * n * k, torch.mm
    elif op == "addmm":
        inputs, flops, call = (t(n), t(m, k), t(k, n)), 2 * m * n * k, torch.addmm
    elif op == "bmm":
        inputs, flops, call = (t(batch, m, k), t(batch, k, n)), 2 * batch * m * n * k, torch.bmm
    else:
        inputs, flops, call = (
            (t(batch, m, n), t(batch, m, k), t(batch, k, n)),
            2 * batch * m * n * k,
            torch.baddbmm,
        )
    out_elems = m * n * (1 if op in ("mm", "addmm") else batch)
    moved = nbytes(*inputs) + out_elems * inputs[0].element_size()

    _, charges = estimate(call, *inputs, device=spec)
    assert charges == [(f"aten::{op}", pytest.approx(roofline(flops, moved, dtype, spec), rel=1e-12))]


@pytest.mark.parametrize(
    ("op", "shapes", "flops"),
    [
        ("addbmm", [(5, 7), (3, 5, 11), (3, 11, 7)], 2 * 3 * 5 * 11 * 7),
        ("mv", [(300, 400), (400,)], 2 * 300 * 400),
        ("addmv", [(300,), (300, 400), (400,)], 2 * 300 * 400),
        ("dot", [(5000,), (5000,)], 2 * 5000),
        ("vdot", [(5000,), (5000,)], 2 * 5000),
    ],
)
def test_vector_and_reducing_matmuls_follow_roofline(
    op: str, shapes: list[tuple[int, ...]], flops: int
) -> None:
    inputs = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    out = getattr(torch, op)(*inputs)
    assert op_flops(getattr(aten, op).default, inputs, {}, out) == flops
    _, charges = estimate(getattr(torch, op), *inputs, device=A100)
    expected = roofline(flops, nbytes(*inputs, out), torch.float64, A100)
    assert charges == [(f"aten::{op}", pytest.approx(expected, rel=1e-12))]


# --- agreement with torch's own FLOP counter ----------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["mlp", "conv2d", "conv2d_strided_dilated", "conv_transpose2d", "conv1d_no_bias", "bmm_baddbmm"],
)
def test_flops_agree_with_torch_flop_counter(case: str) -> None:
    torch.manual_seed(0)

    def run() -> None:
        if case == "mlp":
            x = torch.randn(8, 16)
            w1, w2 = torch.randn(32, 16, requires_grad=True), torch.randn(4, 32, requires_grad=True)
            F.linear(F.relu(F.linear(x, w1)), w2).sum().backward()
        elif case == "conv2d":
            x = torch.randn(2, 3, 10, 10, requires_grad=True)
            w, b = torch.randn(5, 3, 3, 3, requires_grad=True), torch.randn(5, requires_grad=True)
            F.conv2d(x, w, b, padding=1).sum().backward()
        elif case == "conv2d_strided_dilated":
            x = torch.randn(2, 4, 11, 9, requires_grad=True)
            w = torch.randn(6, 4, 3, 2, requires_grad=True)
            F.conv2d(x, w, stride=2, padding=1, dilation=(1, 2)).sum().backward()
        elif case == "conv_transpose2d":
            x = torch.randn(2, 4, 5, 6, requires_grad=True)
            w = torch.randn(4, 3, 3, 3, requires_grad=True)
            F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1).sum().backward()
        elif case == "conv1d_no_bias":
            x = torch.randn(3, 2, 17)  # no grad for the input: convolution_backward's mask drops grad_input
            w = torch.randn(4, 2, 5, requires_grad=True)
            F.conv1d(x, w).sum().backward()
        else:
            a, b = torch.randn(3, 4, 5, requires_grad=True), torch.randn(3, 5, 6, requires_grad=True)
            torch.baddbmm(torch.randn(3, 4, 6), a, b).sum().backward()
            torch.bmm(a, b).sum().backward()

    with FlopCounterMode(display=False) as counter:
        run()
    summer = FlopSummer()
    with summer:
        run()
    assert counter.get_total_flops() > 0
    assert summer.total == counter.get_total_flops()


def test_grouped_conv_flops_follow_closed_form() -> None:
    # torch's FLOP counter ignores groups for grad_weight (it counts a full-channel conv), so the closed
    # form is the oracle here: forward = 2 * N * C_out * H_out * W_out * (C_in / groups) * kH * kW, and
    # grad_input and grad_weight each repeat the forward's multiply-adds.
    x = torch.randn(2, 4, 11, 9, requires_grad=True)
    w = torch.randn(6, 2, 3, 2, requires_grad=True)
    summer = FlopSummer()
    with summer:
        y = F.conv2d(x, w, stride=2, padding=1, dilation=(1, 2), groups=2)
        forward = summer.total
        y.sum().backward()
    assert y.shape == (2, 6, 6, 5)
    expected_forward = 2 * 2 * 6 * 6 * 5 * (4 // 2) * 3 * 2
    assert forward == expected_forward
    assert summer.total - forward == 2 * expected_forward


def test_attention_flops_match_torch_formulas() -> None:
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, 4, 12, 8, requires_grad=True)
    v = torch.randn(2, 4, 12, 8, requires_grad=True)
    recorder, summer = Recorder(), FlopSummer()
    with recorder, summer:
        out = F.scaled_dot_product_attention(q, k, v)
        forward = summer.total
        out.sum().backward()
    # CPU runs the fused flash kernel, so the attention ops (not bmm/softmax) are what got costed.
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in recorder.names
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in recorder.names
    assert forward == sdpa_flop_count(q.shape, k.shape, v.shape)
    assert summer.total - forward == sdpa_backward_flop_count(out.shape, q.shape, k.shape, v.shape)


@given(
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    d=st.sampled_from([4, 8]),
    causal=st.booleans(),
)
def test_causal_attention_counts_the_pairs_the_mask_keeps(sq: int, sk: int, d: int, causal: bool) -> None:
    # The oracle is the mask itself as torch's documentation builds it for is_causal: ones(L, S).tril(0).
    # Values as wide as queries and keys: otherwise the CPU takes the unfused path, which computes every pair.
    q = torch.randn(2, 3, sq, d, requires_grad=True)
    k = torch.randn(2, 3, sk, d, requires_grad=True)
    v = torch.randn(2, 3, sk, d, requires_grad=True)
    pairs = int(torch.ones(sq, sk, dtype=torch.bool).tril().sum()) if causal else sq * sk
    summer = FlopSummer()
    with summer:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        forward = summer.total
        out.sum().backward()
    assert forward == 2 * 6 * pairs * (d + d)
    assert summer.total - forward == 2 * 6 * pairs * (3 * d + 2 * d)


@pytest.mark.parametrize(
    ("kernel", "forward", "backward"),
    [
        # the arguments up to is_causal, in each kernel's schema order (tensors as T, the rest as their defaults)
        ("flash_attention", "T T T 0.0 C", "G T T T T L N N 8 8 0.0 C"),
        ("flash_attention_for_cpu", "T T T 0.0 C", "G T T T T L 0.0 C"),
        ("efficient_attention", "T T T N True 0.0 C", "G T T T N T L N N 0.0 M C"),
        ("cudnn_attention", "T T T N True 0.0 C", "G T T T T L N N N N N 8 8 0.0 C"),
        ("fused_attention_overrideable", "T T T N 0.0 C", "G T T T N M T L N N 8 8 0.0 C"),
    ],
)
def test_every_attention_kernel_reads_its_own_causal_flag(kernel: str, forward: str, backward: str) -> None:
    q = torch.empty(2, 4, 8, 16, device="meta")
    full, causal = 2 * 8 * 8 * 8 * (16 + 16), 2 * 8 * (8 * 9 // 2) * (16 + 16)
    values = {
        "T": q,
        "G": q,
        "L": q,
        "N": None,
        "M": [True, True, True, False],
        "True": True,
        "0.0": 0.0,
        "8": 8,
    }

    def args(spec: str, flag: bool) -> list[Any]:
        return [flag if word == "C" else values[word] for word in spec.split()]

    op = getattr(aten, f"_scaled_dot_product_{kernel}")
    op_backward = getattr(aten, f"_scaled_dot_product_{kernel}_backward")
    assert op_flops(op.default, args(forward, False), {}, None) == full
    assert op_flops(op.default, args(forward, True), {}, None) == causal
    assert (
        op_flops(op.default, args(forward, True)[:-1], {}, None) == full
    )  # the default, dropped: not causal
    assert op_flops(op_backward.default, args(backward, False), {}, None) == full * 5 // 2
    assert op_flops(op_backward.default, args(backward, True), {}, None) == causal * 5 // 2


# --- the mode in training code ------------------------------------------------------------------------------


def mlp_step(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, target = torch.randn(16, 32), torch.randint(0, 10, (16,))
    loss = F.cross_entropy(model(x), target)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_mlp_forward_backward_is_charged_forward_and_backward_ops() -> None:
    total, charges = estimate(mlp_step, device=H100)
    names = [name for name, _ in charges]
    assert all(name.startswith("aten::") for name in names)
    assert "aten::addmm" in names  # forward linear layers
    assert "aten::threshold_backward" in names  # ReLU backward
    assert names.count("aten::mm") >= 3  # weight and input gradients of the two linears
    assert total > 0 and all(seconds > 0 for _, seconds in charges)
    assert total == pytest.approx(sum(s for _, s in charges))
    assert estimate(mlp_step, device=H100) == (total, charges)


def test_mode_does_not_change_results() -> None:
    plain_loss, plain_grads = mlp_step()
    charges: list[tuple[float, str]] = []
    with ComputeCostMode(A100, lambda s, name: charges.append((s, name))):
        loss, grads = mlp_step()
    assert charges
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads, strict=True))


def test_modes_are_per_thread_and_cover_backward() -> None:
    results: dict[str, list[str]] = {"H100": [], "cpu": []}
    barrier = threading.Barrier(2)

    def rank(device: str) -> None:
        with ComputeCostMode(get_device(device), lambda s, name: results[device].append(name)):
            barrier.wait()  # both modes are active at once
            mlp_step()
            barrier.wait()

    threads = [threading.Thread(target=rank, args=(d,)) for d in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "aten::threshold_backward" in results["H100"]
    assert [name for name, _ in estimate(mlp_step, device=H100)[1]] == results["H100"]
    assert results["cpu"] == []


def _mlp(x: torch.Tensor) -> torch.Tensor:
    w = torch.ones(64, 64, device=x.device)
    return torch.relu(x @ w) @ w


def test_fake_tensors_cost_nothing_and_meta_only_when_estimating() -> None:
    """No kernel runs on fake tensors (tracing), nor on meta tensors in rank code (shape propagation, meta
    initialisation); ``estimate`` prices meta tensors on purpose, to size ops without data."""
    real, _ = estimate(_mlp, torch.ones(32, 64), device="H100")
    assert real > 0
    meta_x = torch.ones(32, 64, device="meta")
    assert estimate(_mlp, meta_x, device="H100")[0] == pytest.approx(real, rel=1e-12)
    charges: list = []
    with ComputeCostMode(get_device("H100"), lambda seconds, name: charges.append(name)):
        _mlp(meta_x)
    assert charges == []
    with FakeTensorMode() as fake_mode:
        x = fake_mode.from_tensor(torch.ones(32, 64))
        fake, charges = estimate(_mlp, x, device="H100")
    assert fake == 0 and charges == []


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _step(export_first: bool) -> float:
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(16, 64)
    if export_first:  # traces with fake tensors and symbolic shapes, as torch.distributed.pipelining.pipeline()
        torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    net(x).sum().backward()
    return simdist.now()


def test_tracing_inside_a_rank_charges_no_time() -> None:
    """A rank that traces its model with torch.export takes the same simulated time as one that does not."""
    plain = simdist.run(_step, simdist.Cluster.ring(2), args=(False,))
    traced = simdist.run(_step, simdist.Cluster.ring(2), args=(True,))
    assert type(traced.sim_time) is float and plain.sim_time > 0
    assert traced.returns == plain.returns and traced.sim_time == plain.sim_time
