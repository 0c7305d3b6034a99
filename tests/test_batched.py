"""Schedules run in arrays (simdist.comm.batched) against the same runs with every message a simpy event: the same
data bit for bit, simulated times, message counts, memory statistics and trace hash."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import types
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from test_lane import _cluster, _data, _polling, _program, _ring_all_reduce, assert_same_run, cases

import simdist
from simdist.algorithms import ring
from simdist.algorithms.schedule import msg, split_offsets
from simdist.comm import batched, lockstep
from simdist.network.routing import Router


@pytest.fixture
def every_schedule_batched(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every schedule that can run batched does (see :func:`_batch_every_schedule`)."""
    return _batch_every_schedule(monkeypatch)


def _batch_every_schedule(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every schedule that can run batched does (not only large ones); for each that did, whether it moved data
    (the runs themselves are not kept: they hold the buffers, which the memory statistics count)."""
    made: list = []
    real = batched.make

    def counting(run: object, msgs: object) -> object:
        got = real(run, msgs)  # type: ignore[arg-type]
        if got is not None:
            made.append(got.memory is not None)
        return got

    monkeypatch.setattr(batched, "MIN_MESSAGES", 1)
    monkeypatch.setattr(batched, "make", counting)
    return made


@given(cases(), st.integers(0, 3))
@settings(max_examples=25, deadline=None)
def test_batched_runs_change_nothing(case: tuple, salt: int) -> None:
    """Two collectives in flight (sharing links on overlapping groups), point-to-point traffic beside them and a
    buffer written in flight: every algorithm, dtype, reduce op and cluster shape, in gloo's order or the
    schedule's own."""
    with pytest.MonkeyPatch.context() as mp:
        made = _batch_every_schedule(mp)
        coll, algo, n, shape, device, backend, dtype, op, numel, subgroups, race = case
        cluster = _cluster(shape, n, device, coll, algo)
        args = (coll, numel, dtype, op, salt, subgroups, race, "cuda" if backend == "nccl" else "cpu")
        assert_same_run(_program, cluster, True, args=args, races="off", backend_name=backend, memory=True)
        # a case none of whose schedules can run batched (gloo's model: reductions on the rank's thread) tells
        # nothing: drawn again; were none batched at all, hypothesis would fail the test for filtering too much
        assume(made)


@given(
    coll=st.sampled_from(["all_reduce", "reduce_scatter"]),
    n=st.sampled_from([4, 5, 7, 8, 16]),
    numel=st.sampled_from([1, 5, 33, 289, 70_001]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    op=st.sampled_from(["sum", "avg"]),
    subgroups=st.booleans(),
    salt=st.integers(0, 3),
)
@example(coll="all_reduce", n=5, numel=70_001, dtype=torch.float32, op="sum", subgroups=False, salt=0)
@settings(max_examples=12, deadline=None)
def test_halving_doubling_in_gloos_order_runs_batched(
    coll: str, n: int, numel: int, dtype: torch.dtype, op: str, subgroups: bool, salt: int
) -> None:
    """Halving-doubling's reductions take nested element ranges (halves, then quarters, ...), which gloo's order tracks
    by the segments between their bounds (70,001 elements: numbered without a table): the same run as one message
    at a time, bit for bit."""
    with pytest.MonkeyPatch.context() as mp:
        made = _batch_every_schedule(mp)
        cluster = _cluster("switch", n, "cpu", coll, "rhd")
        args = (coll, numel, dtype, op, salt, subgroups, False, "cpu")
        assert_same_run(_program, cluster, True, args=args, races="off", backend_name="gloo", memory=True)
        assert made


@given(cases(), st.integers(0, 3))
@example(("reduce_scatter", "rhd", 5, "switch", "cpu", "gloo", torch.float32, "sum", 33, False, False), 0)
@settings(max_examples=12, deadline=None)
def test_rows_read_by_element_indices_change_nothing(case: tuple, salt: int) -> None:
    """Where NumPy would refuse a window over the memory (:class:`batched._Rows`; here forced for every window,
    gloo's result rows included): the same run as one message at a time, bit for bit."""
    with pytest.MonkeyPatch.context() as mp:
        made = _batch_every_schedule(mp)
        mp.setattr(batched, "_MAX_VIEW_BYTES", 0)
        coll, algo, n, shape, device, backend, dtype, op, numel, subgroups, race = case
        cluster = _cluster(shape, n, device, coll, algo)
        args = (coll, numel, dtype, op, salt, subgroups, race, "cuda" if backend == "nccl" else "cpu")
        assert_same_run(_program, cluster, True, args=args, races="off", backend_name=backend, memory=True)
        assume(made)


#: where the buffers of the test below are asked for: 64 TiB apart (x86-64's user space spans 128 TiB)
_FAR = (0x1000_0000_0000, 0x5000_0000_0000)
_FAR_NUMEL = 1 << 20
#: the ranks' buffers (as the ranks' own: a run gives each rank a copy of a tensor passed in its arguments)
_FAR_BUFFERS: list[torch.Tensor] = []


def _all_reduce_into() -> list[torch.Tensor]:
    t = _FAR_BUFFERS[dist.get_rank()]
    t.copy_(_data(dist.get_rank(), _FAR_NUMEL, torch.float32, 3))
    dist.all_reduce(t)
    return [t.clone()]


@pytest.mark.skipif(sys.platform != "linux", reason="maps memory at chosen addresses through Linux's mmap")
def test_buffers_far_apart_in_memory_run_batched(every_schedule_batched: list) -> None:
    """Ranks' buffers 64 TiB apart (one mapped high, as a large allocation can be, the others in the heap): a window
    of chunks over the memory spanning them would be larger than NumPy allows (it raised "array is too big" from
    within the simulator); the rows are read by element indices instead, with the result of the messages one by
    one and of NumPy's sum."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.munmap.restype = ctypes.c_void_p, ctypes.c_int
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    nbytes = _FAR_NUMEL * 4
    mapped = []
    for hint in _FAR:
        addr = libc.mmap(
            hint, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
        )
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        mapped.append(addr)
    if mapped[1] - mapped[0] < 1 << 45:  # the kernel places a mapping elsewhere where the address is taken
        for addr in mapped:
            libc.munmap(addr, nbytes)
        pytest.skip(
            f"the kernel mapped the buffers at {hex(mapped[0])} and {hex(mapped[1])}, not 64 TiB apart"
        )
    high = [torch.frombuffer((ctypes.c_byte * nbytes).from_address(a), dtype=torch.float32) for a in mapped]
    _FAR_BUFFERS[:] = [high[0], torch.empty(_FAR_NUMEL), high[1], torch.empty(_FAR_NUMEL)]
    span = max(b.data_ptr() for b in _FAR_BUFFERS) + nbytes - min(b.data_ptr() for b in _FAR_BUFFERS)
    assert span // 4 * (_FAR_NUMEL // 4) * 4 > batched._MAX_VIEW_BYTES  # a ring chunk's window: too large
    cluster = simdist.Cluster.ring(4, device="H100", algorithms={"all_reduce": "ring"})
    got = assert_same_run(_all_reduce_into, cluster, True, races="off")
    assert every_schedule_batched == [True]
    want = np.sum([_data(r, _FAR_NUMEL, torch.float32, 3).double().numpy() for r in range(4)], axis=0)
    assert np.allclose(got.returns[0][0].double().numpy(), want, rtol=1e-5, atol=1e-3)
    # unmapped once nothing refers to the buffers (a failure above leaves them mapped: its report may read them)
    _FAR_BUFFERS.clear()
    del high, got
    gc.collect()
    for addr in mapped:
        libc.munmap(addr, nbytes)


@pytest.mark.parametrize(("shape", "backend"), [("ring", "gloo"), ("ring", "nccl"), ("two_level", "gloo")])
def test_large_ring_all_reduce_runs_batched(shape: str, backend: str) -> None:
    """A 64-rank ring all-reduce (8,064 messages) runs batched by default, with the result of the messages one by
    one and of NumPy's sum."""
    made: list = []
    real = batched.make

    def noting(run: object, msgs: object) -> object:
        got = real(run, msgs)  # type: ignore[arg-type]
        made.append(got is not None)
        return got

    batched.make = noting  # type: ignore[assignment]
    try:
        cluster = (
            simdist.Cluster.ring(64, device="H100", algorithms={"all_reduce": "ring"})
            if shape == "ring"
            else simdist.Cluster.two_level(16, 4, device="H100", algorithms={"all_reduce": "ring"})
        )
        dev = "cuda" if backend == "nccl" else "cpu"
        got = assert_same_run(_ring_all_reduce, cluster, True, args=(1000, dev), backend_name=backend)
    finally:
        batched.make = real  # type: ignore[assignment]
    assert any(made)
    want = np.sum([_data(r, 1000, torch.float32, 5).double().numpy() for r in range(64)], axis=0)
    assert np.allclose(got.returns[0][0].double().numpy(), want, rtol=1e-5, atol=1e-3)


def _repeated(numels: list[int], dev: str) -> list:
    out = []
    for salt, numel in enumerate(numels):
        t = _data(dist.get_rank(), numel, torch.float32, salt).to(dev)
        dist.all_reduce(t)
        out.append(t)
    return out


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_repeated_schedule_shares_its_arrays(
    every_schedule_batched: list, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The same all-reduce again (a training loop's, every step) reuses the arrays its schedule built the first
    time; another schedule of as many messages and steps (other chunks) builds its own: all of it the run of the
    messages one by one."""
    built: list = []
    real = batched._Static.__init__

    def counting(self: object, *args: object) -> None:
        built.append(1)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(batched._Static, "__init__", counting)
    cluster = simdist.Cluster.ring(6, device="H100", algorithms={"all_reduce": "ring"})
    dev = "cuda" if backend == "nccl" else "cpu"
    # 30 and 36 elements: ring schedules of as many messages and steps, over other chunks
    assert_same_run(_repeated, cluster, True, args=([30, 30, 36, 30, 30], dev), backend_name=backend)
    assert len(built) == 3  # 30, 36, and 30 again (36 took its place)


def _fake_step(numel: int) -> list:
    x = torch.ones(numel, device="cuda")
    dist.all_reduce(x)
    y = torch.empty(numel * dist.get_world_size(), device="cuda")
    dist.all_gather_into_tensor(y, x)
    return []


def test_timing_only_runs_batched(every_schedule_batched: list) -> None:
    """Meta buffers move no data: a timing-only run's schedules run batched, at the times of the messages one by
    one."""
    cluster = simdist.Cluster.two_level(
        4, 4, device="H100", algorithms={"all_reduce": "ring", "all_gather": "ring"}
    )
    got = assert_same_run(_fake_step, cluster, True, args=(4096,), backend_name="nccl", tensors="fake")
    assert every_schedule_batched and not any(every_schedule_batched)  # batched, no data moved
    assert got.sim_time > 0


def test_lone_receivers_finish_at_the_start(every_schedule_batched: list) -> None:
    """A broadcast's root receives nothing: it is done once it has sent, before the next rank sends (as one
    message at a time has it)."""

    def bcast(numel: int) -> list[torch.Tensor]:
        x = _data(dist.get_rank(), numel, torch.float32, 1)
        dist.broadcast(x, src=2)
        y = _data(dist.get_rank(), numel, torch.float32, 2)
        dist.reduce(y, dst=1)
        return [x, y]

    cluster = simdist.Cluster.switch(6, bandwidth="10GB/s", latency="3us", device="cpu")
    for algo in ("ring", "tree", "direct"):
        cluster.algorithms = {"broadcast": algo, "reduce": algo}
        assert_same_run(bcast, cluster, True, args=(300,), races="off")
    assert every_schedule_batched


def test_a_senders_pieces_on_one_link_hold_it_in_turn(every_schedule_batched: list) -> None:
    """A pipelined broadcast's root, and a pipelined reduce's first rank, send all their pieces at once down the
    one link to their neighbour (a ring: every route one link, of one latency and speed): the pieces hold the
    link one after another, as one message at a time has it."""

    def chain(numel: int) -> list[torch.Tensor]:
        x = _data(dist.get_rank(), numel, torch.float32, 1)
        dist.broadcast(x, src=1)
        y = _data(dist.get_rank(), numel, torch.float32, 2)
        dist.reduce(y, dst=0)
        return [x, y]

    cluster = simdist.Cluster.ring(4, device="cpu", algorithms={"broadcast": "ring", "reduce": "ring"})
    got = assert_same_run(chain, cluster, True, args=(600_000,), races="off")  # 2.4 MB: ten pieces
    assert every_schedule_batched
    assert got.messages == 2 * 3 * 10


def _mixed_all_reduce(n: int, numel: int) -> list:
    """An all-reduce schedule whose first group, due at one time, mixes reductions and copies of equal chunks."""
    half = numel // 2
    first = [
        msg(r, (r + 1) % n, 0, *((0, half) if r % 2 else (half, 2 * half)), "reduce" if r < 2 else "copy")
        for r in range(n)
    ]
    return first + [msg(r, (r + 1) % n, 1, 0, 1, "copy") for r in range(n)]


def test_a_group_mixing_reductions_and_copies_runs_batched(
    every_schedule_batched: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages due together, some reducing into their receivers' chunks and some copying over them: the same
    run as one message at a time (the schedule's own order: it is no all-reduce gloo would check)."""
    monkeypatch.setattr(ring, "all_reduce", _mixed_all_reduce)
    cluster = simdist.Cluster.ring(4, device="H100", algorithms={"all_reduce": "ring"})
    assert_same_run(_ring_all_reduce, cluster, True, args=(8, "cuda"), backend_name="nccl")
    assert every_schedule_batched


@st.composite
def _entries(draw: st.DrawFn) -> list:
    """Entries in flight due at one time: each with payloads of one length as rows, or flat."""
    entries, eid = [], 0
    for _ in range(draw(st.integers(1, 4))):
        counts = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
        rows = draw(st.booleans()) and len(set(counts)) == 1 and counts[0] > 0
        values = [np.arange(c, dtype=np.int32) + 100 * (eid + i) for i, c in enumerate(counts)]
        k = len(counts)
        ids = np.array(draw(st.permutations(range(eid, eid + k))), dtype=np.int64)
        order = np.argsort(ids)
        values = [values[i] for i in order]
        if rows:
            pay, poff, c = np.stack(values), np.arange(k), counts[0]
        else:
            lens = [len(v) for v in values]
            pay = np.concatenate(values) if values else np.zeros(0, np.int32)
            poff, c = np.cumsum([0, *lens[:-1]]), 0
        entries.append(
            (batched._Entry(ids[order], ids[order], ids[order].astype(float), pay, poff, c), values)
        )
        eid += k
    return entries


@given(_entries())
def test_merged_entries_keep_each_messages_payload(entries: list) -> None:
    """Entries due at one time merge into one, in id order, each message keeping its payload (rows of one length
    stay rows; rows of different lengths and flat payloads all go flat)."""
    merged = batched._Entry.merge([e for e, _ in entries])
    want = dict(zip((int(i) for e, _ in entries for i in e.eids), (v for _, vs in entries for v in vs)))
    assert merged.eids.tolist() == sorted(want)
    for i, eid in enumerate(merged.eids.tolist()):
        got = (
            merged.pay[merged.poff[i]]
            if merged.c
            else merged.pay[merged.poff[i] : merged.poff[i] + len(want[eid])]
        )
        assert got.tolist() == want[eid].tolist()


def test_schedules_not_fit_for_arrays_keep_one_message_at_a_time() -> None:
    """A small schedule and gloo's model (reductions on the rank's thread) keep the one-message path, each with
    its reason; a perturbed run (exploration decides ties itself) does not even queue messages on lanes."""
    cluster = simdist.Cluster.ring(64, device="cpu", algorithms={"all_reduce": "ring"})
    reasons: list = []
    real = batched.make

    def why(run: object, msgs: object) -> object:
        reasons.append(batched.batched_allowed(run, batched.Columns(msgs)))  # type: ignore[arg-type]
        return real(run, msgs)  # type: ignore[arg-type]

    gloo = simdist.Cluster.two_level(
        16, 4, device="cpu", collective_model="gloo", algorithms={"all_reduce": "ring"}
    )
    gloo.local_bandwidth = 2e9
    runs = [
        (cluster, {}),
        (simdist.Cluster.ring(4, device="cpu"), {}),
        (cluster, {"perturbation": simdist.Perturbation(ties="random")}),
        (gloo, {}),
    ]
    batched.make = why  # type: ignore[assignment]
    try:
        seen = []
        for c, kw in runs:
            reasons.clear()
            simdist.run(_ring_all_reduce, c, args=(100, "cpu"), **kw)
            seen.append(list(reasons))
    finally:
        batched.make = real  # type: ignore[assignment]
    assert seen[0] == [None]
    assert seen[1] == ["a small schedule"]
    assert seen[2] == []
    assert len(seen[3]) == 1 and "gloo's model" in seen[3][0]


# ----------------------------------------------------------------------------- the pieces


def _ring_lists(n: int, off: list[int], step0: int) -> tuple[list, list]:
    """The ring's reduce-scatter and all-gather messages, listed one by one."""
    rs = [
        msg(r, (r + 1) % n, step0 + k, off[(r - k - 1) % n], off[(r - k - 1) % n + 1], "reduce")
        for r in range(n)
        for k in range(n - 1)
    ]
    ag = [
        msg(r, (r + 1) % n, step0 + k, off[(r - k) % n], off[(r - k) % n + 1], "copy")
        for r in range(n)
        for k in range(n - 1)
    ]
    return rs, ag


@given(st.integers(2, 9), st.integers(0, 50), st.integers(0, 5))
def test_ring_schedules_as_arrays_list_the_ring(n: int, numel: int, step0: int) -> None:
    """The array-built ring schedules hold the ring's messages (rank by rank, step by step)."""
    off = split_offsets(numel, n)
    rs, ag = _ring_lists(n, off, step0)
    assert list(ring.reduce_scatter(n, off, step0)) == rs
    assert list(ring.all_gather(n, off, step0)) == ag
    both = list(ring.all_reduce(n, numel))
    assert sorted(both) == sorted(_ring_lists(n, off, 0)[0] + _ring_lists(n, off, n - 1)[1])
    assert all(type(v) is int for m in both for v in m[:7])


@given(st.lists(st.integers(0, 40), max_size=60))
def test_strided_runs_are_the_links_in_order(links: list[int]) -> None:
    """Runs of evenly spaced link ids stand for exactly the links, in order, none twice."""
    arr = np.array(links, dtype=np.int64)
    runs = batched._strided_runs(arr)
    if runs is None:
        return
    got = []
    for a, b, sl in runs:
        part = list(range(sl.start, sl.stop, sl.step))
        assert part == links[a:b]
        got += part
    assert got == links and len(set(got)) == len(got)


@given(st.integers(8, 300), st.integers(0, 299), st.integers(1, 3), st.integers(0, 5))
def test_a_rings_rotated_links_are_strided_runs(n: int, shift: int, stride: int, base: int) -> None:
    """Every rank's link, listed from any rank on (a ring's step): one or two runs, read and written as slices."""
    links = np.roll(base + stride * np.arange(n, dtype=np.int64), shift % n)
    runs = batched._strided_runs(links)
    assert runs is not None and len(runs) <= 2
    assert [i for _, _, sl in runs for i in range(sl.start, sl.stop, sl.step)] == links.tolist()


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), max_size=20), st.booleans())
def test_expand_lists_the_ranges_in_order(ranges: list[tuple[int, int]], equal: bool) -> None:
    """The indices of ranges [start, start + count), one range after another (equal counts too, one each too)."""
    if equal and ranges:
        ranges = [(s, ranges[0][1]) for s, _ in ranges]
    starts = np.array([s for s, _ in ranges], dtype=np.int64)
    counts = np.array([c for _, c in ranges], dtype=np.int64)
    want = [i for s, c in ranges for i in range(s, s + c)]
    assert batched._expand(starts, counts).tolist() == want


@given(st.lists(st.integers(0, 9), max_size=30))
def test_first_repeat(values: list[int]) -> None:
    want = next((i for i, v in enumerate(values) if v in values[:i]), len(values))
    assert batched._first_repeat(np.array(values, dtype=np.int64)) == want


@st.composite
def graphs(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, float]], list[tuple[int, int]]]:
    """A random directed graph (latencies from a few values, so routes tie) and queries in a random order."""
    v = draw(st.integers(2, 9))
    edges = draw(
        st.lists(
            st.tuples(st.integers(0, v - 1), st.integers(0, v - 1), st.sampled_from([1e-6, 2e-6, 3e-6])),
            max_size=30,
        )
    )
    links = [(a, b, lat) for a, b, lat in edges if a != b]
    queries = draw(st.permutations([(s, d) for s in range(v) for d in range(v)]))
    return v, links, queries


@given(graphs(), st.booleans())
def test_routes_do_not_depend_on_the_order_they_are_asked_in(graph: tuple, switches: bool) -> None:
    """A search stopped at one destination and resumed for the next finds the routes a whole search finds (with
    the upper half of the vertices as switches, ranks behind them route through their switches' searches)."""
    v, links, queries = graph
    ranks = max(1, v // 2) if switches else v
    whole = Router(v + 1, ranks, links)  # vertex v is isolated: searching for it searches everything
    for s in range(v):
        whole._settle(s, v)
    lazy = Router(v, ranks, links)
    for s, d in queries:
        if whole.reachable(s)[d]:
            assert lazy.route(s, d) == whole._walk(whole._searches[s][0], s, d) == whole.route(s, d)


# ----------------------------------------------------------------------------- what watches a batched schedule


def test_the_race_detector_sees_the_same_races(every_schedule_batched: list) -> None:
    """A buffer written while its all-reduce is in flight: the same race reported, and the same values."""
    cluster = simdist.Cluster.ring(6, device="cpu", algorithms={"all_reduce": "ring"})
    args = ("all_reduce", 30, torch.float32, "sum", 1, True, True)
    with pytest.warns(UserWarning):
        got = assert_same_run(_program, cluster, True, args=args, races="warn")
    assert got.races and every_schedule_batched


def test_polling_steps_through_a_batched_schedules_messages(every_schedule_batched: list) -> None:
    cluster = simdist.Cluster.ring(5, device="H100", latency="40us", algorithms={"all_reduce": "ring"})
    got = assert_same_run(_polling, cluster, True, args=(20,))
    assert int(got.returns[0][1]) > 1 and every_schedule_batched


def _slow_all_reduce() -> str:
    w = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    try:
        w.wait(timeout=timedelta(microseconds=300))
    except dist.DistBackendError as e:
        return str(e)
    return "no timeout"


def test_a_timeout_shows_a_batched_schedules_progress(every_schedule_batched: list) -> None:
    """The schedule a timed-out wait prints marks the steps each rank has not finished, as one message at a time
    marks them."""
    cluster = simdist.Cluster.ring(
        4, bandwidth="1GB/s", latency="1us", device="cpu", algorithms={"all_reduce": "ring"}
    )
    texts = []
    for arrays in (False, True):
        batched.ENABLED = arrays
        try:
            texts.append(simdist.run(_slow_all_reduce, cluster).returns[0])
        finally:
            batched.ENABLED = True
    assert every_schedule_batched == [True]
    assert texts[0] == texts[1]
    schedule = texts[1].split("Its schedule:\n", 1)[1].splitlines()
    done = [line for line in schedule[1:7] if " *" not in line]
    assert 0 < len(done) < 6  # 300 us into steps of about 100 us: some steps done everywhere, some not


# ----------------------------------------------------------------------------- a ring's steps in lockstep


def _count_lockstep(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every schedule that can run batched does; first the list of those that did (see
    :func:`_batch_every_schedule`), then per group delivered, whether it went as one lockstep step."""
    steps: list = [_batch_every_schedule(monkeypatch)]
    _note_answers(monkeypatch, "deliver_step", steps)
    return steps


def _note_answers(monkeypatch: pytest.MonkeyPatch, name: str, answers: list | None = None) -> list:
    """Every answer ``lockstep.<name>`` gives from now on, appended to ``answers`` (a new list by default)."""
    answers = [] if answers is None else answers
    real = getattr(lockstep, name)

    def noting(*args: object) -> object:
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(lockstep, name, noting)
    return answers


def _ring_collective(
    coll: str, numel: int, dtype: torch.dtype, op: str, salt: int, dev: str, p2p: bool
) -> list:
    """One ring collective; with ``p2p``, rank 0 sends rank 1 a large message while it is in flight (on the
    ring's own link)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _data(rank, numel, dtype, salt).to(dev)
    reduce_op = getattr(dist.ReduceOp, op.upper())
    if coll == "all_reduce":
        out, w = x, dist.all_reduce(x, reduce_op, async_op=True)
    elif coll == "reduce_scatter":
        out = torch.empty(numel // n, dtype=dtype, device=dev)
        w = dist.reduce_scatter_tensor(out, x, reduce_op, async_op=True)
    else:
        out = torch.empty(numel * n, dtype=dtype, device=dev)
        w = dist.all_gather_into_tensor(out, x, async_op=True)
    big = torch.full((20_000,), float(rank), device=dev)
    if p2p and rank == 0:
        dist.send(big, 1)
    elif p2p and rank == 1:
        dist.recv(big, 0)
    w.wait()
    return [out.cpu(), x.cpu(), big.cpu()]


@given(
    st.integers(3, 7),
    st.integers(1, 3),
    st.integers(0, 6),
    st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]),
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64]),
    st.sampled_from(["sum", "max", "avg"]),
    st.sampled_from([("gloo", "cpu"), ("gloo", "H100"), ("nccl", "H100")]),
    st.booleans(),
    st.integers(0, 3),
    st.integers(1, 4),
)
@settings(max_examples=15, deadline=None)
def test_ring_steps_in_lockstep_change_nothing(
    n: int,
    chunk: int,
    extra: int,
    coll: str,
    dtype: torch.dtype,
    op: str,
    where: tuple,
    p2p: bool,
    salt: int,
    block: int,
) -> None:
    """A ring collective on a ring cluster, of equal chunks or (``extra`` elements more, an all-reduce's) of
    chunks of two lengths, with or without a message holding one of its links: its steps in lockstep, whole or a
    part at a time, give the run of simpy's messages and the run of each group handled the general way (data bit
    for bit, simulated times, message counts, memory statistics, trace hash); the steps' offsets read ``block``
    steps at a time."""
    if op == "avg" and not dtype.is_floating_point:
        op = "sum"
    backend, device = where
    dev = "cuda" if backend == "nccl" else "cpu"
    numel = n * chunk + (extra % n if coll == "all_reduce" else 0)
    cluster = simdist.Cluster.ring(n, device=device, algorithms={coll: "ring"})
    args = (coll, numel, dtype, op, salt, dev, p2p)
    with pytest.MonkeyPatch.context() as mp:
        steps = _count_lockstep(mp)
        mp.setattr(lockstep, "BLOCK", block)
        got = assert_same_run(_ring_collective, cluster, True, args=args, backend_name=backend, memory=True)
        assert any(steps[1:]) or p2p, "no step ran in lockstep"  # a link held apart puts ranks out of step
        mp.setattr(lockstep, "ENABLED", False)
        old = simdist.run(_ring_collective, cluster, args=args, backend_name=backend, memory=True)
    assert old.sim_time == got.sim_time and old.messages == got.messages
    assert old.trace.hash() == got.trace.hash() and old.memory == got.memory
    for want, have in zip(old.returns, got.returns):
        assert all(torch.equal(w.view(torch.uint8), h.view(torch.uint8)) for w, h in zip(want, have))


def test_only_a_rings_steps_run_in_lockstep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes of two links (a switch) and a tree's messages go the general way; a ring whose chunks differ
    (elements that do not divide by the ranks) runs its steps in lockstep a part at a time, and the same ring in
    a timing-only run (no data) runs in lockstep."""
    steps = _count_lockstep(monkeypatch)
    ring_cluster = simdist.Cluster.ring(5, device="H100", algorithms={"all_reduce": "ring"})
    switch = simdist.Cluster.switch(
        5, bandwidth="10GB/s", latency="3us", device="H100", algorithms={"all_reduce": "ring"}
    )
    tree = simdist.Cluster.ring(5, device="H100", algorithms={"all_reduce": "tree"})
    made = steps[0]
    for cluster, numel, lockstep_expected in (
        (ring_cluster, 23, True),
        (switch, 25, False),
        (tree, 25, False),
    ):
        made.clear()
        del steps[1:]
        assert_same_run(_ring_all_reduce, cluster, True, args=(numel, "cpu"))
        assert made and any(steps[1:]) == lockstep_expected
    del steps[1:]
    got = assert_same_run(_fake_step, ring_cluster, True, args=(25,), backend_name="nccl", tensors="fake")
    assert any(steps[1:]) and got.sim_time > 0


def _grads_step(width: int, dtype: torch.dtype, dev: str) -> list:
    """Gradients of an MLP's sizes (``width`` squared, ``width``, ``width`` and one element), each all-reduced
    asynchronously: four ring all-reduces in flight together on the same links."""
    rank = dist.get_rank()
    grads = [_data(rank, k, dtype, i).to(dev) for i, k in enumerate((width * width, width, width, 1))]
    for w in [dist.all_reduce(g, async_op=True) for g in grads]:
        w.wait()
    return [g.cpu() for g in grads]


@pytest.mark.parametrize(
    ("n", "width", "dtype", "backend"), [(12, 4, torch.float32, "gloo"), (9, 5, torch.float64, "nccl")]
)
def test_chunks_of_two_lengths_run_a_part_of_a_step_at_a_time(
    monkeypatch: pytest.MonkeyPatch, n: int, width: int, dtype: torch.dtype, backend: str
) -> None:
    """Four ring all-reduces in flight together whose elements do not divide by the ranks (chunks of one
    element or none; a step's chunks of each length arrive apart): their steps go in lockstep a part at a time,
    with the run of simpy's messages and of every group handled the general way."""
    steps = _count_lockstep(monkeypatch)
    parts = _note_answers(monkeypatch, "_deliver_part")
    cluster = simdist.Cluster.ring(n, device="H100", algorithms={"all_reduce": "ring"})
    args = (width, dtype, "cuda" if backend == "nccl" else "cpu")
    got = assert_same_run(_grads_step, cluster, True, args=args, backend_name=backend)
    assert len(steps[0]) == 4 and sum(parts) > len(parts) // 2  # most groups went as parts of steps
    monkeypatch.setattr(lockstep, "ENABLED", False)
    old = simdist.run(_grads_step, cluster, args=args, backend_name=backend)
    assert old.sim_time == got.sim_time and old.messages == got.messages
    assert old.trace.hash() == got.trace.hash()
    for want, have in zip(old.returns, got.returns):
        assert all(torch.equal(w.view(torch.uint8), h.view(torch.uint8)) for w, h in zip(want, have))


@given(st.integers(2, 12), st.data())
@settings(max_examples=60, deadline=None)
def test_a_parts_links_are_slices_where_its_senders_are_consecutive_around_the_ring(
    n: int, data: st.DataObject
) -> None:
    """:func:`lockstep._spans` against a set's own links: the senders of a part of a step, in any order, as one or
    two slices of the link list where they are consecutive ranks around the ring, else None."""
    first, gap = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 3))
    plan = types.SimpleNamespace(by_rank=(first, gap), n=n)
    br = types.SimpleNamespace(lockstep=plan)
    ranks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    snd = np.array(ranks, dtype=np.int64)
    spans = lockstep._spans(br, snd)  # type: ignore[arg-type]
    members = set(ranks)
    consecutive = any({(a + i) % n for i in range(len(ranks))} == members for a in range(n))
    assert (spans is not None) == consecutive
    if spans is not None:
        links = [link for sl in spans for link in range(sl.start, sl.stop, sl.step)]
        assert sorted(links) == sorted(first + gap * r for r in ranks)
    plan.by_rank = None
    assert lockstep._spans(br, snd) is None  # type: ignore[arg-type]


def _send_during(numel: int, delay: float) -> list:
    """A ring all-reduce in flight while rank 0, ``delay`` seconds in, sends rank 1 a large message on the ring's
    own link."""
    rank = dist.get_rank()
    x = _data(rank, numel, torch.float32, 4)
    w = dist.all_reduce(x, async_op=True)
    big = torch.full((100_000,), float(rank))
    if rank == 0:
        simdist.charge(delay)
        simdist.synchronize()
        dist.send(big, 1)
    elif rank == 1:
        dist.recv(big, 0)
    w.wait()
    return [x, big]


def test_a_step_whose_link_is_still_busy_goes_the_general_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message sent between two of a ring's steps on one of its links, still on it when the next step leaves:
    that step's messages start as their links free (the general way), with the run of simpy's messages."""
    steps = _count_lockstep(monkeypatch)
    free = _note_answers(monkeypatch, "links_free")
    cluster = simdist.Cluster.ring(6, device="cpu", algorithms={"all_reduce": "ring"})
    for i in range(12):  # into the all-reduce's 50 us at uneven points: some between two steps
        assert_same_run(_send_during, cluster, True, args=(12, i * 4.3e-6))
    assert any(steps[1:]) and False in free and True in free
