"""Hostile symmetric runs (``simdist.run(..., symmetric=True)``): programs whose ranks do not run alike, traffic
with ranks the run does not simulate, collectives whose ranks differ, clusters and options that single out ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from simdist.faults import Straggler

SWITCH8 = simdist.Cluster.switch(8, algorithms={"all_reduce": "ring"})


def _step() -> None:
    dist.all_reduce(torch.ones(16))


def _last_rank_computes_more() -> None:
    x = torch.randn(32, 32)
    if dist.get_rank() == dist.get_world_size() - 1:
        x = x @ x  # evaluation or logging on one rank
    dist.all_reduce(x)


def _middle_rank_reduces_another_shape() -> None:
    dist.all_reduce(torch.ones(3 if dist.get_rank() == 4 else 4))


def _send_to_rank_2() -> None:
    if dist.get_rank() == 0:
        dist.send(torch.ones(2), dst=2)


def _all_to_all() -> None:
    dist.all_to_all_single(torch.empty(8), torch.ones(8))


def _rank_0_reduces_once_more() -> None:
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))


def _gloo_group_on_gpus() -> None:
    dist.all_reduce(torch.ones(1000), group=dist.new_group(backend="gloo"))


def _upper_half_computes_first() -> None:
    x = torch.randn(32, 32)
    if dist.get_rank() >= 4:
        x = x @ x  # work only some ranks do (uneven shards, say)
    # pairs (0, 4), (1, 5), ...: rank 0 waits for rank 4 (simulated); rank 1 for rank 5, which is not
    pairs = [dist.new_group([r, r + 4]) for r in range(4)]
    dist.all_reduce(x, group=pairs[dist.get_rank() % 4])


def _symmetric(fn, cluster=SWITCH8, **kw):
    return lambda: simdist.run(fn, cluster, races="off", symmetric=True, **kw)


def _gloo_model() -> simdist.Cluster:
    cluster = simdist.Cluster.switch(4)
    cluster.collective_model = "gloo"
    return cluster


CASES = [
    Case(
        "rank-computes-more",
        "the last rank runs a matmul the others do not",
        _symmetric(_last_rank_computes_more),
        error=simdist.SymmetryError,
        match=r"rank 7 did not run as rank 0 did: span #\d+ of rank 0 is .* of rank 7 aten::mm",
    ),
    Case(
        "ranks-differ-one-in-consequence",
        "ranks 4-7 compute first; rank 1 then starts a collective earlier than rank 0, which waited for rank 4",
        _symmetric(_upper_half_computes_first),
        error=simdist.SymmetryError,
        # the rank whose difference comes first in time, not rank 1, whose later difference it caused
        match=r"rank 4 did not run as rank 0 did: span #1 of rank 0 is nccl:all_reduce .* of rank 4 aten::mm",
    ),
    Case(
        "rank-reduces-another-shape",
        "a sampled rank all-reduces a tensor of another shape",
        _symmetric(_middle_rank_reduces_another_shape),
        error=simdist.CollectiveMismatchError,
        match=r"rank 4: all_reduce\(shape=\(3,\)",
    ),
    Case(
        "rank-0-reduces-once-more",
        "rank 0 issues one all-reduce more than the others",
        _symmetric(_rank_0_reduces_once_more),
        error=simdist.DeadlockError,
        match=r"all_reduce #1: never issued by ranks 1, 4, 7; issued by rank 0(.|\n)*ranks 1, 4, 7: finished\n"
        r"  ranks 2-3, 5-6: not simulated \(a symmetric run",
    ),
    Case(
        "send-to-unsimulated-rank",
        "rank 0 sends to a rank the symmetric run does not simulate",
        _symmetric(_send_to_rank_2),
        error=simdist.SymmetryError,
        match=r"rank 0 tries to send to rank 2 at .*test_hostile_symmetry.py:\d+.* simulates only ranks 0-1, 4, 7",
    ),
    Case(
        "all-to-all",
        "an all-to-all, whose closed form misses how its messages share the links",
        _symmetric(_all_to_all),
        error=simdist.SymmetryError,
        match=r"all_to_all_single at .*test_hostile_symmetry.py:\d+ in _all_to_all: .*supports .*scatter, not "
        r"all_to_all_single: its closed form does not see how every rank's n-1 simultaneous messages share the links",
    ),
    Case(
        "two-level-message-timed",
        "a two-level cluster under alpha-beta timing, whose ring hops differ",
        _symmetric(_step, simdist.Cluster.two_level(2, 4)),
        error=simdist.SymmetryError,
        match=r"every hop of the ranks' ring to cost the same.*0 -> 1 .* 3 -> 4",
    ),
    Case(
        "gloo-group-on-dgx-nodes",
        "a gloo group's CPU all-reduce on DGX nodes, timed by its messages across unequal hops",
        _symmetric(_gloo_group_on_gpus, simdist.Cluster.preset("dgx-h100", world_size=16)),
        error=simdist.SymmetryError,
        match=r"as all_reduce at .*test_hostile_symmetry.py:\d+ .* is \(NCCL's model does not time it.* 7 -> 8",
    ),
    Case(
        "with-a-straggler",
        "symmetric=True with a straggler fault on rank 1",
        _symmetric(_step, faults=[Straggler(rank=1, slowdown=2.0)]),
        error=simdist.SymmetryError,
        match="cannot be combined with faults",
    ),
    Case(
        "with-a-perturbation",
        "symmetric=True with an exploration perturbation",
        _symmetric(_step, perturbation=simdist.Perturbation(seed=1)),
        error=simdist.SymmetryError,
        match="cannot be combined with a perturbation",
    ),
    Case(
        "gloo-model",
        "symmetric=True on a cluster timed by gloo's model",
        lambda: simdist.run(_step, _gloo_model(), races="off", symmetric=True),
        error=simdist.SymmetryError,
        match="does not support collective_model='gloo'",
    ),
    Case(
        "equivalence-oracle",
        "check_equivalence(..., symmetric=True)",
        lambda: simdist.check_equivalence(_step, _step, SWITCH8, symmetric=True),
        error=simdist.SymmetryError,
        match="check_equivalence compares every rank's state .* without symmetric=True",
    ),
    Case(
        "symmetric-not-bool",
        'symmetric="yes"',
        lambda: simdist.run(_step, SWITCH8, symmetric="yes"),
        error=simdist.RunArgumentError,
        match="symmetric must be True or False, got str 'yes'",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
