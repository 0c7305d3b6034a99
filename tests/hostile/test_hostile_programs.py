"""Hostile rank programs: endless loops, shared arguments, stray threads, odd exceptions, huge worlds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist


def _shared_arg_all_reduce(t: torch.Tensor) -> torch.Tensor:
    t.add_(1)
    dist.all_reduce(t)
    return t


def _expect_all(value: float):
    def check_(result: simdist.RunResult) -> None:
        for r in result.returns:
            assert torch.equal(r, torch.full_like(r, value)), result.returns
        storages = {r.untyped_storage().data_ptr() for r in result.returns}
        assert len(storages) == len(result.returns), "ranks returned one shared buffer"

    return check_


CASES: list[Case] = [
    Case(
        "arg-copied-per-rank",
        "add_ then in-place all_reduce on a tensor passed to every rank through args=",
        lambda: simdist.run(_shared_arg_all_reduce, simdist.Cluster.ring(2), args=(torch.ones(4),)),
        check=_expect_all(4.0),
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
