"""FSDP (simdist.strategies.fsdp): sharding units, backward reduce-scatter hooks, accumulation, hazards.

The oracle for every training test is the single-process model (``tests/fsdp_fns.py``): the same network
trained in one process on every rank's data at once, with the same mixed precision. fp32 runs on one rank are
compared bitwise, and on two ranks bitwise with one process that adds the two ranks' gradients; otherwise the
data-parallel sum is added in another order than one process adds it, so they are compared within the
equivalence oracle's float32 tolerance (observed differences ~1e-8).
"""

from __future__ import annotations

import functools
import inspect
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import fsdp_fns as ff
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

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


def on_ranks(fn, world: int, /, *args, **kwargs) -> list:
    """``fn(*args)`` on every rank of a simulated ``world``-rank CPU cluster; the returns by rank."""
    return simdist.run(fn, cpu(world), args=args, kwargs=kwargs).returns


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


def _timed_step() -> tuple[float, float]:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))
    loss = model(torch.randn(64, 256)).square().mean()
    start = simdist.now()
    loss.backward()
    return start, simdist.now()


def test_reduce_scatters_start_during_backward_and_overlap_its_compute() -> None:
    result = simdist.run(_timed_step, cpu(2))
    start, end = result.returns[0]  # simulated seconds: backward began, backward returned
    scatters = [s for s in result.trace.collectives(0) if "reduce_scatter" in s.name]
    assert len(scatters) == 4  # one per unit
    # the last layer's gradient is ready first: its reduce-scatter runs while earlier layers still compute
    # their backward, and backward returns before the last reduce-scatter is done (finish waits for it)
    assert start < scatters[0].start and scatters[0].end < end < scatters[-1].end
    # backward prefetch: the last layer's all-gather and the one before it were issued ahead of the first
    # reduce-scatter, so the next layer's backward does not wait behind it on the group's one stream
    gathers = [s for s in result.trace.collectives(0) if "all_gather" in s.name and s.start >= start]
    assert sum(g.start < scatters[0].start for g in gathers) == 2


# ------------------------------------------------------------------------------ accumulator


def test_gradient_accumulator_sums_by_name_and_is_complete_after_its_steps() -> None:
    acc = GradientAccumulator(2)
    assert not acc.is_complete  # nothing recorded yet
    first = {"a": torch.ones(3), "b": torch.full((2,), 2.0), "none": None}
    acc.add_gradients(first)
    first["a"].add_(100)  # the accumulator kept a copy
    assert not acc.is_complete
    acc.add_gradients({"a": torch.full((3,), 0.5), "b": torch.ones(2)})
    assert acc.is_complete
    sums = acc.get_and_clear_gradients()
    assert sums["a"].tolist() == [1.5] * 3 and sums["b"].tolist() == [3.0] * 2 and "none" not in sums
    assert not acc.is_complete and acc.get_and_clear_gradients() == {}
    acc.add_gradients({"a": torch.ones(1)})
    acc.reset()
    assert not acc.is_complete and acc.get_and_clear_gradients() == {}
    acc.add_gradients({"a": torch.ones(1)})
    acc.add_gradients({"a": torch.ones(2)})
    with pytest.raises(ValueError, match="gradients of 'a' have shapes"):
        acc.get_and_clear_gradients()


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_gradient_accumulator_refuses_a_non_positive_number_of_steps(steps: object) -> None:
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
        GradientAccumulator(steps)  # type: ignore[arg-type]


# ----------------------------------------------------------- equivalence with one process


def check(spec: ff.NetSpec, world: int, *, exact: bool = False, reference: dict | None = None, **kwargs) -> object:
    """FSDP on ``world`` ranks against the single-process model, through the equivalence oracle."""
    ref_kwargs = {"world": world, **{k: v for k, v in kwargs.items() if k in ("steps", "micro")}, **(reference or {})}
    loss = "accumulated" if kwargs.get("micro", 1) > 1 else "mean"
    return simdist.check_equivalence(
        ff.fsdp_train, ff.reference_train, cpu(world), args=(spec,), kwargs=kwargs, reference_kwargs=ref_kwargs,
        exact=exact, loss=loss,
    )


def test_one_rank_equals_the_single_process_model_bitwise() -> None:
    rep = check(ff.NetSpec(adam=True), 1, exact=True)
    assert rep.ok, rep


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("spec", [ff.NetSpec(), ff.NetSpec(adam=True, unused=True, frozen=0b100)], ids=["sgd", "adam"])
def test_fsdp_equals_the_single_process_model_in_fp32(spec: ff.NetSpec, world: int) -> None:
    rep = check(spec, world)
    assert rep.ok, rep


@settings(max_examples=10)
@given(
    spec=st.builds(
        ff.NetSpec, vocab=st.integers(2, 12), dim=st.integers(1, 9), layers=st.integers(0, 2),
        tie_out=st.booleans(), adam=st.booleans(),
    ),
    size=st.integers(1, 4),
)
def test_on_two_ranks_fp32_training_is_bitwise_that_of_one_process_adding_the_two_ranks_gradients(
    spec: ff.NetSpec, size: int
) -> None:
    # Two partial gradients add the same in any order, and halving is exact: no rounding step is left between
    # the ranks' gradients and the optimizer but the one sum. The oracle adds the same two partial sums (one
    # backward per rank's batch); one backward on the whole batch would sum its rows in another order. On more
    # ranks the reduction's order of three or more terms differs from autograd's, and results agree within
    # rounding only (the tests above).
    ours = on_ranks(ff.fsdp_train, 2, spec, steps=2, size=size)
    reference = ff.reference_by_rank(spec, steps=2, size=size, world=2)
    for rank_params in ours:
        assert rank_params.keys() == reference.keys()
        differing = [n for n in reference if not torch.equal(rank_params[n], reference[n])]
        assert not differing, differing


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_a_16_bit_compute_dtype_stays_within_1e_4_of_the_single_process_model(compute: str) -> None:
    spec = ff.NetSpec(compute=compute)
    # Each rank rounds its own partial gradient to the compute dtype, one process rounds the sum of all of
    # them: gradients agree to the compute dtype's rounding, not more (no reduction order changes that).
    rounding = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[compute]
    rep = simdist.check_equivalence(
        ff.fsdp_train, ff.reference_train, cpu(2), args=(spec,), kwargs={"steps": 1},
        reference_kwargs={"world": 2, "steps": 1}, tolerances={torch.float32: Tolerance(rtol=4 * rounding, atol=1e-6)},
    )
    assert rep.ok, rep
    # the fp32 masters after an SGD step (lr 0.1) are within 1e-4 of the single process's
    ours = on_ranks(ff.fsdp_train, 2, spec, steps=1)
    ref = on_ranks(ff.reference_train, 1, spec, steps=1, world=2)[0]
    for rank_params in ours:
        assert {n: p.dtype for n, p in rank_params.items()} == {n: torch.float32 for n in ref}
        worst = max(float((rank_params[n] - ref[n]).abs().max()) for n in ref)
        assert worst < 1e-4


@pytest.mark.parametrize("accumulate", ["no_sync", "sync"])
def test_accumulating_k_micro_batches_equals_one_step_on_the_k_times_larger_batch(accumulate: str) -> None:
    rep = check(ff.NetSpec(adam=True), 2, micro=3, accumulate=accumulate, reference={"merged": True})
    assert rep.ok, rep


def test_a_gradient_accumulator_over_synchronised_micro_batches_equals_the_larger_batch() -> None:
    spec = ff.NetSpec()
    rep = simdist.check_equivalence(
        ff.accumulator_train, ff.reference_train, cpu(2), args=(spec,), reference_kwargs={"world": 2, "micro": 2, "merged": True},
        loss="accumulated",
    )
    assert rep.ok, rep


def test_keeping_parameters_gathered_after_forward_gives_the_same_training() -> None:
    rep = check(ff.NetSpec(tie_out=False), 2, reshard=False)
    assert rep.ok, rep


# ----------------------------------------------------------------- the oracle's shard protocol


def _perturbed(spec: ff.NetSpec) -> dict:
    """FSDP training whose rank 1 adds 1 to one element of its shard of 'proj.weight' before each step."""
    model = FSDP(ff.make_net(spec, 0))
    optimizer = ff.optimizer_for(spec, list(model.parameters()))
    tokens, targets = ff.batch(spec, 0, 0, dist.get_rank(), 0, 3)
    F.cross_entropy(model(tokens), targets).backward()
    model.finish_gradient_synchronization()
    if dist.get_rank() == 1:
        model.units["proj.weight"].local_gradient[1] += 1.0
    optimizer.step()
    return {}


def test_the_oracle_assembles_shards_by_name_and_names_the_rank_of_a_wrong_one() -> None:
    spec = ff.NetSpec()
    rep = simdist.check_equivalence(
        _perturbed, ff.reference_train, cpu(2), args=(spec,), reference_kwargs={"world": 2, "steps": 1}, localize=False
    )
    assert not rep.ok and rep.first.kind == "grad" and rep.first.name == "proj.weight" and rep.first.ranks == (1,)


def _shard_attrs() -> list:
    model = FSDP(ff.make_net(ff.NetSpec(), 0), torch.bfloat16)
    return [getattr(p, SHARD_ATTR, None) for p in model.parameters()]


def test_each_shard_describes_where_it_sits_in_the_full_parameter() -> None:
    attrs = on_ranks(_shard_attrs, 2)
    # embed.weight (7 x 5 = 35 elements): chunks of 18, rank 1's real part 17 elements
    assert attrs[1][0] == ("embed.weight", (7, 5), 1, 2, 18, (0, 1))
    layout = shard_layout(attrs[1][0])
    assert layout.span == (18, 35) and unpadded(layout, torch.arange(18.0)).tolist() == list(map(float, range(17)))
    # replicated biases left the module for their bf16 copies: described as one shard per rank (replicas)
    assert attrs[0][2] == ("hidden.0.bias", (5,), 0, 1, 5, (0,)) and attrs[1][2][-1] == (1,)


def test_a_malformed_shard_description_says_what_it_must_be() -> None:
    with pytest.raises(FlatAssemblyError, match="must be \\(name, full shape"):
        shard_layout(("w", (3,), 0))
    with pytest.raises(FlatAssemblyError, match="cannot hold a parameter of shape \\(9,\\)"):
        shard_layout(("w", (9,), 0, 2, 4, (0, 1)))


# ------------------------------------------------------------------ state dicts and gathering


def _state_round_trip() -> list:
    spec = ff.NetSpec()
    net = ff.make_net(spec, 0)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    model = FSDP(net)
    full = model.state_dict()
    gathered = model.gather_full_params()
    sharded = model.state_dict(full=False)
    plain = ff.Net(spec)
    plain.load_state_dict(full)  # the full state dict loads into the unwrapped model
    other = FSDP(ff.make_net(spec, 1))
    other.load_state_dict(full)
    from_full = other.gather_full_params()
    third = FSDP(ff.make_net(spec, 2))
    third.load_state_dict(sharded, full=False)
    with pytest.raises(KeyError, match=r"missing keys \['embed.weight'\]"):
        third.load_state_dict({k: v for k, v in full.items() if k != "embed.weight"})
    return [
        all(torch.equal(full[k], initial[k]) for k in initial) and sorted(full) == sorted(initial),
        all(torch.equal(gathered[k], initial[k]) for k in gathered),
        all(torch.equal(plain.state_dict()[k], initial[k]) for k in initial),
        all(torch.equal(from_full[k], initial[k]) for k in from_full),
        all(torch.equal(a, b) for a, b in zip(third.parameters(), model.parameters())),
        sharded["embed.weight"].shape == (chunk_size(35, dist.get_world_size()),),
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_full_and_sharded_state_dicts_round_trip(world: int) -> None:
    assert on_ranks(_state_round_trip, world) == [[True] * 6] * world


# ------------------------------------------------------------------------------ properties


@settings(max_examples=12)
@given(
    world=st.integers(1, 8),
    dim=st.integers(2, 6),
    layers=st.integers(0, 2),
    tie_out=st.booleans(),
    unused=st.booleans(),
    frozen=st.integers(0, 7),
    micro=st.integers(1, 3),
    compute=st.sampled_from([None, "bfloat16", "float16"]),
)
def test_fsdp_training_equals_the_single_process_model(
    world: int, dim: int, layers: int, tie_out: bool, unused: bool, frozen: int, micro: int, compute: str | None
) -> None:
    spec = ff.NetSpec(vocab=dim + 2, dim=dim, layers=layers, tie_out=tie_out, unused=unused, frozen=frozen, compute=compute)
    steps = 2 if compute is None else 1
    ours = on_ranks(ff.fsdp_train, world, spec, steps=steps, micro=micro)
    ref = on_ranks(ff.reference_train, 1, spec, steps=steps, micro=micro, world=world)[0]
    bound = 1e-6 if compute is None else 1e-4
    for params in ours:
        assert sorted(params) == sorted(ref)
        for name in ref:
            assert float((params[name] - ref[name]).abs().max()) < bound, name
    assert all(torch.equal(ours[0][n], other[n]) for other in ours[1:] for n in ref)  # every rank gathers the same


# -------------------------------------------------------------------------------- hazards


def _pairing(pair_by: str) -> list[bool]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = FSDP(two_linears(), hazards=Hazards(pair_by=pair_by))  # two units of one shape
    units = dict(model.units) if rank == 0 else dict(reversed(model.units.items()))  # rank 1 built it in reverse
    grads = {name: rank_grad((4, 4), rank + 10 * i) for i, name in enumerate(model.units)}
    model.hook.scatter_multiple(units, grads)
    model.hook.wait_all()
    expected = {
        name: torch.stack([rank_grad((4, 4), r + 10 * i) for r in range(world)]).mean(0)
        for i, name in enumerate(model.units)
    }
    return [model.hook.verify_gradients({n: u}, {n: expected[n]}) for n, u in model.units.items()]


def test_pairing_by_position_puts_a_gradient_in_another_units_shard_where_orders_differ() -> None:
    assert on_ranks(_pairing, 2, "name") == [[True, True]] * 2
    assert on_ranks(_pairing, 2, "position") == [[False, False]] * 2


def _averaged(average: bool) -> float:
    model = FSDP(nn.Sequential(nn.Linear(3, 5, bias=False)), hazards=Hazards(average=average))
    unit = model.units["0.weight"]
    model.hook.scatter_gradient(unit, rank_grad((5, 3), dist.get_rank()))
    model.hook.wait_all()
    a, b = unit.real
    expected = mean_grad((5, 3), dist.get_world_size()).reshape(-1)[a:b]
    return float((unit.local_gradient[: b - a] / expected).mean())


def test_a_reduce_scatter_not_averaged_gives_world_size_times_the_gradient() -> None:
    assert on_ranks(_averaged, 4, True) == pytest.approx([1.0] * 4)
    assert on_ranks(_averaged, 4, False) == pytest.approx([4.0] * 4)


def _padding(zero: bool) -> tuple[list[float], bool]:
    model = FSDP(nn.Sequential(nn.Linear(1, 5, bias=False)), hazards=Hazards(zero_padding=zero))  # 5 over 4: 2,2,1,0
    unit = model.units["0.weight"]
    full = rank_grad((5, 1), dist.get_rank())
    model.hook.scatter_gradient(unit, full)
    model.hook.wait_all()
    a, b = unit.real
    expected = mean_grad((5, 1), dist.get_world_size())
    return unit.local_gradient[b - a :].tolist(), model.hook.verify_gradients(model.units, {"0.weight": expected})


def test_padding_not_zeroed_leaves_values_in_the_last_shards_gradient_that_verify_gradients_misses() -> None:
    assert [pad for pad, _ in on_ranks(_padding, 4, True)] == [[], [], [0.0], [0.0, 0.0]]
    stale = on_ranks(_padding, 4, False)
    # each rank's stale padding is its shard index + 1; the average over the 4 ranks is 2.5
    assert [pad for pad, _ in stale] == [[], [], [2.5], [2.5, 2.5]]
    assert all(ok for _, ok in stale)  # the original check compares real elements only


def _accumulate(mode: str) -> list[float]:
    model = FSDP(nn.Sequential(nn.Linear(2, 3, bias=False)), hazards=Hazards(accumulate=mode))
    hook, unit = model.hook, model.units["0.weight"]
    hook.accumulate_gradients(model.units, {"0.weight": torch.ones(unit.chunk)})
    hook.accumulate_gradients(model.units, {"0.weight": torch.arange(1.0, unit.chunk + 2)})  # one too long
    return unit.local_gradient.tolist()


def test_truncating_accumulation_silently_drops_elements_where_strict_raises() -> None:
    assert on_ranks(_accumulate, 2, "truncate")[0] == [2.0, 3.0, 4.0]
    with pytest.raises(simdist.RankError, match="cannot accumulate a gradient of shape \\(4,\\)"):
        on_ranks(_accumulate, 2, "strict")


def _scatter_all(order: str) -> bool:
    model = FSDP(two_linears(sizes=(4, 6)), hazards=Hazards(scatter_order=order))  # units of 16 and 24 elements
    grads = {name: torch.ones(unit.shape) for name, unit in model.units.items()}
    model.hook.scatter_multiple(model.units, grads)
    model.hook.wait_all()
    return model.hook.verify_gradients(model.units, grads)


def test_per_rank_scatter_order_is_a_collective_mismatch_under_nccl_progress() -> None:
    assert on_ranks(_scatter_all, 2, "fixed") == [True, True]
    with pytest.raises(CollectiveMismatchError, match="does not match across ranks") as mismatch:
        on_ranks(_scatter_all, 2, "per_rank")
    assert "reduce_scatter" in str(mismatch.value)


@pytest.mark.parametrize("progress", ["nccl", "gloo"])
def test_correct_fsdp_has_no_race_under_either_progress_semantics(progress: str) -> None:
    spec = ff.NetSpec(unused=True)
    result = simdist.run(ff.fsdp_train, cpu(4), args=(spec,), kwargs={"micro": 2}, progress=progress, races="error")
    ref = on_ranks(ff.reference_train, 1, spec, micro=2, world=4)[0]
    assert max(float((result.returns[0][n] - ref[n]).abs().max()) for n in ref) < 1e-6


def _steps_early() -> None:
    spec = ff.NetSpec()
    model = FSDP(ff.make_net(spec, 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = ff.batch(spec, 0, 0, dist.get_rank(), 0, 3)
    F.cross_entropy(model(tokens), targets).backward()
    optimizer.step()  # the reduce-scatters into the shards' gradients are still in flight
    model.finish_gradient_synchronization()


def test_the_race_detector_names_an_optimizer_step_before_finish_gradient_synchronization() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", simdist.RaceWarning)
        result = simdist.run(_steps_early, cpu(2), races="warn")
    assert result.races
    text = "\n".join(str(r) for r in result.races)
    assert "reduce_scatter" in text and "_steps_early" in text


def _gathers_another_unit() -> None:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
    if dist.get_rank() == 0:
        model(torch.ones(4))  # LINE whole model
    else:
        model.module[1](torch.ones(6))  # LINE second layer


def _marked_line(fn: object, marker: str) -> int:
    """The line of ``fn``'s source carrying ``# LINE marker``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if f"# LINE {marker}" in text)


def test_a_mismatch_inside_fsdp_names_the_users_line_after_the_wrappers_on_every_rank() -> None:
    with pytest.raises(CollectiveMismatchError) as info:
        on_ranks(_gathers_another_unit, 2)
    text = str(info.value)
    wrapper = str(Path(FSDP.__module__.replace(".", "/") + ".py"))
    for rank, marker in ((0, "whole model"), (1, "second layer")):
        line = f"rank {rank}: all_gather_into_tensor("
        site = text.split(line)[1].split("\n")[0]
        # the wrapper's line that issued the all-gather, then the line of this program that called into FSDP
        assert wrapper in site and "in _start_gather, called from " in site, site
        assert site.endswith(f", called from {__file__}:{_marked_line(_gathers_another_unit, marker)} in "
                             "_gathers_another_unit"), site


# ------------------------------------------------------------ sharded parameters outside their module


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("reshard", [True, False])
def test_a_weight_used_outside_its_module_in_forward_is_gathered_and_trains_as_one_process(
    world: int, reshard: bool
) -> None:
    # the projection reads the embedding's weight outside the embedding; FSDP gathers it there (as FSDP2 does
    # for every parameter of the module it wraps) and keeps it until its gradient is reduced
    rep = simdist.check_equivalence(
        ff.tied_fsdp_train, ff.tied_reference_train, cpu(world), args=(reshard,),
        reference_kwargs={"world": world}, exact=world == 1,
    )
    assert rep.ok, rep
    assert rep.steps == 2


OUTSIDE_FORWARD = """
import json, sys, torch, torch.distributed as dist, simdist
from torch import nn
from simdist.strategies.fsdp import FSDP
from simdist.strategies.fsdp.resharded import Resharded

DEVICE = sys.argv[1]

def rank():
    if DEVICE == "cuda":
        torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(DEVICE)
    model = FSDP(net)
    model(torch.ones(3, 4, device=DEVICE)).sum().backward()
    scattered_in_backward = model.hook.pending
    model.finish_gradient_synchronization()
    w = net[0].weight
    errors = []
    for use in (lambda: w.sum(), lambda: w.clone(), lambda: w + 1, lambda: w.T, lambda: w.data.tolist(),
                lambda: torch.cat([w, w])):
        try:
            use()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    counted = sum(p.numel() for p in net.parameters())
    return {"errors": errors, "numel": counted, "shape": list(w.shape), "repr": repr(w),
            "placeholder": isinstance(w, Resharded), "device": str(w.device),
            "scattered_in_backward": scattered_in_backward}

cluster = simdist.Cluster.switch(2, device="cpu" if DEVICE == "cpu" else "H100")
print(json.dumps(simdist.run(rank, cluster, compute=False).returns))
"""


@functools.cache
def _outside_forward(device: str) -> list[dict[str, Any]]:
    """OUTSIDE_FORWARD's returns by rank, run for ``device`` in a process of its own (once per test process)."""
    # a read of the freed memory used to end the process (SIGSEGV)
    command = [sys.executable, "-c", OUTSIDE_FORWARD, device]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}{done.stderr[-2000:]}"
    return json.loads(done.stdout.splitlines()[-1])


def test_a_sharded_weight_read_outside_forward_is_a_clear_error_not_a_crash() -> None:
    for rank, got in enumerate(_outside_forward("cpu")):
        # what needs no values still answers, as for the unwrapped model
        assert got["numel"] == 4 * 4 + 4 + 4 * 2 + 2 and got["shape"] == [4, 4]
        assert "'0.weight'" in got["repr"] and got["placeholder"] and got["device"] == "cpu"
        for error in got["errors"]:
            assert error is not None and "FSDP's sharded parameter '0.weight' was used by " in error, error
            assert f"on rank {rank} outside the forward" in error and "model.gather_full_params()" in error, error
            assert f"elements [{8 * rank}, {8 * rank + 8}) of 16" in error, error
        # every unit's reduce-scatter was issued from its gradient hook, overlapping the rest of backward
        assert got["scattered_in_backward"] == 2


def test_on_simulated_gpus_the_placeholder_and_the_gradient_hooks_are_those_of_the_cpu_program() -> None:
    # torch's Parameter makes a tensor subclass (a simulated GPU tensor is one) a parameter by flagging that
    # subclass's own object, so a Parameter subclass over it is not an instance of the subclass
    cpu_run = _outside_forward("cpu")
    for rank, got in enumerate(_outside_forward("cuda")):
        assert got["device"] == f"cuda:{rank}"
        assert {**got, "device": "cpu"} == cpu_run[rank]


class Indexed(nn.Module):
    """An embedding written by hand: a plain module holding a weight and indexing it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens]


def _module_gradients(compute: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(Indexed(), nn.Linear(5, 3))  # Indexed is replicated: not Embedding-like
    model = FSDP(net, compute_dtype=getattr(torch, compute) if compute else None)
    tokens, targets = ff.tied_batch(0, dist.get_rank())
    F.cross_entropy(model(tokens).float(), targets % 3).backward()
    model.finish_gradient_synchronization()
    masters = dict(model.named_parameters())
    # a sharded unit's parameter in the module is its full parameter's placeholder, in the compute dtype
    return {
        name: {"grad": p.grad is not None, "master": p is masters[name]}
        | ({"dtype": str(p.dtype)} if name not in model.units else {})
        for name, p in net.named_parameters()
    }


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_with_a_16_bit_compute_dtype_the_modules_hold_the_masters_and_their_gradients_after_forward(
    compute: str,
) -> None:
    # oracle: the same model without a compute dtype, where the replicated parameters are the masters anyway
    for mixed, plain in zip(on_ranks(_module_gradients, 2, compute), on_ranks(_module_gradients, 2, None)):
        assert mixed == plain
        assert mixed["0.weight"] == mixed["1.bias"] == {"grad": True, "master": True, "dtype": "torch.float32"}


# --------------------------------------------------------------------- simulator independence


def test_the_fsdp_package_loads_nothing_from_the_simulator() -> None:
    # simdist's own __init__ loads the simulator for its public API; a bare package in its place shows what
    # the strategy itself loads (the same code must run under real processes)
    code = (
        "import sys, types\n"
        "bare = types.ModuleType('simdist'); bare.__path__ = [sys.argv[1]]; sys.modules['simdist'] = bare\n"
        "import simdist.strategies.fsdp\n"
        "print(sorted(m for m in sys.modules if m.startswith(('simdist', 'real'))))"
    )
    root = Path(__file__).resolve().parent.parent
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(root / "simdist")], cwd=root, capture_output=True, text=True, check=True
    )
    modules = eval(loaded.stdout)
    assert "simdist.strategies.fsdp.wrapper" in modules
    assert [m for m in modules if not m.startswith("simdist.strategies")] == ["simdist"], modules


# ------------------------------------------------------------------------------- real gloo


@pytest.mark.real
def test_fsdp_on_real_gloo_processes_equals_the_single_process_model() -> None:
    # One launch: the simulated tests above cover world sizes 1-8, this one the same code on real gloo. Three
    # processes shard some parameters evenly (30 elements) and pad others' last shard (35, 25).
    nproc = 3
    spec = ff.NetSpec(unused=True, frozen=0b100)
    out = real.run(ff.real_compare, nproc, args=(spec, 2, 3, 0), timeout=240).returns
    assert len(out) == nproc
    for diffs in out:
        assert set(diffs) == {n for n, _ in ff.make_net(spec, 0).named_parameters()}
        assert max(diffs.values()) < 1e-6


class _HalfUsed(nn.Module):
    """Two layers, of which forward uses the first only: the second's weight gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_unit_on_gpu() -> tuple[int, torch.Tensor]:
    torch.cuda.set_device(dist.get_rank())
    with torch.device("cuda"):  # made on the GPU: any copy from the host is FSDP's
        model = FSDP(_HalfUsed())
        model(torch.ones(2, 8)).sum().backward()
    model.finish_gradient_synchronization()
    grad = dict(model.named_parameters())["unused.weight"].grad
    return str(grad.device), grad


def test_a_unit_without_a_gradient_on_a_gpu_reduces_zeros_made_on_that_gpu() -> None:
    res = simdist.run(_unused_unit_on_gpu, simdist.Cluster.switch(2, device="H100"))
    for rank, (device, grad) in enumerate(res.returns):
        assert device == f"cuda:{rank}" and not grad.any()
    # zeros made on the host would cross the host link before the reduce-scatter, as on a GPU
    assert [s for s in res.trace.spans if s.name.startswith("Memcpy")] == []
