"""Backend progress semantics: NCCL-like (one stream per group) and gloo-like (a pool of worker threads).

Oracles: NumPy for results, the ring all-reduce closed form for when operations start and end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import simdist

BW, LAT = 10e9, 5e-6


def ring(n: int) -> simdist.Cluster:
    return simdist.Cluster.ring(n, bandwidth=BW, latency=LAT, device="cpu", algorithms={"all_reduce": "ring"})


def ring_all_reduce_time(n: int, nbytes: int) -> float:
    """Thakur et al.: 2(n-1) steps of latency plus 2(n-1)/n of the buffer over one link."""
    return 2 * (n - 1) * LAT + 2 * (n - 1) / n * nbytes / BW


def _independent(count: int, numel: int):
    r = dist.get_rank()
    bufs = [torch.full((numel,), float(r + 10 * i)) for i in range(count)]
    works = [dist.all_reduce(b, async_op=True) for b in bufs]
    for w in works:
        w.wait()
    return [b.tolist() for b in bufs]


@pytest.mark.parametrize("progress,threads", [("nccl", 2), ("gloo", 1), ("gloo", 2), ("gloo", 3)])
def test_independent_async_ops_are_correct_and_overlap_as_many_as_there_are_workers(progress, threads):
    n, count, numel = 4, 3, 1000
    res = simdist.run(_independent, ring(n), args=(count, numel), progress=progress, gloo_threads=threads)
    for r in range(n):
        for i in range(count):
            assert res.returns[r][i] == [sum(float(q + 10 * i) for q in range(n))] * numel
    spans = sorted(res.trace.collectives(0), key=lambda s: (s.start, s.stream))
    assert [s.name for s in spans] == [f"{progress}:all_reduce"] * count
    slots = 1 if progress == "nccl" else threads
    # at most `slots` at once, in issue order: the first `slots` start together, each later one when a
    # worker frees up (at the (i - slots)-th completion among the operations before it)
    for i, s in enumerate(spans):
        if i < slots:
            assert s.start == spans[0].start
        else:
            assert s.start == pytest.approx(sorted(p.end for p in spans[:i])[i - slots], abs=1e-12)
    if slots == 1:
        assert {s.stream for s in spans} == {spans[0].stream}
        assert spans[0].duration == pytest.approx(ring_all_reduce_time(n, numel * 4), rel=1e-6)
    else:
        assert len({s.stream for s in spans}) == min(slots, count)
        assert all(":thread" in s.stream for s in spans)


def _same_buffer_twice():
    r = dist.get_rank()
    g = torch.arange(8, dtype=torch.float64) + 100 * r
    w1 = dist.all_reduce(g, async_op=True)
    w2 = dist.all_reduce(g, async_op=True)
    w1.wait()
    w2.wait()
    return g.tolist()


def test_two_in_place_all_reduces_of_one_buffer_interleave_under_gloo_and_not_under_nccl():
    n = 4
    local = [np.arange(8, dtype=np.float64) + 100 * r for r in range(n)]
    twice = n * sum(local)  # the second all-reduce sums n copies of the first one's result
    nccl = simdist.run(_same_buffer_twice, ring(n), progress="nccl", races="off")
    for r in range(n):
        np.testing.assert_array_equal(nccl.returns[r], twice)
    gloo = simdist.run(_same_buffer_twice, ring(n), progress="gloo", races="off")
    assert any(not np.array_equal(gloo.returns[r], twice) for r in range(n))
    # the corruption is a deterministic function of the run: same seed, same numbers and trace
    again = simdist.run(_same_buffer_twice, ring(n), progress="gloo", races="off")
    assert again.returns == gloo.returns and again.trace_hash == gloo.trace_hash
    starts = {s.start for s in gloo.trace.collectives(0)}
    assert len(starts) == 1  # both ran at once, on two worker threads


def _torch_ddp_grads():
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    ddp = DDP(model, bucket_cap_mb=0.0005)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + dist.get_rank()), dtype=torch.float64)
    ddp(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_torch_ddp_under_gloo_progress_matches_single_process():
    n = 4
    res = simdist.run(_torch_ddp_grads, simdist.Cluster.switch(n, device="cpu"), progress="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    x = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64) for r in range(n)])
    model(x).pow(2).mean().backward()
    for r in range(n):
        for got, p in zip(res.returns[r], model.parameters()):
            torch.testing.assert_close(got, p.grad)


def _random_program(ops: list[tuple[int, int, bool]], numel: int):
    """ops: (buffer index, reduce op index, wait now); every buffer distinct, waits in random places."""
    r = dist.get_rank()
    reds = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN]
    bufs = [torch.arange(numel, dtype=torch.float64) * (i + 1) + r for i in range(len(ops))]
    pending = []
    for (i, red, wait_now), b in zip(ops, bufs):
        w = dist.all_reduce(b, op=reds[red], async_op=True)
        if wait_now:
            w.wait()
        else:
            pending.append(w)
    for w in pending:
        w.wait()
    return [b.tolist() for b in bufs]


@given(
    n=st.integers(1, 6),
    ops=st.lists(st.tuples(st.integers(0, 0), st.integers(0, 2), st.booleans()), min_size=1, max_size=6),
    threads=st.integers(1, 4),
    numel=st.integers(1, 40),
)
def test_gloo_progress_on_distinct_buffers_equals_numpy_for_any_waits(n, ops, threads, numel):
    res = simdist.run(_random_program, simdist.Cluster.switch(n, device="cpu"), args=(ops, numel), progress="gloo", gloo_threads=threads)
    assert res.races == []
    fns = [np.sum, np.max, np.min]
    for k, (_, red, _) in enumerate(ops):
        want = fns[red](np.stack([np.arange(numel, dtype=np.float64) * (k + 1) + q for q in range(n)]), axis=0)
        for r in range(n):
            np.testing.assert_array_equal(res.returns[r][k], want)


def test_bad_progress_options_are_rejected():
    with pytest.raises(ValueError, match="progress must be one of"):
        simdist.run(lambda: None, ring(2), progress="mpi")
    with pytest.raises(ValueError, match="gloo_threads must be an int from 1 to 1024"):
        simdist.run(lambda: None, ring(2), progress="gloo", gloo_threads=0)
