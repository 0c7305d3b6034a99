"""FSDP (simdist.strategies.fsdp): sharding units, backward reduce-scatter hooks, accumulation, hazards.

The oracle for every training test is the single-process model (``tests/fsdp_fns.py``): the same network
trained in one process on every rank's data at once, with the same mixed precision. fp32 runs on one rank are
compared bitwise; on several ranks the data-parallel sum is added in another order than one process adds it,
so they are compared within the equivalence oracle's float32 tolerance (observed differences ~1e-8).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_fns as ff
import real
import simdist
from simdist.errors import CollectiveMismatchError
from simdist.oracle.flat import FlatAssemblyError, shard_layout, unpadded
from simdist.oracle.tolerance import Tolerance
from simdist.strategies.fsdp import (
    FSDP,
    SHARD_ATTR,
    FSDPBackwardHook,
    GradientAccumulator,
    Hazards,
    ShardingUnit,
    chunk_size,
    shard_range,
)


def cpu(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, device="cpu")


def on_ranks(fn, world: int, *args, **kwargs) -> list:
    """``fn(*args)`` on every rank of a simulated ``world``-rank CPU cluster; the returns by rank."""
    return simdist.run(fn, cpu(world), args=args, kwargs=kwargs, **({"progress": "nccl"})).returns


def rank_grad(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """A gradient that differs per rank (so a wrong pairing or a missing average shows)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g)


def mean_grad(shape: tuple[int, ...], world: int) -> torch.Tensor:
    return torch.stack([rank_grad(shape, r) for r in range(world)]).mean(0)


def two_linears(bias: bool = False, sizes: tuple[int, int] = (4, 4)) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(sizes[0], sizes[0], bias=bias), nn.Linear(sizes[0], sizes[1], bias=bias))


# ------------------------------------------------------------------------------------ units


@given(numel=st.integers(0, 100), world=st.integers(1, 8))
def test_chunks_cover_the_parameter_and_only_the_last_real_parts_are_shorter(numel: int, world: int) -> None:
    chunk = chunk_size(numel, world)
    ranges = [shard_range(numel, world, i) for i in range(world)]
    assert chunk * world >= numel > chunk * (world - 1) or numel == 0 or chunk * world - numel < world
    assert [x for a, b in ranges for x in range(a, b)] == list(range(numel))
    sizes = [b - a for a, b in ranges]
    assert all(s == chunk for s in sizes[: numel // max(chunk, 1)])
    full = torch.arange(float(numel))
    units = [ShardingUnit.from_full("w", full, i, world) for i in range(world)]
    for unit, (a, b) in zip(units, ranges):
        assert unit.local.shape == (chunk,) and unit.real == (a, b)
        assert torch.equal(unit.local[: b - a], full[a:b]) and not unit.local[b - a :].any()


def test_a_shard_index_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the group of 2"):
        ShardingUnit.from_full("w", torch.ones(3), 2, 2)


# --------------------------------------------------------------------- the seed's helper list


def _single(world: int) -> bool:
    model = FSDP(nn.Sequential(nn.Linear(3, 7, bias=False)))  # 21 elements: never divisible by 2, 4 or 8
    unit = model.units["0.weight"]
    out = model.hook.scatter_gradient(unit, rank_grad((7, 3), dist.get_rank()))
    assert model.hook.pending == 1
    model.hook.wait_all()
    assert out is unit.local_gradient and unit.local_gradient.shape == (unit.chunk,)
    expected = mean_grad((7, 3), world)
    ok = model.hook.verify_gradients(model.units, {"0.weight": expected})
    a, b = unit.real
    assert torch.allclose(unit.local_gradient[: b - a], expected.reshape(-1)[a:b], atol=1e-6)
    assert not unit.local_gradient[b - a :].any()  # the padding stays zero
    return ok


@pytest.mark.parametrize("world", [1, 2, 4])
def test_scatter_gradient_leaves_each_rank_its_chunk_of_the_group_mean(world: int) -> None:
    assert on_ranks(_single, world, world) == [True] * world


def _multiple(world: int, order: str) -> list[float]:
    model = FSDP(two_linears(sizes=(4, 5)))
    rank = dist.get_rank()
    grads = {name: rank_grad(tuple(u.shape), rank + i) for i, (name, u) in enumerate(model.units.items())}
    works = model.hook.scatter_multiple(model.units, grads)
    assert len(works) == 2
    model.hook.wait_all()
    expected = {
        name: torch.stack([rank_grad(tuple(u.shape), r + i) for r in range(world)]).mean(0)
        for i, (name, u) in enumerate(model.units.items())
    }
    return [float(model.hook.verify_gradients(model.units, expected))]


def test_scatter_multiple_pairs_by_name_and_reduces_every_unit() -> None:
    assert on_ranks(_multiple, 4, 4, "fixed") == [[1.0]] * 4


def _verify() -> list[bool]:
    model = FSDP(nn.Sequential(nn.Linear(1, 7, bias=False)))  # 7 elements over 3 ranks: chunks 3, 3, 1
    unit = model.units["0.weight"]
    full = torch.arange(7.0).reshape(7, 1)
    a, b = unit.real
    results = [model.hook.verify_gradients(model.units, {"0.weight": full})]  # no local gradient yet
    unit.local_gradient = torch.zeros(unit.chunk)
    unit.local_gradient[: b - a] = full.reshape(-1)[a:b]
    unit.local_gradient[b - a :] = 99.0  # padding is not looked at
    results.append(model.hook.verify_gradients(model.units, {"0.weight": full}))
    unit.local_gradient[0] += 5e-6
    results.append(model.hook.verify_gradients(model.units, {"0.weight": full}))
    unit.local_gradient[0] += 2e-5
    results.append(model.hook.verify_gradients(model.units, {"0.weight": full}))
    results.append(model.hook.verify_gradients(model.units, {"0.weight": full}, tolerance=1e-4))
    results.append(model.hook.verify_gradients(model.units, {}))  # nothing to compare
    return results


def test_verify_gradients_checks_each_real_chunk_within_the_tolerance_and_the_last_shard_is_shorter() -> None:
    out = on_ranks(_verify, 3)
    assert out == [[False, True, True, False, True, True]] * 3


def _accumulate_and_clear() -> list:
    model = FSDP(nn.Sequential(nn.Linear(2, 3, bias=False)))
    hook, unit = model.hook, model.units["0.weight"]
    hook.accumulate_gradients(model.units, {"0.weight": torch.ones(unit.chunk)})
    first = unit.local_gradient.clone()
    hook.accumulate_gradients(model.units, {"0.weight": torch.full((unit.chunk,), 2.0), "other": torch.ones(1)})
    summed = unit.local_gradient.clone()
    with pytest.raises(ValueError, match=r"shape \(4,\) into '0.weight'"):
        hook.accumulate_gradients(model.units, {"0.weight": torch.ones(unit.chunk + 1)})
    hook.clear_gradients(model.units)
    return [first.tolist(), summed.tolist(), unit.local_gradient.tolist()]


def test_accumulate_gradients_adds_into_the_local_shard_and_clear_zeroes_it() -> None:
    first, summed, cleared = on_ranks(_accumulate_and_clear, 2)[0]
    assert first == [1.0] * 3 and summed == [3.0] * 3 and cleared == [0.0] * 3


def _hooks_fire() -> list[int]:
    model = FSDP(two_linears(bias=True))  # 2 units, 2 replicated biases
    counts = [len(model.hook._handles)]
    model(torch.ones(2, 4)).sum().backward()
    counts.append(model.hook.pending)  # each unit's hook started its reduce-scatter during backward
    model.finish_gradient_synchronization()
    counts.append(model.hook.pending)
    counts.append(sum(p.grad is not None for p in model.parameters()))
    return counts


def test_one_hook_per_trainable_unit_fires_during_backward_and_finish_waits_them() -> None:
    assert on_ranks(_hooks_fire, 2) == [[2, 2, 0, 4]] * 2


def _null_and_counts() -> list[str]:
    model = FSDP(two_linears())
    unit = model.units["1.weight"]
    out = []
    with pytest.raises(ValueError) as null:
        model.hook.scatter_gradient(unit, None)
    out.append(str(null.value))
    with pytest.raises(ValueError) as counts:
        model.hook.scatter_multiple(model.units, {"0.weight": torch.ones(4, 4)})
    out.append(str(counts.value))
    with pytest.raises(ValueError) as shape:
        model.hook.scatter_gradient(unit, torch.ones(3))
    out.append(str(shape.value))
    return out


def test_a_null_gradient_names_the_parameter_and_mismatched_counts_are_refused() -> None:
    null, counts, shape = on_ranks(_null_and_counts, 2)[0]
    assert "'1.weight'" in null and "pass zeros" in null
    assert "2 sharding units and 1 gradients" in counts
    assert "'1.weight'" in shape and "(4, 4)" in shape


def _empty() -> list:
    model = FSDP(nn.Sequential())
    model.hook.register_hooks(model.module, {})
    out = model(torch.ones(2))
    model.finish_gradient_synchronization()
    return [model.units, model.hook.scatter_multiple({}, {}), list(model.parameters()), out.tolist(),
            model.gather_full_params(), model.hook.verify_gradients({}, {})]


def test_an_empty_model_wraps_runs_and_reduces_nothing() -> None:
    assert on_ranks(_empty, 2)[0] == [{}, [], [], [1.0, 1.0], {}, True]


class _UnknownGroup:
    """A process group torch does not know (never initialised, or already destroyed): the collective raises."""


def _failing_group() -> tuple[str, str]:
    model = FSDP(two_linears())
    model.group = _UnknownGroup()  # type: ignore[assignment]
    with pytest.raises(RuntimeError) as failed:
        model.hook.scatter_gradient(model.units["0.weight"], torch.ones(4, 4))
    assert model.units["0.weight"].local_gradient is None  # nothing half-issued is left behind
    return str(failed.value), str(failed.value.__cause__)


def test_a_failed_reduce_scatter_names_the_unit_and_chains_the_backend_error() -> None:
    text, cause = on_ranks(_failing_group, 2)[0]
    assert text == f"reduce-scatter of '0.weight' failed: {cause}" and "not initialized" in cause


def test_wrong_arguments_say_what_to_do() -> None:
    with pytest.raises(simdist.RankError, match="TypeError: FSDP wraps a torch.nn.Module; got str"):
        on_ranks(lambda: FSDP("net"), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Hazards.pair_by must be one of"):
        Hazards(pair_by="order")
    with pytest.raises(ValueError, match="FSDPBackwardHook needs the FSDP wrapper"):
        FSDPBackwardHook(None)  # type: ignore[arg-type]
