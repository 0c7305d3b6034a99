"""Reductions presented as gloo add in gloo's order at every world size; presented as NCCL, in the order of
the ring NCCL documents. Oracles: gloo's ring loops transcribed (tests/gloo_ring.py), NCCL's ring kernel's
order written out, and real gloo processes."""

from __future__ import annotations

import gloo_numerics_fns as fns
import gloo_ring
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import real
import simdist
from simdist.algorithms import reduce_op, split_offsets
from simdist.algorithms.gloo_order import Span, all_reduce_block, reduce_block, ring_reduce
from simdist.comm.ordering import reduces_as_gloo


def same(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    """Bit for bit, a NaN matching a NaN in the same place (its payload is the machine's, not the order's)."""
    if got is None or want is None:
        return got is want
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.is_complex():
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    nan = torch.isnan(got)
    if not torch.equal(nan, torch.isnan(want)):
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    g, w = got.contiguous().view(bits), want.contiguous().view(bits)
    return torch.equal(torch.where(nan, 0, g), torch.where(nan, 0, w))


def same_all(got: object, want: object) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same_all, got, want))
    return same(got, want)  # type: ignore[arg-type]


def expected(case: tuple, n: int) -> list:
    """What each rank holds after ``case`` on ``n`` ranks, by gloo's loops as ProcessGroupGloo runs them."""
    coll, op = case[0], case[3]
    ins = [fns.inputs(case, r, n) for r in range(n)]
    if coll == "all_reduce":
        return [gloo_ring.all_reduce([i[0] for i in ins], op)] * n
    if coll == "reduce":
        root = case[4] % n
        got = gloo_ring.reduce([i[0] for i in ins], root, op)
        return [got if r == root else None for r in range(n)]
    if coll == "reduce_scatter_tensor":
        return gloo_ring.reduce_scatter_tensor([i[0] for i in ins], op)
    if coll == "reduce_scatter":
        return gloo_ring.reduce_scatter([list(i[0].chunk(n)) for i in ins], op)
    if coll == "all_reduce_coalesced":  # ProcessGroupGloo flattens the tensors into one all-reduce
        flat = gloo_ring.all_reduce([torch.cat(i) for i in ins], op)
        sizes = [t.numel() for t in ins[0]]
        return [list(flat.split(sizes))] * n
    per_tensor = [gloo_ring.reduce_scatter_tensor([i[k] for i in ins], op) for k in range(len(ins[0]))]
    return [[chunks[r] for chunks in per_tensor] for r in range(n)]


def _cases(data: st.DataObject, seed: int) -> list[tuple]:
    dtype = data.draw(st.sampled_from(sorted(fns.DTYPES)), label="dtype")
    ops = ["sum", "avg"] if dtype == "complex64" else sorted(fns.OPS)
    op = data.draw(st.sampled_from(ops), label="op")
    numel = data.draw(st.integers(0, 40) | st.integers(41, 3000), label="numel")
    return [(coll, dtype, numel, op, seed + k) for k, coll in enumerate(fns.COLLECTIVES)]


# ------------------------------------------------------------------ the closed form against gloo's loops
@given(n=st.integers(2, 9), numel=st.integers(1, 2000), seed=st.integers(0, 1 << 20), data=st.data())
def test_ring_reduce_adds_each_element_as_gloos_ring_loops_do(n: int, numel: int, seed: int, data) -> None:
    dtype = data.draw(st.sampled_from(["float32", "float16", "bfloat16", "float64"]))
    op = data.draw(st.sampled_from(sorted(fns.OPS)))
    xs = [fns.values(seed, r, numel, dtype, op) for r in range(n)]
    rows = torch.stack(xs)
    step = reduce_op(op).gloo_step
    block = all_reduce_block(n, numel, xs[0].element_size())
    want = gloo_ring.ring_all_reduce(xs, op)
    assert all(same(w, want[0]) for w in want)  # the loops leave every rank the same result
    assert same(ring_reduce(rows, Span(0, numel, 0, block), step), want[0])
    lo = data.draw(st.integers(0, numel))
    hi = data.draw(st.integers(lo, numel))
    assert same(ring_reduce(rows, Span(lo, hi, lo, block), step), want[0][lo:hi])  # any part of the buffer
    root = data.draw(st.integers(0, n - 1))
    whole = Span(0, numel, 0, reduce_block(n, numel, xs[0].element_size()))
    assert same(ring_reduce(rows, whole, step), gloo_ring.ring_reduce(xs, root, op))


@pytest.mark.parametrize(
    ("n", "numel", "dtype"),
    [
        (3, 1_600_003, "float32"),
        (2, 1_200_001, "float32"),
        (3, 3_000_001, "float16"),
        (5, 700_001, "float64"),
    ],
)
def test_buffers_past_gloos_1_mib_segments_add_in_its_order(n: int, numel: int, dtype: str) -> None:
    """Large buffers cut into more than two segments per rank (all-reduce) or segments capped at 1 MiB (reduce)."""
    xs = [fns.values(7, r, numel, dtype, "sum") for r in range(n)]
    rows, step = torch.stack(xs), reduce_op("sum").gloo_step
    for block, want in (
        (all_reduce_block(n, numel, xs[0].element_size()), gloo_ring.ring_all_reduce(xs, "sum")[0]),
        (reduce_block(n, numel, xs[0].element_size()), gloo_ring.ring_reduce(xs, 1, "sum")),
    ):
        assert same(ring_reduce(rows, Span(0, numel, 0, block), step), want)


# ------------------------------------------------------------------ simulated runs
ALGORITHMS = ["auto", "ring", "tree", "rhd", "direct"]


def _cluster(n: int, algorithm: str) -> simdist.Cluster:
    """A switch whose all-reduce, reduce and reduce-scatter run ``algorithm`` where they have it."""
    chosen = {
        c: algorithm
        for c in ("all_reduce", "reduce", "reduce_scatter")
        if algorithm in simdist.algorithms.names(c)
    }
    return simdist.Cluster.switch(n, device="cpu", algorithms=chosen)


@given(n=st.integers(2, 8), seed=st.integers(0, 1 << 20), data=st.data())
def test_simulated_reductions_presented_as_gloo_add_in_gloos_order(n: int, seed: int, data) -> None:
    """Every reducing collective, whatever algorithm times it, under the names whose results follow gloo."""
    cases = _cases(data, seed)
    algorithm = data.draw(st.sampled_from(ALGORITHMS), label="algorithm")
    name = data.draw(st.sampled_from(["gloo", "simdist"]), label="backend_name")
    res = simdist.run(fns.reductions, _cluster(n, algorithm), args=(cases,), backend_name=name)
    for i, case in enumerate(cases):
        want = expected(case, n)
        for r in range(n):
            assert same_all(res.returns[r][i], want[r]), f"{case} on rank {r} of {n} ({algorithm})"


def _nccl_ring(inputs: list[torch.Tensor], offsets: list[int], chunk_of: list[int]) -> torch.Tensor:
    """NCCL's ring kernel (``runRing`` of all_reduce.h / reduce_scatter.h) on a ring 0 -> 1 -> ... -> n-1 -> 0:
    the chunk a rank ends with starts at the next rank, which sends it on, each rank adding its own value to
    what arrives, until it reaches the rank it belongs to. ``chunk_of[c]`` is the rank chunk c ends at."""
    n = len(inputs)
    out = torch.empty_like(inputs[0])
    for c in range(n):
        lo, hi = offsets[c], offsets[c + 1]
        end = chunk_of[c]
        acc = inputs[(end + 1) % n][lo:hi].clone()
        for k in range(2, n + 1):
            acc = acc + inputs[(end + k) % n][lo:hi]
        out[lo:hi] = acc
    return out


def _nccl_run(n: int, numel: int, seed: int) -> list:
    def cases(dtype: str) -> list[tuple]:
        return [
            ("all_reduce", dtype, numel, "sum", seed),
            ("reduce_scatter_tensor", dtype, numel, "sum", seed + 1),
        ]

    res = simdist.run(
        fns.reductions, _cluster(n, "ring"), args=(cases("float32") + cases("bfloat16"),), backend_name="nccl"
    )
    return res.returns


@given(n=st.integers(3, 8), numel=st.integers(1, 300), seed=st.integers(0, 1 << 20))
def test_presented_as_nccl_the_ring_adds_as_nccls_ring_kernel(n: int, numel: int, seed: int) -> None:
    """simdist's ring all-reduce and reduce-scatter, presented as NCCL, add as NCCL's ring does on a ring in
    rank order: chunk c starts at rank c+1 and ends at rank c (the all-reduce's chunk boundaries are simdist's)."""
    got = _nccl_run(n, numel, seed)
    for k, dtype in enumerate(("float32", "bfloat16")):
        xs = [fns.values(seed, r, numel, dtype, "sum") for r in range(n)]
        want = _nccl_ring(xs, split_offsets(numel, n), list(range(n)))
        ins = [fns.values(seed + 1, r, numel * n, dtype, "sum") for r in range(n)]
        scattered = _nccl_ring(ins, [c * numel for c in range(n + 1)], list(range(n))).chunk(n)
        for r in range(n):
            assert same(got[r][2 * k], want), f"all_reduce {dtype} rank {r}"
            assert same(got[r][2 * k + 1], scattered[r]), f"reduce_scatter_tensor {dtype} rank {r}"


def test_presented_as_nccl_results_are_not_gloos() -> None:
    """The NCCL order is not gloo's (the test above is not gloo's order under another name)."""
    xs = [fns.values(3, r, 64, "float32", "sum") for r in range(5)]
    assert not same(_nccl_ring(xs, split_offsets(64, 5), list(range(5))), gloo_ring.all_reduce(xs, "sum"))


def _mixed_groups(case: tuple) -> tuple:
    gloo_group = dist.new_group(backend="gloo")
    t = fns.inputs(case, dist.get_rank(), dist.get_world_size())[0]
    u = t.clone()
    dist.all_reduce(t)  # the default group, presented as nccl
    dist.all_reduce(u, group=gloo_group)
    return t, u


def test_a_gloo_group_in_a_run_presenting_nccl_adds_in_gloos_order() -> None:
    n, case = 4, ("all_reduce", "float32", 64, "sum", 11)
    res = simdist.run(_mixed_groups, _cluster(n, "ring"), args=(case,), backend_name="nccl")
    xs = [fns.inputs(case, r, n)[0] for r in range(n)]
    for t, u in res.returns:
        assert same(t, _nccl_ring(xs, split_offsets(64, n), list(range(n))))
        assert same(u, gloo_ring.all_reduce(xs, "sum"))


@pytest.mark.parametrize(
    ("name", "device", "gloo"),
    [("gloo", "cpu", True), ("simdist", "cpu", True), ("simdist", "cuda", True), ("nccl", "cpu", False),
     ("nccl", "cuda", False), ("cpu:gloo,cuda:nccl", "cpu", True), ("cpu:gloo,cuda:nccl", "cuda", False),
     ("cuda:nccl", "cuda", False)],
)  # fmt: skip
def test_whose_order_a_presented_name_follows(name: str, device: str, gloo: bool) -> None:
    assert reduces_as_gloo(name, device) is gloo


# ------------------------------------------------------------------ real gloo processes
def _real_cases(n: int) -> list[tuple]:
    """A few of every collective, type and op; sizes around gloo's segment boundaries, one of 70,000 and, on
    3 ranks, buffers of more than 1 MiB per segment."""
    cases, seed = [], 100 * n
    for k, coll in enumerate(fns.COLLECTIVES):
        for dtype, op, numel in (
            ("float32", "sum", 7 + k),
            ("float16", "avg", 2 * n + 1),
            ("bfloat16", "sum", 1000),
            ("float32", ["min", "max"][k % 2], 33),
            ("float64", "product", 5),
            ("complex64", "avg", 9),
        ):
            cases.append((coll, dtype, numel, op, seed))
            seed += 2
    cases.append(("all_reduce", "float32", 70_000, "sum", seed))
    cases.append(("reduce", "float32", 70_000, "sum", seed + 2))
    if n == 3:  # past gloo's 1 MiB segments: more segments than two per rank, the reduce's capped at 1 MiB
        cases.append(("all_reduce", "float32", 1_600_003, "sum", seed + 4))
        cases.append(("reduce", "float32", 1_600_003, "sum", seed + 6))
    return cases


#: the world sizes compared with real gloo: groups of the first 3, 4 and 5 ranks of one launch of 8 processes,
#: and its whole world (fns.on_groups: gloo runs a group's collectives as a world's of its size)
REAL_SIZES = (3, 4, 5, 8)
#: the seeds of the sparse all-reduces, on every size
SPARSE_SEEDS = list(range(6))
#: training rides on the whole world of the launch
TRAINED = 8


@pytest.fixture(scope="module")
def on_real_gloo(session_results) -> dict[int, list]:
    """Each rank's results for each size, from one launch of real gloo processes: results[n][r] on rank r of n."""

    def launch() -> dict[int, list]:
        cases = {n: _real_cases(n) for n in REAL_SIZES}
        got = real.run(
            fns.on_groups, nproc=max(REAL_SIZES), backend="gloo", args=(cases, SPARSE_SEEDS)
        ).returns
        return {n: [got[r][n] for r in range(n)] for n in REAL_SIZES}

    return session_results.get("gloo-numerics", launch)


def _simulated(n: int, name: str) -> list:
    trained = n == TRAINED and name == "gloo"  # the simdist name takes the same path: the cases show it
    run = simdist.run(
        fns.on_groups,
        simdist.Cluster.switch(n, device="cpu"),
        args=({n: _real_cases(n)}, SPARSE_SEEDS, trained),
        backend_name=name,
    )
    return [out[n] for out in run.returns]


@pytest.mark.real
@pytest.mark.parametrize("name", ["gloo", "simdist"])
@pytest.mark.parametrize("n", REAL_SIZES)
def test_simulated_reductions_equal_real_gloo_bit_for_bit(on_real_gloo: dict, n: int, name: str) -> None:
    cases, got = _real_cases(n), on_real_gloo[n]
    sim = _simulated(n, name)
    for r in range(n):
        for i, case in enumerate(cases):
            assert same_all(sim[r][0][i], got[r][0][i]), f"{name}: {case} on rank {r} of {n}"
        for i in range(len(SPARSE_SEEDS)):
            assert same(sim[r][1][i], got[r][1][i]), f"{name}: sparse all_reduce {i} on rank {r}"
        # torch's DDP, FSDP2 and FSDP2 over TP train the same parameters, bit for bit
        if sim[r][2] is not None:
            for wrap, params in got[r][2].items():
                for k, v in params.items():
                    assert same(sim[r][2][wrap][k], v), f"{name}: {wrap} {k} on rank {r}"


@pytest.mark.real
@pytest.mark.parametrize("n", REAL_SIZES)
def test_the_ring_loops_the_simulated_tests_use_are_what_gloo_computes(on_real_gloo: dict, n: int) -> None:
    got = on_real_gloo[n]
    for i, case in enumerate(_real_cases(n)):
        want = expected(case, n)
        assert all(same_all(got[r][0][i], want[r]) for r in range(n)), f"gloo_ring: {case} on {n} ranks"
