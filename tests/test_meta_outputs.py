"""Remembered meta results (simdist.cuda.meta_outputs): the results a timing-only run's ops get without their meta
kernel are those the kernel gives. The oracle is the kernel itself, called on the same meta operands; and a whole
timing-only run with and without the table."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fake import TINY, _gpus, llama_step
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import simdist
from simdist.cuda import meta_outputs
from simdist.cuda.meta_outputs import MetaOutputs

aten = torch.ops.aten
META = torch.device("meta")


def _meta(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, transpose: bool = False
) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=META)
    return t.transpose(0, 1) if transpose and t.dim() > 1 else t


def _layout(t: Any) -> Any:
    """Everything of a result a run can see without values (its storage's size: what memory accounting counts)."""
    if isinstance(t, torch.Tensor):
        return (
            t.device,
            t.dtype,
            t.shape,
            t.stride(),
            t.storage_offset(),
            t.untyped_storage().nbytes(),
            t._is_view(),
            t.requires_grad,
        )
    if isinstance(t, (list, tuple)):
        return (type(t), [_layout(x) for x in t])
    return t


#: ops and how to make their operands from a shape, a dtype and whether the first operand is transposed
CASES: dict[str, Callable[[tuple[int, int], torch.dtype, bool], tuple[Any, tuple, dict]]] = {
    "mul": lambda s, d, t: (
        aten.mul.Tensor,
        (_meta(s, d, t), _meta((1, s[0] if t else s[1]), torch.float32)),
        {},
    ),
    "add alpha": lambda s, d, t: (aten.add.Tensor, (_meta(s, d, t), _meta(s, d)), {"alpha": 2}),
    "mul scalar": lambda s, d, t: (aten.mul.Tensor, (_meta(s, d, t), 0.5), {}),
    "sum keepdim": lambda s, d, t: (aten.sum.dim_IntList, (_meta(s, d, t), [1], True), {}),
    "mean to float": lambda s, d, t: (aten.mean.dim, (_meta(s, d, t), [0]), {"dtype": torch.float32}),
    "cat": lambda s, d, t: (aten.cat.default, ([_meta(s, d, t), _meta(s, d)], 0), {}),
    "mm": lambda s, d, t: (aten.mm.default, (_meta(s, d, t), _meta((s[1], 3), d)), {}),
    "pow": lambda s, d, t: (aten.pow.Tensor_Scalar, (_meta(s, d, t), 2), {}),
    "log_softmax": lambda s, d, t: (aten._log_softmax.default, (_meta(s, d, t), 1, False), {}),
    "layer_norm": lambda s, d, t: (
        aten.native_layer_norm.default,
        (_meta(s, d, t), [s[1]], None, None, 1e-5),
        {},
    ),
    "max dim": lambda s, d, t: (aten.max.dim, (_meta(s, d, t), 1), {}),
    "zeros_like": lambda s, d, t: (aten.zeros_like.default, (_meta(s, d, t),), {}),
    "in place": lambda s, d, t: (aten.mul_.Tensor, (_meta(s, d, t), _meta(s, d)), {}),
    "out=": lambda s, d, t: (aten.add.out, (_meta(s, d, t), _meta(s, d)), {"out": _meta(s, d)}),
    "out= resized": lambda s, d, t: (aten.add.out, (_meta(s, d, t), _meta(s, d)), {"out": _meta((0,), d)}),
    "foreach in place": lambda s, d, t: (aten._foreach_mul_.Scalar, ([_meta(s, d, t), _meta(s, d)], 3.0), {}),
    "view": lambda s, d, t: (aten.transpose.int, (_meta(s, d, t), 0, 1), {}),
    "views": lambda s, d, t: (aten.split.Tensor, (_meta(s, d, t), 1), {}),
    "random": lambda s, d, t: (aten.uniform_.default, (_meta(s, d, t),), {}),
}

#: what is taken without the kernel the second time (the others always run it)
REMADE = {k for k in CASES if k not in ("out= resized", "view", "views", "random")}


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(CASES)),
    st.tuples(st.integers(0, 5), st.integers(1, 5)),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.booleans(),
)
def test_a_remembered_result_is_the_kernels(
    case: str, shape: tuple[int, int], dtype: torch.dtype, t: bool
) -> None:
    """The same op on operands of the same shapes, twice: both times what the meta kernel gives (results of the
    same shape, strides, type and storage; an in-place or ``out=`` op's results its written operands, unchanged)."""
    table = MetaOutputs()
    for time in range(2):
        func, args, kwargs = CASES[case](shape, dtype, t)
        want_func, want_args, want_kwargs = CASES[case](shape, dtype, t)
        try:
            want = want_func(*want_args, **want_kwargs)
        except RuntimeError as e:  # the kernel refuses these operands: so must the table, every time
            with pytest.raises(RuntimeError, match=str(e)[:40].replace("(", r"\(").replace("[", r"\[")):
                table.call(func, args, kwargs)
            return
        got = table.call(func, args, kwargs)
        assert _layout(got) == _layout(want)
        assert [_layout(a) for a in args] == [_layout(a) for a in want_args]
        assert {k: _layout(v) for k, v in kwargs.items()} == {k: _layout(v) for k, v in want_kwargs.items()}
        if want is want_args[0]:  # in place: the result is the written operand itself
            assert got is args[0]
        if "out" in want_kwargs and want is want_kwargs["out"]:
            assert got is kwargs["out"]
    assert table.remade == (1 if case in REMADE else 0)


def test_operands_differing_only_in_strides_type_or_offset_get_their_own_results() -> None:
    """A square matrix and its transpose, one type and another, a view at another offset: each its own result."""
    table = MetaOutputs()
    x = _meta((4, 4))
    y = torch.empty(20, device=META)[2:18].view(4, 4)
    for a in (x, x.t(), x.to(torch.bfloat16), y, x, x.t()):
        for func, args in ((aten.zeros_like.default, (a,)), (aten.add.Tensor, (a, 1))):
            assert _layout(table.call(func, args, {})) == _layout(func(*args))
    assert table.remade == 4


def test_a_result_with_values_is_not_remembered() -> None:
    """An op whose operand holds values (a host tensor copied to a simulated GPU keeps them) writes them, or
    computes a result with values: it runs every time."""
    table = MetaOutputs()
    for _ in range(2):
        x = torch.zeros(3)
        assert table.call(aten.add_.Tensor, (x, torch.ones(3)), {}) is x
        assert x.tolist() == [1.0, 1.0, 1.0]
        assert table.call(aten.add.Tensor, (x, torch.ones(3)), {}).tolist() == [2.0, 2.0, 2.0]
    assert table.remade == 0


def test_an_op_under_another_dispatch_mode_runs_its_kernel() -> None:
    """Under torch's FakeTensorMode (FSDP2 sets parameters up in one) an op's result is a FakeTensor: the mode
    makes it, so the op runs, and what the table remembered outside the mode stays out of it."""
    table = MetaOutputs()
    x = _meta((2, 3))
    table.call(aten.mul.Tensor, (x, x), {})
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert type(table.call(aten.mul.Tensor, (x, x), {})) is FakeTensor
    assert table.remade == 0
    assert type(table.call(aten.mul.Tensor, (x, x), {})) is torch.Tensor
    assert table.remade == 1


def test_the_default_dtype_is_part_of_the_key() -> None:
    """A factory op's result type follows torch's default dtype, which the table keys on."""
    table = MetaOutputs()
    before = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            assert table.call(aten.ones.default, ([2],), {"device": META}).dtype == dtype
    finally:
        torch.set_default_dtype(before)
    assert table.remade == 1


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_fake_run_is_the_same_with_and_without_the_table(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timing-only step of a Llama-style model (DDP, FSDP2) on 4 simulated GPUs: the same simulated time, the
    same trace and the same memory, most of its ops remade without their kernel."""
    tables: list[MetaOutputs] = []
    made = meta_outputs.for_run

    def keep(fake: bool) -> MetaOutputs | None:
        table = made(fake)
        if table is not None:
            tables.append(table)
        return table

    monkeypatch.setattr(meta_outputs, "for_run", keep)
    monkeypatch.setattr("simdist.engine.runner.meta_outputs_for", keep)

    def step() -> simdist.RunResult:
        return simdist.run(
            llama_step.train_step,
            _gpus(4),
            args=(strategy, TINY, 1),
            memory=True,
            tensors="fake",
            races="off",
            watchdog=math.inf,
            trace="collectives",
        )

    step()  # torch's first use of these ops in the process (imports, caches), apart from the compared runs
    monkeypatch.setattr(meta_outputs, "ENABLED", False)
    without = step()
    monkeypatch.setattr(meta_outputs, "ENABLED", True)
    tables.clear()
    with_table = step()
    assert with_table.sim_time == without.sim_time
    assert with_table.trace_hash == without.trace_hash
    assert [m.peak_bytes for m in with_table.memory] == [m.peak_bytes for m in without.memory]
    assert [m.breakdown for m in with_table.memory] == [m.breakdown for m in without.memory]
    (table,) = tables
    assert table.remade > table.ran, (table.remade, table.ran)
