"""The records of collectives and reduce ops against their oracles: nccl-tests' bus-bandwidth formulas, torch's
own collective signatures, the schedules, and NumPy's reductions for every element type the backend accepts."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.distributed_c10d import supports_complex

from simdist import algorithms
from simdist.algorithms import Problem
from simdist.algorithms.table import records_markdown
from simdist.bench import COLLECTIVES as BENCHED
from simdist.bench import REDOPS
from simdist.c10d.process_group import SUPPORTED_DTYPES
from simdist.errors import InvalidArgumentError

#: nccl-tests' busBw factors (src/*.cu, ``*GetBw``); it has no barrier, whose busbw simdist reports as algbw
NCCL_TESTS_BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "barrier": lambda n: 1.0,
}
#: nccl-tests' ``-o`` names of the ops it offers
NCCL_TESTS_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                  "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}  # fmt: skip
#: each op as NumPy computes it (on bool, add is logical or and multiply logical and, as gloo reduces bools)
NUMPY_OPS = {
    "sum": np.add, "avg": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}  # fmt: skip
#: the element types the test draws (numpy has no complex32)
DTYPES = sorted((d for d in SUPPORTED_DTYPES if d != torch.complex32), key=str)

RECORDS = algorithms.COLLECTIVE_RECORDS


def test_every_collective_has_one_record_and_the_registry_declares_algorithms_for_each() -> None:
    names = [c.name for c in RECORDS]
    assert len(names) == len(set(names))
    assert names == list(dict.fromkeys(a.collective for a in algorithms.ALGORITHMS))
    assert algorithms.COLLECTIVES == tuple(names)
    for name in names:
        assert algorithms.collective(name).name == name
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*Did you mean 'all_reduce'"):
        algorithms.collective("allreduce")


@pytest.mark.parametrize("record", RECORDS, ids=lambda c: c.name)
@given(n=st.integers(1, 1 << 16))
def test_bus_factor_is_nccl_tests_formula(record: algorithms.Collective, n: int) -> None:
    assert record.bus_factor(n) == NCCL_TESTS_BUS[record.name](n)


@pytest.mark.parametrize("record", RECORDS, ids=lambda c: c.name)
def test_rooted_chunked_and_reduces_match_torchs_own_signature(record: algorithms.Collective) -> None:
    params = inspect.signature(getattr(dist, record.name)).parameters
    assert record.rooted == ("src" in params or "dst" in params)
    assert record.chunked == any(p.endswith("_list") for p in params)
    assert record.reduces == ("op" in params)


def _schedule(name: str, algo: str, n: int, root: int) -> list:
    counts = tuple(tuple(1 + (i + j) % 3 for j in range(n)) for i in range(n))
    recv = tuple(tuple(counts[j][i] for j in range(n)) for i in range(n))
    return algorithms.build(name, algo, Problem(n, 4 * n, 4, root, counts, recv))


@pytest.mark.parametrize("algo", algorithms.ALGORITHMS, ids=lambda a: f"{a.collective}-{a.name}")
@given(n=st.integers(2, 9), data=st.data())
def test_a_schedule_depends_on_the_root_exactly_when_its_collective_is_rooted(algo, n: int, data) -> None:
    root = data.draw(st.integers(1, n - 1))
    differs = _schedule(algo.collective, algo.name, n, 0) != _schedule(algo.collective, algo.name, n, root)
    assert differs == algorithms.collective(algo.collective).rooted


def test_the_bench_sweeps_every_collective_with_a_memory_factor() -> None:
    assert BENCHED == tuple(c.name for c in RECORDS if c.name != "barrier")
    assert all(c.memory_factor is not None and c.memory_factor >= 1 for c in RECORDS if c.name in BENCHED)
    assert algorithms.collective("barrier").memory_factor is None


def test_every_torch_reduce_op_but_premul_sum_has_one_record() -> None:
    names = [r.name for r in algorithms.REDUCE_OPS]
    assert len(names) == len(set(names))
    for kind in dist.ReduceOp.RedOpType.__members__.values():
        if kind == dist.ReduceOp.PREMUL_SUM:
            with pytest.raises(InvalidArgumentError, match="Cannot use ReduceOp.PREMUL_SUM with Gloo"):
                algorithms.reduce_op_of(kind)
            continue
        record = algorithms.reduce_op_of(kind)
        assert record.torch_op == kind and record.name == kind.name.lower()
        assert algorithms.reduce_op(record.name) is record
        assert algorithms.reduce_op_of(dist.ReduceOp(kind)) is record  # a ReduceOp object, as options hold
    with pytest.raises(
        InvalidArgumentError, match="PREMUL_SUM with Gloo.*SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR"
    ):
        algorithms.reduce_op_of(dist._make_nccl_premul_sum(2.0))
    with pytest.raises(ValueError, match="unsupported reduce op 'mean'"):
        algorithms.reduce_op("mean")


def test_the_bench_offers_the_ops_under_nccl_tests_names() -> None:
    for name, record in REDOPS.items():
        assert record.torch_op == NCCL_TESTS_OPS[name]
    assert sorted(REDOPS) == ["max", "min", "prod", "sum"]


def _draw(rng: np.random.Generator, dtype: torch.dtype, size: int) -> torch.Tensor:
    """Small values, exact in every floating type (eighths below 8), so NumPy and torch round alike."""
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size).astype(bool))
    if dtype.is_floating_point:
        return torch.from_numpy(rng.integers(-64, 64, size) / 8).to(dtype)
    if dtype.is_complex:
        return torch.complex(*(torch.from_numpy(rng.integers(-64, 64, size) / 8) for _ in "ri")).to(dtype)
    lo = 0 if dtype == torch.uint8 else -8
    return torch.from_numpy(rng.integers(lo, 8, size)).to(dtype)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _numpy_reduce(name: str, arrays: list[np.ndarray], dtype: torch.dtype) -> np.ndarray:
    """Fold ``arrays`` left to right with NumPy's op, rounding each step to ``dtype``; AVG then divides."""
    ufunc = NUMPY_OPS[name]
    step = (lambda a, b: _round_bf16(ufunc(a, b))) if dtype == torch.bfloat16 else ufunc
    out = functools.reduce(step, arrays)
    if name == "avg":
        n = np.asarray(len(arrays), dtype=out.dtype)
        out = _round_bf16(out / n) if dtype == torch.bfloat16 else out / n
    return out


@pytest.mark.parametrize("record", algorithms.REDUCE_OPS, ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(ranks=st.integers(1, 6), size=st.integers(0, 9), seed=st.integers(0, 2**32 - 1))
def test_each_reduce_op_reduces_as_numpy_on_every_type_it_accepts(record, dtype, ranks, size, seed) -> None:
    rng = np.random.default_rng(seed)
    inputs = [_draw(rng, dtype, size) for _ in range(ranks)]
    try:
        record.check_dtype(dtype, "the test tensor")
    except InvalidArgumentError as e:
        # refused as gloo refuses it: complex tensors where torch says the op has no complex form, bitwise ops
        # on floating-point tensors, AVG on integers and bool
        assert str(dtype) in str(e) and f"ReduceOp.{record.torch_op.name}" in str(e)
        if dtype.is_complex and not supports_complex(record.torch_op):
            return
        floating = dtype.is_floating_point or dtype.is_complex
        assert record.dtypes == ("integral" if floating else "floating")
        return
    assert not dtype.is_complex or supports_complex(record.torch_op)
    got = inputs[0].clone()
    combine = record.combiner(dtype)
    for t in inputs[1:]:
        combine(got, t)
    record.finish(got, ranks)
    with np.errstate(all="ignore"):  # int8 products wrap around, float16 ones may overflow: alike in both
        want = _numpy_reduce(record.name, [_as_numpy(t) for t in inputs], dtype)
    np.testing.assert_array_equal(_as_numpy(got), want.astype(_as_numpy(got).dtype))


@pytest.mark.parametrize("record", algorithms.REDUCE_OPS, ids=lambda r: r.name)
@given(values=st.lists(st.integers(-100, 100), min_size=1, max_size=8))
def test_each_reduce_ops_scalar_is_numpys_reduction(record, values: list[int]) -> None:
    want = NUMPY_OPS[record.name].reduce(np.array(values, dtype=np.int64))
    assert functools.reduce(record.scalar, values) == want


def test_the_documentation_lists_every_record() -> None:
    text = records_markdown()
    for c in RECORDS:
        assert f"| `{c.name}` | {c.summary} |" in text
    for r in algorithms.REDUCE_OPS:
        assert f"| `{r.name}` | `ReduceOp.{r.torch_op.name}` |" in text
