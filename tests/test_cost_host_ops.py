"""The cost mode's fast path for host ops on a GPU cluster: it must decide and charge exactly as the full path does.

Oracles: ``unwrap``'s own walk over the arguments (the fast check may only claim "host" where ``unwrap`` finds no
simulated GPU), and the same run with the fast path switched off (same values, same trace, same simulated time).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist.compute import cost
from simdist.cuda.tensor import SimCudaTensor, on_host, unwrap

aten = torch.ops.aten
CUDA0 = torch.device("cuda", 0)
CUDA1 = torch.device("cuda", 1)

#: ops of several argument shapes: tensors, a tensor list, a size list with factory keywords, an index list
FUNCS = [
    aten.add.Tensor,
    aten.cat.default,
    aten.empty.memory_format,
    aten.index_put_.default,
    aten._to_copy.default,
]


def _tensor(kind: str) -> torch.Tensor:
    if kind == "plain":
        return torch.ones(2)
    if kind == "scalar":
        return torch.tensor(1.0)
    if kind == "meta":
        return torch.empty(2, device="meta")
    if kind == "param":
        return torch.nn.Parameter(torch.ones(2))
    return SimCudaTensor(torch.ones(2), CUDA1 if kind == "gpu1" else CUDA0)


_tensors = st.sampled_from(["plain", "scalar", "meta", "param", "gpu0", "gpu1"]).map(_tensor)
_values = st.one_of(
    _tensors,
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=16),
    st.booleans(),
    st.none(),
    st.sampled_from(["sum", "floor"]),
    st.sampled_from([torch.float32, torch.int64, torch.strided, torch.contiguous_format]),
    st.sampled_from([torch.device("cpu"), torch.device("meta"), CUDA0, CUDA1]),
)
_args = st.lists(
    st.one_of(
        _values,
        st.lists(_values, max_size=3),
        st.lists(_values, max_size=2).map(tuple),
        st.just([[_tensor("gpu0")]]),
    ),
    max_size=4,
)
_kwargs = st.dictionaries(
    st.sampled_from(["dtype", "device", "indices", "alpha", "out"]),
    st.one_of(_values, st.lists(_values, max_size=2)),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(func=st.sampled_from(FUNCS), args=_args, kwargs=_kwargs)
def test_a_call_the_fast_check_calls_host_is_one_unwrap_finds_no_simulated_gpu_in(func, args, kwargs):
    if on_host(args, kwargs):
        assert unwrap(func, args, kwargs) is None


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((_tensor("gpu0"), torch.ones(2)), {}),
        (([torch.ones(2), _tensor("gpu1")],), {}),
        (([2, 3],), {"device": CUDA0}),
        ((torch.ones(2), CUDA0), {}),
        ((torch.ones(2),), {"out": _tensor("gpu0")}),
        ((torch.ones(2),), {"indices": (_tensor("gpu0"),)}),
    ],
)
def test_a_simulated_gpu_anywhere_in_a_call_takes_the_full_path(args, kwargs):
    assert not on_host(args, kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.ones(2), torch.nn.Parameter(torch.ones(2)), 1.0), {}),
        (
            ([2, 3],),
            {
                "dtype": torch.float32,
                "layout": torch.strided,
                "device": torch.device("cpu"),
                "pin_memory": False,
            },
        ),
        (([torch.ones(2), torch.tensor(1.0)], 0), {}),
        ((torch.ones(2),), {"rounding_mode": "floor", "out": torch.empty(2)}),
    ],
)
def test_host_calls_take_the_fast_path(args, kwargs):
    assert on_host(args, kwargs)
    assert unwrap(aten.add.Tensor, args, kwargs) is None


def _slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the fast paths off: every call through ``unwrap``, every op through its OpOverload, launch and
    charge as two calls."""
    monkeypatch.setattr(cost, "on_host", lambda args, kwargs: False)
    monkeypatch.setattr(cost, "_INFO", {})
    init = cost._OpInfo.__init__

    def through_overload(self, func):
        init(self, func)
        self.call = func

    monkeypatch.setattr(cost._OpInfo, "__init__", through_overload)
    mode_init = cost.ComputeCostMode.__init__

    def two_calls(self, *args, **kwargs):
        kwargs.pop("launched", None)
        mode_init(self, *args, **kwargs)

    monkeypatch.setattr(cost.ComputeCostMode, "__init__", two_calls)


#: host ops a program written for the CPU runs, and the same program's ops after it moved to its GPU
STEPS = {
    "mlp": lambda x: torch.nn.functional.linear(x, x[:2]).relu().pow(2).mean(),
    "cat_index": lambda x: torch.cat([x, x * 2]).index_select(0, torch.tensor([0, 2])).sum(),
    "to_dtype": lambda x: x.to(torch.float64).cumsum(0).to(torch.float32).max(),
    "factories": lambda x: (torch.empty(3, 4).fill_(1.0) @ torch.zeros(4, x.shape[1])).add(x[:3]).norm(),
    "gpu_then_host": lambda x: x.cuda().matmul(x.cuda().T).cpu().sum() + x.exp().sum(),
}


def _program(steps: list[str], width: int):
    def program():
        torch.manual_seed(dist.get_rank())
        x = torch.randn(4, width, requires_grad=True)
        out = sum(STEPS[s](x) for s in steps)
        out.backward()
        return out.detach(), x.grad

    return program


@settings(max_examples=8, deadline=None)
@given(steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=3), width=st.integers(1, 6))
def test_host_ops_charge_the_same_seconds_and_compute_the_same_values_either_way(steps, width):
    cluster = simdist.Cluster.switch(2, device="H100")
    fast = simdist.run(_program(steps, width), cluster)
    with pytest.MonkeyPatch.context() as mp:
        _slow(mp)
        slow = simdist.run(_program(steps, width), cluster)
    assert fast.trace.hash() == slow.trace.hash()
    assert fast.sim_time == slow.sim_time
    for (a, ga), (b, gb) in zip(fast.returns, slow.returns):
        assert torch.equal(a, b) and torch.equal(ga, gb)


#: factories as programs call them, keyword arguments included (torch hands a dispatch mode ``device=cpu`` and
#: ``pin_memory=False`` for every one of them, which the cost mode leaves out: aten assumes both)
FACTORIES = {
    "ones": lambda: torch.ones(3),
    "zeros_f64": lambda: torch.zeros(2, 3, dtype=torch.float64),
    "full_int": lambda: torch.full((2,), 7),
    "arange": lambda: torch.arange(1, 4, 0.5),
    "eye": lambda: torch.eye(3, 2),
    "linspace": lambda: torch.linspace(0, 1, 5, device="cpu"),
    "rand": lambda: torch.rand(4),
    "randn_f64": lambda: torch.randn(2, 2, dtype=torch.float64),
    "randint": lambda: torch.randint(0, 10, (5,)),
    "randperm": lambda: torch.randperm(6),
    "scalar_tensor": lambda: torch.scalar_tensor(3.0),
    "hann_window": lambda: torch.hann_window(4),
    "tril_indices": lambda: torch.tril_indices(3, 3),
    "pinned": lambda: torch.ones(2, pin_memory=False),
    "requires_grad": lambda: torch.zeros(2, requires_grad=True),
    "empty": lambda: torch.empty(3),
}


def _factories(names: list[str], use_gpu: bool) -> list[torch.Tensor]:
    if use_gpu:
        torch.ones(1, device="cuda")
    torch.manual_seed(3)
    return [FACTORIES[n]() for n in names]


def _same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert (got.dtype, got.device, got.shape, got.requires_grad) == (
        want.dtype,
        want.device,
        want.shape,
        want.requires_grad,
    ), name
    if name == "empty":  # a run fills uninitialised memory with NaN (simdist.uninitialised)
        assert got.isnan().all(), name
    else:
        assert torch.equal(got, want), name


@pytest.mark.parametrize(("device", "use_gpu"), [("H100", False), ("H100", True), ("cpu", False)])
def test_factories_make_what_plain_torch_makes(device: str, use_gpu: bool) -> None:
    """Every factory above in one rank (of a GPU cluster, before and after it used its GPU, and of a CPU cluster).
    Oracle: the same calls in plain torch, after the same seed."""
    names = sorted(FACTORIES)
    got = simdist.run(_factories, simdist.Cluster.switch(1, device=device), args=(names, use_gpu)).returns[0]
    torch.manual_seed(3)
    for name, g in zip(names, got, strict=True):
        _same(g, FACTORIES[name](), name)


def test_factory_keywords_aten_assumes_are_left_out_and_no_others() -> None:
    cpu = torch.device("cpu")
    kwargs = {"dtype": torch.float64, "device": cpu, "pin_memory": False}
    assert cost._as_aten_assumes(kwargs) == {"dtype": torch.float64}
    assert kwargs == {
        "dtype": torch.float64,
        "device": cpu,
        "pin_memory": False,
    }  # the caller's own is unchanged
    kept = {"device": torch.device("cpu", 0), "pin_memory": True}
    assert cost._as_aten_assumes(kept) is kept
    assert cost._as_aten_assumes({"device": cpu}) == {}
    # prims' factories require their device: they are not left to aten's assumption
    assert not cost._op_info(torch.ops.prims.full.default).factory
    assert cost._op_info(aten.full.default).factory and not cost._op_info(aten.full_like.default).factory
