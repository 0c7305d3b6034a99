"""Collectives' messages on lanes (simdist.comm.lane, simdist.comm.deferred) against the same runs with every
message a simpy event: the same data bit for bit, simulated times, message counts and trace hash."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist import Perturbation
from simdist.comm import batched, deferred, lane
from simdist.faults import SlowLink

COLLECTIVES = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
]
ALGORITHMS = {
    "all_reduce": ["ring", "tree", "rhd", "direct"],
    "reduce_scatter": ["ring", "rhd", "direct"],
    "all_gather": ["ring", "rhd", "direct"],
    "broadcast": ["ring", "tree", "direct"],
    "reduce": ["ring", "tree", "direct"],
    "gather": ["tree", "direct"],
    "scatter": ["tree", "direct"],
    "all_to_all": ["direct"],
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64]


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rank ``rank``'s input: values whose sums depend on the order they are added in (for float types)."""
    g = torch.Generator().manual_seed(salt * 7919 + rank)
    kw = {"generator": g, "device": "cpu"}
    t = torch.randn(numel, dtype=torch.float64, **kw) * 10.0 ** torch.randint(-3, 4, (numel,), **kw)
    return (t if dtype.is_floating_point else t.round()).to(dtype)


def _program(
    coll: str,
    numel: int,
    dtype: torch.dtype,
    op: str,
    salt: int,
    subgroups: bool,
    race: bool,
    dev: str = "cpu",
) -> list:
    """Two of ``coll`` in flight at once (on the world, or on two overlapping subgroups, whose messages then
    share links), a point-to-point exchange beside them, and optionally a write into a buffer in flight; every
    tensor on device ``dev``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = [None, None]
    if subgroups:
        groups = [dist.new_group(list(range(n))), dist.new_group(list(range(n - 1, -1, -1)))]
    outs, works = [], []
    for i, group in enumerate(groups):
        size = dist.get_world_size(group)
        x = _data(rank, numel, dtype, salt + i).to(dev)
        reduce_op = getattr(dist.ReduceOp, op.upper())
        if coll == "all_reduce":
            works.append(dist.all_reduce(x, reduce_op, group=group, async_op=True))
            outs.append(x)
        elif coll == "reduce_scatter":
            big = torch.cat([x] * size)
            out = torch.empty(numel, dtype=dtype, device=dev)
            works.append(dist.reduce_scatter_tensor(out, big, reduce_op, group=group, async_op=True))
            outs += [out, big]
        elif coll == "all_gather":
            out = torch.empty(numel * size, dtype=dtype, device=dev)
            works.append(dist.all_gather_into_tensor(out, x, group=group, async_op=True))
            outs.append(out)
        elif coll == "broadcast":
            works.append(dist.broadcast(x, src=n - 1 - i, group=group, async_op=True))
            outs.append(x)
        elif coll == "reduce":
            works.append(dist.reduce(x, dst=i, op=reduce_op, group=group, async_op=True))
            outs.append(x)
        elif coll == "all_to_all":
            big = torch.cat([x] * size)
            out = torch.empty_like(big)
            works.append(dist.all_to_all_single(out, big, group=group, async_op=True))
            outs.append(out)
        elif coll == "gather":
            root = dist.get_global_rank(group, 0) if group is not None else 0
            lst = [torch.empty(numel, dtype=dtype, device=dev) for _ in range(size)] if rank == root else None
            works.append(dist.gather(x, lst, dst=root, group=group, async_op=True))
            outs += lst or []
        else:
            root = dist.get_global_rank(group, 0) if group is not None else 0
            lst = [_data(r, numel, dtype, salt + 99).to(dev) for r in range(size)] if rank == root else None
            out = torch.empty(numel, dtype=dtype, device=dev)
            works.append(dist.scatter(out, lst, src=root, group=group, async_op=True))
            outs.append(out)
    if race and coll == "all_reduce":
        outs[0].mul_(2)  # a race: what the messages still to leave take
    peer = torch.full((3,), float(rank), device=dev)
    if rank % 2 == 0 and rank + 1 < n:
        dist.send(peer, rank + 1)
    elif rank % 2 == 1:
        dist.recv(peer, rank - 1)
    for w in works:
        w.wait()
    return [o.cpu() for o in outs] + [peer.cpu()]


def _run(
    enabled: bool, fn: object, cluster: simdist.Cluster, arrays: bool = False, **kwargs: object
) -> simdist.RunResult:
    """``fn`` run with lanes ``enabled`` or not, and schedules in arrays (simdist.comm.batched) where they fit
    when ``arrays`` (test_batched.py); every message traced."""
    old = lane.ENABLED, batched.ENABLED
    lane.ENABLED, batched.ENABLED = enabled, arrays
    try:
        return simdist.run(fn, cluster, trace="messages", **kwargs)
    finally:
        lane.ENABLED, batched.ENABLED = old


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _race_text(race: object) -> str:
    """A race as reported, less the buffer's address (another allocation in each run)."""
    return re.sub(r"0x[0-9a-f]+", "0x?", str(race))


def assert_same_run(
    fn: object, cluster: simdist.Cluster, arrays: bool = False, **kwargs: object
) -> simdist.RunResult:
    """Run ``fn`` through simpy's messages and on lanes (with schedules in arrays where they fit when
    ``arrays``); everything observable must match."""
    ref = _run(False, fn, cluster, **kwargs)
    got = _run(True, fn, cluster, arrays, **kwargs)
    assert got.sim_time == ref.sim_time
    assert got.messages == ref.messages
    for r, (want, have) in enumerate(zip(ref.returns, got.returns)):
        assert all(_same_bits(w, h) for w, h in zip(want, have)), f"rank {r}'s results differ"
    assert got.memory == ref.memory  # buffers freed when they were (none kept alive by the lanes)
    assert [_race_text(r) for r in got.races] == [_race_text(r) for r in ref.races]
    assert got.trace.hash() == ref.trace.hash()
    return got


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    coll = draw(st.sampled_from(COLLECTIVES))
    algo = draw(st.sampled_from(ALGORITHMS[coll]))
    n = draw(st.integers(2, 6))
    shape = draw(st.sampled_from(["ring", "switch", "two_level"]))
    backend = draw(st.sampled_from(["gloo", "nccl"]))  # results put in gloo's order, or the schedule's own
    device = "H100" if backend == "nccl" else draw(st.sampled_from(["cpu", "H100"]))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(["sum", "max"] + (["avg"] if dtype.is_floating_point else [])))
    numel, subgroups, race = draw(st.integers(1, 40)), draw(st.booleans()), draw(st.booleans())
    return coll, algo, n, shape, device, backend, dtype, op, numel, subgroups, race


def _cluster(shape: str, n: int, device: str, coll: str, algo: str) -> simdist.Cluster:
    algos = {coll: algo}
    if shape == "ring":
        return simdist.Cluster.ring(n, device=device, algorithms=algos)
    if shape == "switch":
        return simdist.Cluster.switch(n, bandwidth="10GB/s", latency="3us", device=device, algorithms=algos)
    return simdist.Cluster.two_level(max(1, n // 2), 2, device=device, algorithms=algos)


@given(cases(), st.integers(0, 3), st.booleans())
@settings(max_examples=20, deadline=None)
def test_lanes_change_nothing(case: tuple, salt: int, levels: bool) -> None:
    coll, algo, n, shape, device, backend, dtype, op, numel, subgroups, race = case
    cluster = _cluster(shape, n, device, coll, algo)
    old = deferred.BATCH_MIN_OPS
    deferred.BATCH_MIN_OPS = 1 if levels else old  # apply every burst in levels, or small ones one by one
    try:
        args = (coll, numel, dtype, op, salt, subgroups, race, "cuda" if backend == "nccl" else "cpu")
        assert_same_run(_program, cluster, args=args, races="off", backend_name=backend, memory=True)
    finally:
        deferred.BATCH_MIN_OPS = old


def _ring_all_reduce(numel: int, dev: str) -> list[torch.Tensor]:
    x = _data(dist.get_rank(), numel, torch.float32, 5).to(dev)
    dist.all_reduce(x)
    return [x.cpu()]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_large_ring_applies_in_levels(backend: str) -> None:
    """A 48-rank ring all-reduce: bursts of thousands of operations, applied in levels (the result put in
    gloo's order, or left in the ring's own)."""
    cluster = simdist.Cluster.ring(48, device="H100", algorithms={"all_reduce": "ring"})
    calls = []
    real = deferred.DeferredData._apply
    deferred.DeferredData._apply = lambda self, *a: (calls.append(len(a[0])), real(self, *a))[1]  # type: ignore[method-assign]
    try:
        dev = "cuda" if backend == "nccl" else "cpu"
        got = assert_same_run(_ring_all_reduce, cluster, args=(1000, dev), backend_name=backend)
    finally:
        deferred.DeferredData._apply = real  # type: ignore[method-assign]
    assert max(calls) // 5 > 48 * 47, calls  # most of the 2 x 48 x 47 messages' operations in one burst
    ref = sum(_data(r, 1000, torch.float32, 5).double() for r in range(48))
    assert torch.allclose(got.returns[0][0].double(), ref, rtol=1e-5, atol=1e-3)


def _count_lanes(monkeypatch: pytest.MonkeyPatch) -> list:
    made: list = []
    real = lane.Lane.__init__

    def counting(self: lane.Lane, *a: object, **k: object) -> None:
        made.append(self)
        real(self, *a, **k)

    monkeypatch.setattr(lane.Lane, "__init__", counting)
    return made


def test_lanes_refused_under_perturbation_and_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exploration decides ties itself and faults time messages their own way: their messages go through simpy
    (and the run is the one it was)."""
    made = _count_lanes(monkeypatch)
    cluster = simdist.Cluster.ring(4, device="cpu")
    args = ("all_reduce", 10, torch.float32, "sum", 0, True, False)
    simdist.run(_program, cluster, args=args)
    assert made, "a plain run queues its collectives' messages on lanes"
    made.clear()
    perturbed = assert_same_run(
        _program, cluster, args=args, perturbation=Perturbation(ties="random", latency=0.5)
    )
    assert not made
    slow = assert_same_run(_program, cluster, args=args, faults=[SlowLink(link=0, bandwidth_factor=0.5)])
    assert not made
    plain = _run(True, _program, cluster, args=args)
    assert slow.sim_time > plain.sim_time and perturbed.trace.hash() != plain.trace.hash()


def test_race_detector_sees_the_same_races() -> None:
    """The detector watches rank code, which never runs inside a lane's burst: the races it reports, and the
    values the racing access leaves, are those of the simpy messages."""
    cluster = simdist.Cluster.ring(6, device="cpu", algorithms={"all_reduce": "ring"})
    args = ("all_reduce", 30, torch.float32, "sum", 1, True, True)
    with pytest.warns(UserWarning):
        got = assert_same_run(_program, cluster, args=args, races="warn")
    assert got.races


def _polling(numel: int) -> list[torch.Tensor]:
    """Rank 0 computes a while, then polls its all-reduce: each poll moves it on to the next time something is
    due, a lane's messages included."""
    rank = dist.get_rank()
    x = _data(rank, numel, torch.float32, 3)
    if rank == 0:
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    work = dist.all_reduce(x, async_op=True)
    polls = 0
    while not work.is_completed():
        polls += 1
    return [x, torch.tensor([polls])]


def test_polling_sees_the_lanes_messages() -> None:
    cluster = simdist.Cluster.ring(5, device="H100", latency="40us", algorithms={"all_reduce": "ring"})
    got = assert_same_run(_polling, cluster, args=(20,))
    assert int(got.returns[0][1]) > 1  # the poller stepped through the messages' times


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather"])
def test_gloo_model_reductions_on_lanes(coll: str) -> None:
    """Under gloo's model each reduce message waits for its receiver's earlier additions, and each rank copies
    before and after: those waits queue on the lane too, in simpy's order."""
    cluster = simdist.Cluster.two_level(2, 3, device="cpu", collective_model="gloo")
    cluster.local_bandwidth = 2e9
    got = assert_same_run(_program, cluster, args=(coll, 33, torch.float32, "sum", 2, True, False))
    assert got.sim_time > 0


def test_bursts_of_large_slices_are_copied_slice_by_slice() -> None:
    """Levels gather and scatter element by element: a burst whose operations move hundreds of elements each is
    replayed one slice at a time instead (same data), which is the cheaper of the two there."""
    cluster = simdist.Cluster.ring(48, device="H100", algorithms={"all_reduce": "ring"})
    calls = []
    real = deferred.DeferredData._apply
    deferred.DeferredData._apply = lambda self, *a: (calls.append(len(a[0])), real(self, *a))[1]  # type: ignore[method-assign]
    try:
        n = 48 * 4 * deferred.BATCH_MAX_MEAN_ELEMENTS  # four times the threshold per ring chunk
        got = assert_same_run(_ring_all_reduce, cluster, args=(n, "cpu"), backend_name="gloo")
    finally:
        deferred.DeferredData._apply = real  # type: ignore[method-assign]
    assert calls == []
    ref = sum(_data(r, n, torch.float32, 5).double() for r in range(48))
    assert torch.allclose(got.returns[0][0].double(), ref, rtol=1e-5, atol=1e-3)
