"""Hosts that run ahead of their devices (GPU devices under NCCL-like progress), as CUDA hosts do.

Oracles: a pipeline schedule's dependency graph (``pipeline_dag``) for hand-written and torch's schedules, and
closed-form times for the rules each case isolates (when a collective starts, when the host waits).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from alpha_beta import all_reduce_seconds
from hypothesis import given
from hypothesis import strategies as st
from pipeline_dag import SCHEDULES, step_end
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import simdist
from simdist.compute import estimate, get_device
from simdist.errors import DeadlockError, RankError

US = 1e-6


def _connect_neighbours() -> None:
    """One transfer each way between neighbouring stages: NCCL connects a pair on its first send/recv."""
    rank, p = dist.get_rank(), dist.get_world_size()
    for step in (1, -1):
        works = []
        if 0 <= rank + step < p:
            works.append(dist.isend(torch.zeros(1), rank + step))
        if 0 <= rank - step < p:
            works.append(dist.irecv(torch.zeros(1), rank - step))
        for w in works:
            w.wait()


def _hand_pipeline(schedule: str, m: int, forward: float, backward: float) -> tuple[float, float, list[float]]:
    """A pipeline written with isend/irecv as torch's schedules issue them, each action charged as compute."""
    rank, p = dist.get_rank(), dist.get_world_size()
    order = SCHEDULES[schedule](p, m)[rank]
    # every tensor is made before the timed step: making one is a kernel of its own under the cost model
    outgoing = [torch.full((1,), float(i if kind == "F" else -i - 1)) for kind, i in order]
    incoming = [torch.empty(1) for _ in order]
    _connect_neighbours()
    dist.barrier()
    simdist.synchronize()
    start = simdist.now()
    sends, got = [], []
    for (kind, _), out, x in zip(order, outgoing, incoming):
        peer_in, peer_out = (rank - 1, rank + 1) if kind == "F" else (rank + 1, rank - 1)
        if 0 <= peer_in < p:
            dist.irecv(x, peer_in).wait()
            got.append(x)
        simdist.charge(forward if kind == "F" else backward)
        if 0 <= peer_out < p:
            sends.append(dist.isend(out, peer_out))
    for w in sends:
        w.wait()
    simdist.synchronize()
    end = simdist.now()
    return start, end, [float(x) for x in got]


def _expected_values(schedule: str, p: int, m: int, rank: int) -> list[float]:
    out = []
    for kind, i in SCHEDULES[schedule](p, m)[rank]:
        if kind == "F" and rank > 0:
            out.append(float(i))
        elif kind == "B" and rank < p - 1:
            out.append(float(-i - 1))
    return out


@given(
    schedule=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(2, 4),
    m=st.integers(1, 6),
    forward_us=st.integers(1, 100),
    backward_us=st.integers(1, 200),
    latency_us=st.integers(0, 20),
)
def test_a_pipeline_runs_as_its_dependency_graph_says(
    schedule: str, p: int, m: int, forward_us: int, backward_us: int, latency_us: int
) -> None:
    """Every send leaves when its stage's compute reaches it and every receive is posted ahead, so a step takes
    exactly the schedule's critical path, link latency included only where the graph puts it."""
    bandwidth = 100e9
    cluster = simdist.Cluster.switch(p, bandwidth=bandwidth, latency=f"{latency_us}us", device="H100")
    res = simdist.run(_hand_pipeline, cluster, args=(schedule, m, forward_us * US, backward_us * US))
    hop = 2 * latency_us * US + 4 / bandwidth  # two links through the switch, one float32
    starts = [r[0] for r in res.returns]
    expected = step_end(SCHEDULES[schedule](p, m), forward_us * US, backward_us * US, hop, starts)
    assert max(r[1] for r in res.returns) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    for rank, r in enumerate(res.returns):
        assert r[2] == _expected_values(schedule, p, m, rank)


def test_a_host_synchronous_pipeline_pays_a_hop_per_microbatch() -> None:
    """Under gloo-like progress the host waits for its compute before each send or receive: the oracle for a
    device that never waits is then beaten by latency, which is what the stream model exists to remove."""
    p, m, f, b, lat = 4, 6, 30 * US, 60 * US, 10 * US
    cluster = simdist.Cluster.switch(p, bandwidth=100e9, latency=lat, device="H100")
    res = simdist.run(_hand_pipeline, cluster, args=("GPipe", m, f, b), progress="gloo")
    starts = [r[0] for r in res.returns]
    ideal = step_end(SCHEDULES["GPipe"](p, m), f, b, 2 * lat + 4 / 100e9, starts)
    assert max(r[1] for r in res.returns) > ideal + (m - 1) * 2 * lat


def _charge_then(after: str) -> float:
    simdist.charge("1ms")
    if after == "item":
        torch.ones(1).item()
    elif after in ("tolist", "numpy", "print"):
        t = torch.empty(2)  # no kernel: the read alone must wait for the 1 ms
        if after == "print":
            repr(t)
        else:
            getattr(t, after)()
    elif after == "cuda":
        torch.cuda.synchronize()
    elif after == "simdist":
        simdist.synchronize()
    return simdist.now()


@pytest.mark.parametrize(
    ("after", "progress", "device", "host_at_ms"),
    [
        ("nothing", "nccl", "H100", 0.0),  # the kernel is queued; the host goes on
        ("item", "nccl", "H100", 1.0),  # a value read to the host waits for the device
        ("tolist", "nccl", "H100", 1.0),  # reads that bypass torch's dispatcher wait too
        ("numpy", "nccl", "H100", 1.0),
        ("print", "nccl", "H100", 1.0),
        ("cuda", "nccl", "H100", 1.0),  # torch.cuda.synchronize() in rank code waits for the simulated device
        ("simdist", "nccl", "H100", 1.0),
        ("nothing", "gloo", "H100", 1.0),  # gloo-like progress: host-synchronous
        ("nothing", "nccl", "cpu", 1.0),  # CPU processes: host-synchronous
    ],
)
def test_when_the_host_waits_for_its_device(after: str, progress: str, device: str, host_at_ms: float) -> None:
    res = simdist.run(_charge_then, simdist.Cluster.switch(2, device=device), args=(after,), progress=progress)
    # making the tensor and reading it are two kernels of their own, queued behind the 1 ms
    kernels = estimate(lambda: torch.ones(1).item(), device=device)[0] if after == "item" else 0.0
    assert [r * 1e3 for r in res.returns] == pytest.approx([host_at_ms + kernels * 1e3 * bool(host_at_ms)] * 2)
    assert res.sim_time == pytest.approx(1e-3 + kernels)


def test_host_read_methods_are_restored_after_a_run() -> None:
    before = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy", "__repr__", "__array__")}
    simdist.run(_charge_then, simdist.Cluster.switch(2), args=("tolist",))
    assert {name: torch.Tensor.__dict__.get(name) for name in before} == before


def _all_reduce_behind_compute() -> tuple[float, float]:
    t = torch.ones(1024)
    simdist.charge("100us")
    issued = simdist.now()
    work = dist.all_reduce(t, async_op=True)
    simdist.charge("30us")  # queued behind the all-reduce's start point: overlaps it
    work.wait()
    return issued, simdist.now()


def test_a_collective_starts_when_the_compute_stream_reaches_it() -> None:
    """The host issues the all-reduce once it has launched the buffer's kernel; it starts 100 us after that
    kernel, when the compute queued before it is done, and ``wait()`` returns when it finishes: its alpha-beta
    time later."""
    lat, bw = 5 * US, 100e9
    res = simdist.run(_all_reduce_behind_compute, simdist.Cluster.switch(2, bandwidth=bw, latency=lat), trace="collectives")
    (span,) = [s for s in res.trace.collectives(0) if s.name.endswith("all_reduce")]
    launch = get_device("H100").host_overhead  # the host's time to launch the buffer's kernel
    made = launch + estimate(lambda: torch.ones(1024), device="H100")[0]  # that kernel, queued first
    assert [r[0] for r in res.returns] == [launch, launch]
    assert span.start == pytest.approx(made + 100 * US)
    assert span.args["issued"] == launch
    assert span.end - span.start == pytest.approx(all_reduce_seconds("ring", 2, 4096, 2 * lat, 1 / bw))
    assert res.returns[0][1] == pytest.approx(span.end)
    assert res.sim_time == pytest.approx(max(span.end, made + 130 * US))


def _exchange(nbytes: int, connect: bool) -> float:
    rank = dist.get_rank()
    if connect:
        _connect_neighbours()
    t = torch.full((nbytes // 4,), float(rank))
    dist.send(t, 1 - rank)  # both ranks send first: only an eager protocol lets this through
    dist.recv(t, 1 - rank)
    return float(t[0])


@pytest.mark.parametrize(
    ("nbytes", "connect", "completes"),
    [(64, True, True), (64, False, False), (8 * 2**20, True, False)],
    ids=["small-connected", "first-transfer", "larger-than-the-staging-buffer"],
)
def test_small_sends_on_a_connected_pair_go_eagerly(nbytes: int, connect: bool, completes: bool) -> None:
    """NCCL sends a message that fits the receiver's staging buffer without waiting for its receive, once the
    pair is connected; a first transfer, or a larger message, needs both sides (and the send/send order hangs)."""
    cluster = simdist.Cluster.switch(2)
    if completes:
        assert simdist.run(_exchange, cluster, args=(nbytes, connect)).returns == [1.0, 0.0]
    else:
        with pytest.raises((DeadlockError, RankError), match="deadlock"):
            simdist.run(_exchange, cluster, args=(nbytes, connect))


WIDTH, STAGES, MICROBATCHES = 64, 4, 8


def _torch_schedule(schedule: str) -> tuple[float, float]:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    stage = PipelineStage(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)), rank, n, torch.device("cpu"))
    sched = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule](stage, MICROBATCHES, loss_fn=lambda o, t: (o - t).pow(2).mean())
    x = torch.randn(MICROBATCHES * 4, WIDTH, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(2):  # the first step infers shapes and connects the stages
        dist.barrier()
        simdist.synchronize()
        start = simdist.now()
        sched.step(*([x] if rank == 0 else []), **({"target": x} if rank == n - 1 else {}))
        simdist.synchronize()
        times.append((start, simdist.now()))
    return times[-1]


def test_torch_gpipe_pays_link_latency_only_to_fill_and_drain() -> None:
    """torch's own ScheduleGPipe, p = 4, m = 8: 5 us links add 2(p - 1) hops to the step, not one per microbatch."""
    def step(latency: str) -> float:
        res = simdist.run(_torch_schedule, simdist.Cluster.switch(STAGES, bandwidth="450GB/s", latency=latency), args=("GPipe",))
        return max(e for _, e in res.returns) - min(s for s, _ in res.returns)

    added = step("5us") - step("0us")
    hop = 10 * US + WIDTH * 4 * 4 / 450e9  # two links; a microbatch of 4 rows of WIDTH float32
    assert added == pytest.approx(2 * (STAGES - 1) * hop, rel=0.05)
