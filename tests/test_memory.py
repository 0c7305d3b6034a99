"""Per-rank memory accounting (``simdist.run(..., memory=True)``): analytic byte counts, peak timing, simulated
out-of-memory errors, meta/fake sizing, the trace's counter track, and the device table's capacities."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import simdist
from simdist.compute import cost, get_device
from simdist.compute.memory import CATEGORIES
from simdist.errors import ClusterSpecError, OutOfMemoryError

H100 = get_device("H100")
FLOAT = 4  # bytes per float32 element


def cluster(device: object = "cpu", n: int = 2) -> simdist.Cluster:
    return simdist.Cluster.ring(n, bandwidth="100GB/s", latency="5us", device=device)


def mlp(dims: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers += [nn.Linear(dims[i], dims[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU after the last layer


def param_bytes(dims: list[int]) -> int:
    """Weights and biases of ``mlp(dims)`` in float32, from the layer shapes."""
    return sum((dims[i] * dims[i + 1] + dims[i + 1]) * FLOAT for i in range(len(dims) - 1))


def train_step(dims: list[int], batch: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(batch, dims[0])).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    return model, opt  # kept alive: what is live at the end is parameters, gradients and Adam's state


@pytest.mark.parametrize("dims, batch", [([8, 16, 4], 3), ([32, 64, 64, 8], 5)])
def test_parameters_gradients_and_adam_state_match_their_analytic_bytes(dims: list[int], batch: int) -> None:
    res = simdist.run(train_step, cluster(), args=(dims, batch), memory=True)
    P = param_bytes(dims)
    n_tensors = 2 * (len(dims) - 1)
    for m in res.memory:
        end = m.current_breakdown
        assert end["parameters"] == P
        assert end["gradients"] == P
        # exp_avg and exp_avg_sq are each a parameter-sized tensor; "step" is one float32 scalar per parameter
        assert end["optimizer_state"] == 2 * P + n_tensors * FLOAT
        assert end["activations"] == end["communication"] == 0
        assert m.current_bytes == sum(end.values())
        # the peak is in the first step: everything above is live, plus the step's temporaries
        assert m.breakdown["optimizer_state"] == 2 * P + n_tensors * FLOAT
        assert m.peak_bytes == sum(m.breakdown.values()) >= 4 * P + n_tensors * FLOAT


def forward_only(dims: list[int], batch: int) -> torch.Tensor:
    torch.manual_seed(0)
    return mlp(dims)(torch.randn(batch, dims[0])).sum()  # the loss keeps the graph and its saved tensors alive


@pytest.mark.parametrize("dims, batch", [([8, 16, 4], 3), ([32, 64, 48, 8], 7)])
def test_activations_saved_for_backward_match_the_layer_shapes(dims: list[int], batch: int) -> None:
    res = simdist.run(forward_only, cluster(), args=(dims, batch), memory=True)
    # Each Linear saves its input for the weight gradient; ReLU saves its output, which is the next Linear's
    # input (one storage). The pre-activations and the last layer's output are freed; sum() saves nothing.
    saved = batch * sum(dims[:-1]) * FLOAT
    for m in res.memory:
        assert m.current_breakdown["activations"] == saved
        assert m.current_breakdown["parameters"] == param_bytes(dims)
        assert m.current_breakdown["other"] == FLOAT  # the loss itself
        assert m.current_breakdown["gradients"] == 0


def test_activations_are_freed_by_backward() -> None:
    def step() -> torch.Tensor:
        model = mlp([16, 32, 4])
        loss = model(torch.randn(8, 16)).sum()
        loss.backward()
        return loss

    res = simdist.run(step, cluster(H100), memory=True)
    assert res.memory[0].current_breakdown["activations"] == 0
    # the counter track has every instant: the saved tensors were all live before backward started
    assert max(c.values["activations"] for c in res.trace.counters if c.rank == 0) == 8 * (16 + 32) * FLOAT


def test_the_peak_time_is_the_simulated_time_of_the_allocation_that_reached_it() -> None:
    def fn() -> float:
        rank = dist.get_rank()
        t = torch.ones(4)
        dist.all_reduce(t)
        a = torch.ones(256, 256)
        for _ in range(1 + 3 * rank):  # rank 1 computes longer before its peak
            a = a @ a
        del a
        simdist.synchronize()  # the host runs ahead of the device: read the clock where the device is
        before = simdist.now()
        big = torch.zeros(512, 512)
        del big
        return before

    res = simdist.run(fn, cluster(H100), memory=True)
    for r, m in enumerate(res.memory):
        assert m.peak_time == res.returns[r]
        assert m.peak_bytes == 512 * 512 * FLOAT + 4 * FLOAT
        assert m.breakdown["other"] == m.peak_bytes
    assert res.memory[1].peak_time > res.memory[0].peak_time > 0


def test_a_rank_over_capacity_raises_out_of_memory_naming_rank_op_time_and_tensors() -> None:
    tiny = dataclasses.replace(H100, name="tiny", memory_capacity=1 << 20)

    def fn() -> None:
        keep = torch.ones(64, 1024)  # 256 KiB
        if dist.get_rank() == 1:
            torch.randn(512, 1024)  # 2 MiB: over the 1 MiB device
        dist.barrier()
        del keep

    with pytest.raises(OutOfMemoryError) as info:
        simdist.run(fn, cluster(tiny), memory=True)
    err = info.value
    assert (err.rank, err.op, err.requested, err.capacity) == (1, "aten::randn", 2 << 20, 1 << 20)
    assert err.in_use == 256 << 10 and err.sim_time > 0
    text = str(err)
    assert "rank 1 has 256 KiB of 1 MiB (tiny) in use" in text
    assert "tried to allocate 2 MiB (shape (512, 1024) float32)" in text
    assert f"test_memory.py:{fn.__code__.co_firstlineno + 3} in fn" in text
    assert "shape (64, 1024) float32, 256 KiB, other" in text
    assert isinstance(err, torch.OutOfMemoryError)
    again = pickle.loads(pickle.dumps(err))
    assert (again.rank, again.op, str(again)) == (1, "aten::randn", text)


@pytest.mark.parametrize("path", ["short", "general"])
def test_a_view_of_a_tensor_on_a_nearly_full_gpu_allocates_nothing(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view's size argument is no allocation: viewing 768 KiB on a 1 MiB GPU is no out-of-memory error, whether
    the view takes the cost mode's short way for plain ops or the general one (which plans allocations)."""
    if path == "general":
        monkeypatch.setattr(cost, "_INFO", {})
        monkeypatch.setattr(cost, "plain", lambda func: False)
    tiny = dataclasses.replace(H100, name="tiny", memory_capacity=1 << 20)

    def fn() -> tuple[tuple[int, ...], ...]:
        x = torch.ones(192, 1024, device="cuda")  # 768 KiB
        return tuple(x.view(-1).shape), tuple(x.view(1024, 192).shape), tuple(x.view([1024, -1]).shape)

    res = simdist.run(fn, cluster(tiny, 1), memory=True)
    assert res.returns == [((192 * 1024,), (1024, 192), (1024, 192))]
    assert res.memory[0].peak_bytes == 192 * 1024 * FLOAT


def test_rank_code_can_catch_the_simulated_error_as_torchs() -> None:
    tiny = dataclasses.replace(H100, memory_capacity=1 << 20)

    def fn() -> int:
        try:
            torch.empty(1 << 20)  # 4 MiB
        except torch.OutOfMemoryError:
            return torch.empty(1 << 10).nbytes  # a smaller retry fits
        return 0

    res = simdist.run(fn, cluster(tiny), memory=True)
    assert res.returns == [4096, 4096]
    assert all(m.peak_bytes == 4096 for m in res.memory)


GIANT = [40_000] * 9  # 8 x 1.6e9 weights: 51.2 GB in float32, more than this machine could allocate


def build_on_meta(layers: int) -> int:
    with torch.device("meta"):
        model = mlp(GIANT[: layers + 1])
    return sum(p.numel() for p in model.parameters())


def test_a_model_too_large_to_allocate_is_sized_on_the_meta_device() -> None:
    res = simdist.run(build_on_meta, cluster(H100), args=(8,), memory=True)
    expected = param_bytes(GIANT)
    assert expected > 50e9
    for r, m in enumerate(res.memory):
        assert res.returns[r] * FLOAT == expected
        assert m.breakdown["parameters"] == expected == m.peak_bytes
        assert m.current_bytes == 0


def test_a_meta_model_too_large_for_the_device_raises_out_of_memory() -> None:
    with pytest.raises(OutOfMemoryError) as info:
        simdist.run(build_on_meta, cluster("A100-40GB"), args=(8,), memory=True)
    # 40 GiB (42.9e9 bytes) hold six 6.4e9-byte weight matrices and their biases; the seventh does not fit
    assert info.value.rank == 0 and info.value.op == "aten::empty"
    assert info.value.requested == 40_000 * 40_000 * FLOAT
    assert info.value.in_use == 6 * (40_000 * 40_000 + 40_000) * FLOAT


def test_fake_tensors_count_toward_memory() -> None:
    def fn() -> int:
        with FakeTensorMode():
            big = torch.empty(1 << 28)  # 1 GiB, never allocated
            doubled = big * 2
            return doubled.nbytes

    res = simdist.run(fn, cluster(), memory=True)
    for m in res.memory:
        assert m.peak_bytes == 2 << 30 and m.current_bytes == 0


def test_collective_outputs_are_communication_buffers() -> None:
    def fn() -> torch.Tensor:
        t = torch.ones(1000)
        return funcol.all_reduce(t, "sum", dist.group.WORLD).wait()  # a new tensor: the collective's output

    res = simdist.run(fn, cluster(), memory=True)
    for r, m in enumerate(res.memory):
        assert torch.equal(res.returns[r], torch.full((1000,), 2.0))
        assert m.current_breakdown["communication"] == 1000 * FLOAT
        assert m.current_bytes == 1000 * FLOAT


def test_a_storage_resized_outside_dispatch_is_followed() -> None:
    def fn() -> int:
        t = torch.ones(1 << 16)
        t.untyped_storage().resize_(0)  # how FSDP frees an unsharded parameter
        small = torch.ones(16)
        return small.nbytes

    m = simdist.run(fn, cluster(), memory=True).memory[0]
    assert m.peak_bytes == (1 << 16) * FLOAT
    assert m.current_bytes == 0


def test_memory_runs_are_deterministic_and_draw_a_counter_track_per_rank() -> None:
    runs = [simdist.run(train_step, cluster(H100), args=([16, 32, 8], 4), memory=True) for _ in range(2)]
    assert runs[0].trace_hash == runs[1].trace_hash
    assert runs[0].memory == runs[1].memory
    counters = [e for e in runs[0].trace.to_chrome()["traceEvents"] if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1}
    assert all(set(e["args"]) == set(CATEGORIES) for e in counters)
    for rank in (0, 1):
        mine = [e for e in counters if e["pid"] == rank]
        assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)
        peak = max(sum(e["args"].values()) for e in mine)
        assert peak == runs[0].memory[rank].peak_bytes


def test_without_memory_nothing_is_counted_and_the_trace_has_no_counters() -> None:
    off = simdist.run(train_step, cluster(H100), args=([16, 32, 8], 4))
    on = simdist.run(train_step, cluster(H100), args=([16, 32, 8], 4), memory=True)
    assert off.memory == [] and off.trace.counters == []
    assert on.sim_time == off.sim_time  # accounting costs no simulated time
    assert [s.name for s in on.trace.spans] == [s.name for s in off.trace.spans]


def test_the_device_table_has_capacities_and_validates_overrides() -> None:
    GiB = 1 << 30
    assert {name: get_device(name).memory_capacity for name in ("H100", "H200", "A100", "A100-40GB")} == {
        "H100": 80 * GiB, "H200": 141 * GiB, "A100": 80 * GiB, "A100-40GB": 40 * GiB,
    }
    assert get_device("cpu").memory_capacity == math.inf
    assert get_device("a100-80gb") is get_device("A100")
    assert dataclasses.replace(H100, memory_capacity=10 * GiB).memory_capacity == 10 * GiB
    for bad in (0, -1.0, math.nan, "80GB", True):
        with pytest.raises(ClusterSpecError, match="memory_capacity must be a positive number of bytes"):
            dataclasses.replace(H100, memory_capacity=bad)
    small = dataclasses.replace(H100, memory_capacity=123)
    assert pickle.loads(pickle.dumps(small)).memory_capacity == 123
