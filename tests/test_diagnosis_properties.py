"""Property: a program where one rank deviates (drops, adds, reorders or changes a collective) never hangs and
never passes silently: simdist raises a mismatch or a deadlock naming what each rank did."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import simdist

OPS = st.one_of(
    st.tuples(st.just("all_reduce"), st.integers(1, 4), st.sampled_from(["float32", "int64"])),
    st.tuples(st.just("broadcast"), st.integers(1, 4), st.integers(0, 1)),
    st.tuples(st.just("all_gather"), st.integers(1, 4), st.just("float32")),
    st.tuples(st.just("barrier"), st.just(1), st.just("")),
)


def execute(programs: list[list[tuple]]) -> int:
    prog = programs[dist.get_rank()]
    for kind, size, extra in prog:
        if kind == "all_reduce":
            dist.all_reduce(torch.ones(size, dtype=getattr(torch, extra)))
        elif kind == "broadcast":
            dist.broadcast(torch.ones(size), src=extra)
        elif kind == "all_gather":
            dist.all_gather([torch.zeros(size) for _ in range(dist.get_world_size())], torch.ones(size))
        else:
            dist.barrier()
    return len(prog)


def mutate(prog: list[tuple], how: str, i: int, op: tuple) -> list[tuple]:
    p = list(prog)
    i %= len(p)
    if how == "drop":
        del p[i]
    elif how == "insert":
        p.insert(i, op)
    elif how == "replace":
        p[i] = op
    else:  # swap with the next op
        j = (i + 1) % len(p)
        p[i], p[j] = p[j], p[i]
    return p


@given(
    n=st.integers(2, 4),
    prog=st.lists(OPS, min_size=1, max_size=5),
    rank=st.integers(0, 3),
    how=st.sampled_from(["drop", "insert", "replace", "swap"]),
    i=st.integers(0, 10),
    op=OPS,
)
def test_one_deviating_rank_is_diagnosed(n, prog, rank, how, i, op):
    rank %= n
    deviant = mutate(prog, how, i, op)
    programs = [deviant if r == rank else prog for r in range(n)]
    cluster = simdist.Cluster.switch(n, device="cpu")
    if deviant == prog:
        assert simdist.run(execute, cluster, args=(programs,)).returns == [len(prog)] * n
        return
    with pytest.raises((simdist.CollectiveMismatchError, simdist.DeadlockError)) as ei:
        simdist.run(execute, cluster, args=(programs,))
    assert "rank" in str(ei.value)
