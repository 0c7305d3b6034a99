"""Collective results against a NumPy reference, over random world sizes, shapes, dtypes and algorithms."""

from __future__ import annotations

import alpha_beta
import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import simdist

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.float16, torch.bfloat16]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
NP_REDUCE = {"sum": np.sum, "product": np.prod, "min": np.min, "max": np.max}


def cluster(n: int, algorithm: str | None = None, coll: str = "all_reduce") -> simdist.Cluster:
    algos = {coll: algorithm} if algorithm else None
    return simdist.Cluster.switch(n, bandwidth="100GB/s", latency="2us", device="cpu", algorithms=algos)


def rank_data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic per-rank input: small integers so every dtype (and products) stays exact."""
    g = np.random.default_rng(seed * 1000 + rank)
    lo, hi = (0, 3) if dtype in (torch.uint8, torch.int8) else (-3, 4)
    return torch.from_numpy(g.integers(lo, hi, size=shape)).to(dtype)


def np_of(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def assert_same(got: torch.Tensor, want: np.ndarray) -> None:
    np.testing.assert_allclose(np_of(got), want.astype(np_of(got).dtype), rtol=1e-2 if got.dtype in (torch.float16, torch.bfloat16) else 1e-6)


shapes = st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)
world = st.integers(1, 8)
dtypes = st.sampled_from(DTYPES)


def _all_reduce(shape, dtype, op, seed):
    t = rank_data(dist.get_rank(), shape, dtype, seed)
    dist.all_reduce(t, op=OPS[op])
    return t


@given(n=world, shape=shapes, dtype=dtypes, op=st.sampled_from(sorted(OPS)), algo=st.sampled_from(["ring", "tree", "rhd", "direct"]), seed=st.integers(0, 99))
def test_all_reduce(n, shape, dtype, op, algo, seed):
    if op == "product" and dtype in (torch.float16, torch.bfloat16):
        op = "sum"
    res = simdist.run(_all_reduce, cluster(n, algo), args=(shape, dtype, op, seed))
    ref = NP_REDUCE[op](np.stack([np_of(rank_data(r, shape, dtype, seed)) for r in range(n)]), axis=0)
    if dtype in (torch.int8, torch.uint8, torch.int32):
        ref = ref.astype(np.int64).astype(np_of(rank_data(0, shape, dtype, seed)).dtype)  # wraparound like C
    for r in range(n):
        assert_same(res.returns[r], ref)


def _avg():
    t = torch.arange(10, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t


@pytest.mark.parametrize("n", [1, 3, 4])
def test_all_reduce_avg(n):
    res = simdist.run(_avg, cluster(n))
    want = np.arange(10) * np.mean(np.arange(1, n + 1))
    for r in range(n):
        np.testing.assert_allclose(res.returns[r].numpy(), want)


def _broadcast(shape, dtype, root, seed):
    t = rank_data(dist.get_rank(), shape, dtype, seed)
    dist.broadcast(t, src=root)
    return t


@given(n=world, shape=shapes, dtype=dtypes, algo=st.sampled_from(["ring", "tree", "direct"]), data=st.data(), seed=st.integers(0, 9))
def test_broadcast(n, shape, dtype, algo, data, seed):
    root = data.draw(st.integers(0, n - 1))
    res = simdist.run(_broadcast, cluster(n, algo, "broadcast"), args=(shape, dtype, root, seed))
    for r in range(n):
        assert_same(res.returns[r], np_of(rank_data(root, shape, dtype, seed)))


def _reduce(shape, dtype, root, seed):
    t = rank_data(dist.get_rank(), shape, dtype, seed)
    dist.reduce(t, dst=root)
    return t


@given(n=world, shape=shapes, dtype=st.sampled_from([torch.float32, torch.int64]), algo=st.sampled_from(["ring", "tree", "direct"]), data=st.data(), seed=st.integers(0, 9))
def test_reduce(n, shape, dtype, algo, data, seed):
    root = data.draw(st.integers(0, n - 1))
    res = simdist.run(_reduce, cluster(n, algo, "reduce"), args=(shape, dtype, root, seed))
    total = np.sum([np_of(rank_data(r, shape, dtype, seed)) for r in range(n)], axis=0)
    assert_same(res.returns[root], total)
    for r in range(n):  # non-root inputs are left as they were
        if r != root:
            assert_same(res.returns[r], np_of(rank_data(r, shape, dtype, seed)))


def _all_gather(shape, dtype, seed, into_tensor):
    n = dist.get_world_size()
    t = rank_data(dist.get_rank(), shape, dtype, seed)
    if into_tensor:
        out = torch.zeros((n * shape[0],) + shape[1:], dtype=dtype)
        dist.all_gather_into_tensor(out, t)
        return out
    outs = [torch.zeros(shape, dtype=dtype) for _ in range(n)]
    dist.all_gather(outs, t)
    return torch.cat(outs)


@given(n=world, shape=shapes, dtype=dtypes, algo=st.sampled_from(["ring", "rhd", "direct"]), seed=st.integers(0, 9), into=st.booleans())
def test_all_gather(n, shape, dtype, algo, seed, into):
    res = simdist.run(_all_gather, cluster(n, algo, "all_gather"), args=(shape, dtype, seed, into))
    want = np.concatenate([np_of(rank_data(r, shape, dtype, seed)) for r in range(n)])
    for r in range(n):
        assert_same(res.returns[r], want)


def _reduce_scatter(shape, dtype, seed, as_tensor, op):
    n, rank = dist.get_world_size(), dist.get_rank()
    big = rank_data(rank, (n * shape[0],) + shape[1:], dtype, seed)
    out = torch.zeros(shape, dtype=dtype)
    if as_tensor:
        dist.reduce_scatter_tensor(out, big, op=OPS[op])
    else:
        dist.reduce_scatter(out, list(big.chunk(n)) if shape[0] else [torch.zeros(shape, dtype=dtype)] * n, op=OPS[op])
    return out, big


@given(n=world, shape=shapes, dtype=st.sampled_from([torch.float32, torch.float64, torch.int32]), algo=st.sampled_from(["ring", "rhd", "direct"]), seed=st.integers(0, 9), as_tensor=st.booleans(), op=st.sampled_from(["sum", "max"]))
def test_reduce_scatter(n, shape, dtype, algo, seed, as_tensor, op):
    res = simdist.run(_reduce_scatter, cluster(n, algo, "reduce_scatter"), args=(shape, dtype, seed, as_tensor, op))
    inputs = [np_of(rank_data(r, (n * shape[0],) + shape[1:], dtype, seed)) for r in range(n)]
    total = NP_REDUCE[op](np.stack(inputs), axis=0)
    for r in range(n):
        out, big = res.returns[r]
        assert_same(out, total[r * shape[0] : (r + 1) * shape[0]])
        assert_same(big, inputs[r])  # the input is not modified


def _all_to_all(rows, seed):
    n, rank = dist.get_world_size(), dist.get_rank()
    in_splits = rows[rank]
    out_splits = [rows[j][rank] for j in range(n)]
    inp = rank_data(rank, (sum(in_splits), 2), torch.float32, seed)
    out = torch.full((sum(out_splits), 2), -1.0)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    return out


@given(n=world, data=st.data(), seed=st.integers(0, 9))
def test_all_to_all_single(n, data, seed):
    rows = [[data.draw(st.integers(0, 3)) for _ in range(n)] for _ in range(n)]
    res = simdist.run(_all_to_all, cluster(n), args=(rows, seed))
    inputs = [rank_data(r, (sum(rows[r]), 2), torch.float32, seed).numpy() for r in range(n)]
    for j in range(n):
        blocks = []
        for r in range(n):
            start = sum(rows[r][:j])
            blocks.append(inputs[r][start : start + rows[r][j]])
        np.testing.assert_array_equal(res.returns[j].numpy(), np.concatenate(blocks))


def _gather_scatter(root, seed, algo_unused):
    n, rank = dist.get_world_size(), dist.get_rank()
    t = rank_data(rank, (3,), torch.int64, seed)
    gl = [torch.zeros(3, dtype=torch.int64) for _ in range(n)] if rank == root else None
    dist.gather(t, gl, dst=root)
    out = torch.zeros(3, dtype=torch.int64)
    sl = [torch.full((3,), 10 * j, dtype=torch.int64) for j in range(n)] if rank == root else None
    dist.scatter(out, sl, src=root)
    return (torch.stack(gl) if gl else None), out


@given(n=world, data=st.data(), seed=st.integers(0, 9), algo=st.sampled_from(["tree", "direct"]))
def test_gather_scatter(n, data, seed, algo):
    root = data.draw(st.integers(0, n - 1))
    c = simdist.Cluster.switch(n, bandwidth="10GB/s", latency="1us", device="cpu", algorithms={"gather": algo, "scatter": algo})
    res = simdist.run(_gather_scatter, c, args=(root, seed, algo))
    gathered, _ = res.returns[root]
    np.testing.assert_array_equal(gathered.numpy(), np.stack([rank_data(r, (3,), torch.int64, seed).numpy() for r in range(n)]))
    for r in range(n):
        np.testing.assert_array_equal(res.returns[r][1].numpy(), np.full(3, 10 * r))


def _non_contiguous():
    rank = dist.get_rank()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    dist.all_reduce(base.t())  # a transposed view covering its whole block of memory
    col = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    dist.broadcast(col[:, 1], src=0)  # a column: gloo (and simdist) write 3 contiguous elements from col[0, 1]
    return base, col


def test_non_contiguous_tensors_behave_as_on_gloo():
    with pytest.warns(UserWarning, match="not contiguous"):
        res = simdist.run(_non_contiguous, cluster(3))
    want = np.arange(12, dtype=np.float32).reshape(3, 4) * 6
    for r in range(3):
        base, col = res.returns[r]
        np.testing.assert_array_equal(base.numpy(), want)
        raw = (np.arange(12, dtype=np.float32) * (r + 1))
        raw[1:4] = np.arange(1, 4)  # rank 0's memory block from its element [0, 1]
        np.testing.assert_array_equal(col.numpy().reshape(-1), raw)


def _p2p_ring(shape):
    n, rank = dist.get_world_size(), dist.get_rank()
    send = torch.full(shape, float(rank))
    recv = torch.zeros(shape)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    a = torch.zeros(2)
    if rank == 0:
        dist.send(torch.tensor([5.0, 6.0]), dst=n - 1)
    elif rank == n - 1:
        dist.recv(a, src=0)
    return recv, a


@pytest.mark.parametrize("n", [2, 3, 5])
def test_point_to_point(n):
    res = simdist.run(_p2p_ring, cluster(n), args=((2, 3),))
    for r in range(n):
        recv, _ = res.returns[r]
        np.testing.assert_array_equal(recv.numpy(), np.full((2, 3), (r - 1) % n))
    np.testing.assert_array_equal(res.returns[n - 1][1].numpy(), [5.0, 6.0])


def _recv_any():
    rank = dist.get_rank()
    if rank == 0:
        got = []
        for _ in range(dist.get_world_size() - 1):
            t = torch.zeros(1)
            src = dist.recv(t)
            got.append((src, t.item()))
        return sorted(got)
    dist.send(torch.tensor([float(rank * 10)]), dst=0)
    return None


def test_recv_from_any_source():
    res = simdist.run(_recv_any, cluster(4))
    assert res.returns[0] == [(1, 10.0), (2, 20.0), (3, 30.0)]


def _subgroups():
    rank = dist.get_rank()
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    return t.item(), dist.get_rank(mine), dist.get_world_size(mine)


def test_new_group_subgroups():
    res = simdist.run(_subgroups, cluster(4))
    assert res.returns == [(2.0, 0, 2), (4.0, 0, 2), (2.0, 1, 2), (4.0, 1, 2)]


def _async_and_futures():
    t = torch.ones(4) * (dist.get_rank() + 1)
    w = dist.all_reduce(t, async_op=True)
    done_before = w.is_completed()
    fut = w.get_future()
    w.wait()
    return done_before, w.is_completed(), fut.done(), fut.value()[0].tolist()


def test_async_work_future_and_is_completed():
    res = simdist.run(_async_and_futures, cluster(2))
    for r in range(2):
        before, after, fut_done, value = res.returns[r]
        assert (before, after, fut_done) == (False, True, True)
        assert value == [3.0] * 4


BARRIER_ALGORITHMS = ["ring", "tree", "rhd", "direct"]


def _barrier_times():
    """One barrier per algorithm, rank 0 arriving 1 ms after the others: (arrival, departure) of each."""
    out = []
    for algo in BARRIER_ALGORITHMS:
        simdist.set_algorithms(barrier=algo)
        if dist.get_rank() == 0:
            simdist.charge(1e-3)
        arrived = simdist.now()
        dist.barrier()
        out.append((arrived, simdist.now()))
    return out


def test_barrier_waits_for_the_slowest_rank_then_takes_a_one_element_all_reduce():
    n, lat, bw = 8, 2e-6, 100e9
    res = simdist.run(_barrier_times, simdist.Cluster.switch(n, bandwidth=bw, latency=lat, device="cpu"))
    used = [s.args["algorithm"] for s in res.trace.collectives(0) if s.args["Collective name"] == "barrier"]
    assert used == BARRIER_ALGORITHMS
    for i, algo in enumerate(BARRIER_ALGORITHMS):
        last = max(times[i][0] for times in res.returns)
        assert last == res.returns[0][i][0]  # rank 0 is the last to arrive
        assert all(times[i][1] >= last for times in res.returns)  # nobody leaves before it
        # a barrier is an all-reduce of one float32; through the switch a message crosses two links. The
        # latency terms must match exactly; the byte terms within 2n element times (a piece of the buffer
        # is at least one element, and direct's concurrent messages share links)
        want = alpha_beta.all_reduce_seconds(algo, n, 4, alpha=2 * lat, beta=1 / bw)
        assert max(times[i][1] for times in res.returns) - last == pytest.approx(want, abs=2 * n * 4 / bw), algo


def _future_waits():
    t = torch.ones(3) * (dist.get_rank() + 1)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    first = fut.wait()[0].tolist()  # torch's Future.wait() would block the OS thread; here it waits in simulated time
    return first, doubled.wait().tolist(), torch.futures.wait_all([fut])[0][0].tolist()


def test_future_wait_and_then_block_in_simulated_time():
    res = simdist.run(_future_waits, cluster(3))
    for r in range(3):
        assert res.returns[r] == ([6.0] * 3, [12.0] * 3, [6.0] * 3)
