"""A host waits for its device without handing the baton on (``RankTime.wait_for_device``).

A value read (``item()``), ``torch.cuda.synchronize()``, a stream's or an event's ``synchronize()``: the host waits
for its device (on CPU devices, for its own compute). Where the device will be is known when the host asks, so the wait is kept as host time to come
and slept off at the host's next synchronisation point, with the simulated times of sleeping at once.

Oracle: the same program with the waits slept at once (the reference below, what every wait did before), compared
bit for bit: every span and message of the trace, the simulated time, the values returned. The order in which
the trace recorded its events may differ (the ranks interleave differently), so its hash may too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import simdist
from simdist.clock import baton as baton_module
from simdist.clock.baton import current_rank_state
from simdist.clock.ranktime import RankTime

#: the actions a rank's loop may take, drawn by hypothesis
ACTIONS = ("matmul", "read", "side", "event", "all_reduce", "async_all_reduce", "synchronize", "stream_sync")


def _program(actions: list[str], n: int) -> list[float]:
    """Each rank runs ``actions`` on its simulated GPU (rank 1 with matmuls twice the size, so ranks wait for each
    other); returns every value it read."""
    rank = dist.get_rank()
    size = 32 * (1 + rank % 2)
    x = torch.full((size, size), 1.0 / size, device="cuda")
    side = torch.cuda.Stream()
    read: list[float] = []
    pending: list[Any] = []
    for _ in range(n):
        for action in actions:
            if action == "matmul":
                x = x @ x
            elif action == "read":
                read.append(x.sum().item())
            elif action == "side":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    y = x * 2
                torch.cuda.current_stream().wait_stream(side)
                x = y / 2
            elif action == "event":
                event = torch.cuda.Event()
                event.record()
                x = x + 0
                event.synchronize()
            elif action == "all_reduce":
                t = torch.ones(4, device="cuda") * (rank + 1)
                dist.all_reduce(t)
                read.append(float(t[0]))
            elif action == "async_all_reduce":
                t = torch.ones(8, device="cuda")
                pending.append((t, dist.all_reduce(t, async_op=True)))
            elif action == "synchronize":
                torch.cuda.synchronize()
            elif action == "stream_sync":
                side.synchronize()
    for t, work in pending:
        work.wait()
        read.append(t.sum().item())
    return read


def _sleep_at_once(self: RankTime, until: float) -> None:
    """The reference: the host sleeps its pending time off, then until the device reaches ``until``, at once."""
    state = current_rank_state()
    if state is None:
        return
    self.settle()
    if self.host_runs_ahead:
        self.baton.sleep(until - self.env.now, f"rank {state.rank} synchronizing with its device")


def _run(actions: list[str], n: int, ranks: int = 2) -> tuple[Any, int]:
    """The run and the number of times a rank thread handed the baton back."""
    hand_back = baton_module.Baton._hand_back
    count = [0]

    def counting(self: Any, state: Any) -> None:
        count[0] += 1
        hand_back(self, state)

    baton_module.Baton._hand_back = counting  # type: ignore[method-assign]
    try:
        cluster = simdist.Cluster.switch(ranks, device="H100")
        return simdist.run(_program, cluster, args=(actions, n), races="off"), count[0]
    finally:
        baton_module.Baton._hand_back = hand_back  # type: ignore[method-assign]


def _events(res: Any) -> tuple[list[tuple], list[tuple]]:
    spans = sorted(
        repr((s.rank, s.stream, s.name, s.start, s.end, sorted(s.args.items()))) for s in res.trace.spans
    )
    messages = sorted(
        repr((m.src, m.dst, m.src_stream, m.dst_stream, m.start, m.end, m.nbytes, m.name))
        for m in res.trace.messages
    )
    return spans, messages


def _same_run(actions: list[str], n: int, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[int, int]:
    """Runs ``actions`` both ways, checks that they agree bit for bit; the two runs' hand-off counts."""
    res, handoffs = _run(actions, n, **kw)
    with monkeypatch.context() as m:
        m.setattr(RankTime, "wait_for_device", _sleep_at_once)
        ref, ref_handoffs = _run(actions, n, **kw)
    assert res.returns == ref.returns
    assert res.sim_time == ref.sim_time
    assert _events(res) == _events(ref)
    return handoffs, ref_handoffs


def test_value_reads_cost_no_hand_off_and_time_as_sleeping_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of a matmul and a read on two ranks: the reference hands the baton back twice at each read (to sleep
    off its launch, then to wait for the kernel), this run no more for 20 rounds than for 10."""
    ten, ten_reference = _same_run(["matmul", "read"], 10, monkeypatch)
    twenty, twenty_reference = _same_run(["matmul", "read"], 20, monkeypatch)
    assert twenty == ten, (ten, twenty)
    assert twenty_reference - ten_reference == 2 * 2 * 10, (ten_reference, twenty_reference)


def _ddp_step() -> float:
    """DDP's construction (it reads every rank's parameter count with ``item()``) and one step, on GPU i."""
    torch.cuda.set_device(dist.get_rank())
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(4, 4).cuda(), device_ids=[dist.get_rank()]
    )
    model(torch.ones(2, 4, device="cuda") * dist.get_rank()).sum().backward()
    return float(model.module.weight.grad.sum())


def test_ddp_on_a_node_of_eight_gpus_times_as_sleeping_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's DDP on dgx-h100's NVLink node under NCCL's model."""
    res = simdist.run(_ddp_step, simdist.Cluster.preset("dgx-h100", 8))
    with monkeypatch.context() as m:
        m.setattr(RankTime, "wait_for_device", _sleep_at_once)
        ref = simdist.run(_ddp_step, simdist.Cluster.preset("dgx-h100", 8))
    assert res.returns == ref.returns
    assert res.sim_time == ref.sim_time
    assert _events(res) == _events(ref)


@given(
    actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=6),
    n=st.integers(1, 3),
    ranks=st.sampled_from([1, 2, 3]),
)
def test_any_mix_of_waits_times_as_sleeping_at_once(actions: list[str], n: int, ranks: int) -> None:
    """Any mix of kernels, reads, side streams, events, synchronisations and collectives: the same run."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _same_run(actions, n, monkeypatch, ranks=ranks)


def _cpu_program(rounds: int) -> list[float]:
    """On a CPU cluster (the host waits for its compute): compute, reads and ``simdist.synchronize()`` between
    all-reduces."""
    x = torch.full((8, 8), 0.5)
    read = []
    for i in range(rounds):
        x = x @ x + dist.get_rank()
        simdist.charge(1e-6 * (1 + dist.get_rank()))
        read.append(x.sum().item())
        if i % 2:
            simdist.synchronize()
        dist.all_reduce(x)
        read.append(simdist.now())
    return read


def test_a_host_synchronous_rank_times_as_sleeping_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on CPU devices, where a wait for the device is a wait for the host's own compute."""
    cluster = simdist.Cluster.switch(3, device="cpu")
    res = simdist.run(_cpu_program, cluster, args=(4,))
    with monkeypatch.context() as m:
        m.setattr(RankTime, "wait_for_device", _sleep_at_once)
        ref = simdist.run(_cpu_program, cluster, args=(4,))
    assert res.returns == ref.returns
    assert res.sim_time == ref.sim_time
    assert _events(res) == _events(ref)
