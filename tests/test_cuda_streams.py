"""CUDA side streams on a simulated GPU: work on a side stream runs beside the default stream's in simulated time,
ordered only by events, ``wait_stream`` and ``synchronize``; a stream that touches a side stream's result before
waiting for it is a race naming both lines.

Oracles: closed forms over the charged durations (two streams take the longer one, not the sum; a wait starts a
stream at the event), the cost model's price of one matmul, the program written for the CPU (values bit for bit).
"""

from __future__ import annotations

import inspect
import math
import os
import re
import runpy
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import simdist
from simdist.compute import op_cost
from simdist.compute.devices import H100
from simdist.cuda.pinned import PAGEABLE_SHARE
from simdist.errors import RaceError

ONE = simdist.Cluster.switch(1, device="H100")
US = 1e-6
durations = st.integers(min_value=1, max_value=1000).map(lambda n: n * US)


def _fork_join(a: float, b: float, c: float, d: float) -> tuple[float, float]:
    """Default stream: a, then c; a side stream that waits for a: b; the default stream waits for it, then d."""
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    t0 = simdist.now()
    side = torch.cuda.Stream()
    simdist.charge(a, "a")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        simdist.charge(b, "b")
    simdist.charge(c, "c")
    torch.cuda.current_stream().wait_stream(side)
    simdist.charge(d, "d")
    enqueued = simdist.now() - t0
    torch.cuda.synchronize()
    return enqueued, simdist.now() - t0


@given(durations, durations, durations, durations)
def test_a_side_stream_runs_beside_the_default_stream_and_joins_at_wait_stream(a, b, c, d):
    enqueued, step = simdist.run(_fork_join, ONE, args=(a, b, c, d)).returns[0]
    assert enqueued == 0  # the host only enqueues
    assert math.isclose(step, a + max(b, c) + d, rel_tol=1e-12, abs_tol=1e-15)


def _two_matmuls(side_stream: bool):
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    x = torch.randn(1024, 1024, device="cuda")
    w1 = torch.randn(1024, 1024, device="cuda")
    w2 = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side if side_stream else torch.cuda.current_stream()):
        y1 = x @ w1
    y2 = x @ w2
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return simdist.now() - t0, (y1 + y2).cpu()


def _two_matmuls_on_the_cpu():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.randn(1024, 1024)
    return x @ w1 + x @ w2


def test_a_matmul_on_a_side_stream_overlaps_the_default_streams_and_the_values_are_the_cpu_programs():
    res = simdist.run(_two_matmuls, ONE, args=(True,))
    overlapped, values = res.returns[0]
    serial, _ = simdist.run(_two_matmuls, ONE, args=(False,)).returns[0]
    a = torch.empty(1024, 1024)
    mm = op_cost(torch.ops.aten.mm.default, (a, a), {}, a @ a, H100)
    launch = H100.host_overhead  # the host launches them one after the other; the second starts once launched
    assert mm > launch
    assert math.isclose(overlapped, 2 * launch + mm, rel_tol=1e-12)
    assert math.isclose(serial, launch + 2 * mm, rel_tol=1e-12)
    assert torch.equal(values, simdist.run(_two_matmuls_on_the_cpu, simdist.Cluster.switch(1)).returns[0])
    # the timeline shows the side stream as a row of its own, beside the compute stream
    mms = sorted((s.stream, s.start, s.end) for s in res.trace.spans if s.name == "aten::mm")
    assert [m[0] for m in mms] == ["compute", "compute:stream1"]
    assert mms[0][1:] == pytest.approx((mms[1][1] + launch, mms[1][2] + launch), rel=1e-12)  # launched second
    chrome = res.trace.to_chrome()["traceEvents"]
    names = {e["args"]["name"] for e in chrome if e.get("name") == "thread_name"}
    assert "compute:stream1" in names
    assert {e["cat"] for e in chrome if e.get("name") == "aten::mm"} == {"kernel"}


def _events_across_streams(a: float, b: float):
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    simdist.charge(a)
    start.record()  # on the default stream, after a
    side.wait_event(start)
    with torch.cuda.stream(side):
        simdist.charge(b)
        end.record()
    side.record_event(mid)  # same point as end
    queried = side.query(), end.query()
    side.synchronize()
    host = simdist.now()
    return queried, side.query(), start.elapsed_time(end), start.elapsed_time(mid), host


@given(durations, durations)
def test_events_time_work_across_streams_and_a_stream_synchronizes_the_host(a, b):
    queried, done, ms, ms_mid, host = simdist.run(_events_across_streams, ONE, args=(a, b)).returns[0]
    assert queried == (False, False) and done
    assert math.isclose(ms, b * 1e3, rel_tol=1e-9) and ms_mid == ms
    assert math.isclose(host, a + b, rel_tol=1e-12)


def _blocking_copy_waits_for_its_stream_only(long: float):
    torch.cuda.set_device(0)
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        simdist.charge(long)
    x.cpu()  # a copy on the default stream: the host waits for that stream, not for the side stream
    copied = simdist.now() - t0
    torch.cuda.synchronize()  # the whole device
    return copied, simdist.now() - t0


def test_a_blocking_copy_waits_for_its_own_stream_and_synchronize_for_every_stream():
    copied, synced = simdist.run(_blocking_copy_waits_for_its_stream_only, ONE, args=(1e-3,)).returns[0]
    into_pageable = H100.launch_overhead + 16 / (H100.host_link_bandwidth * PAGEABLE_SHARE)
    assert math.isclose(copied, into_pageable, rel_tol=1e-9)
    assert math.isclose(synced, 1e-3, rel_tol=1e-12)


def _stream_state():
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()
    before = torch.cuda.current_stream() == torch.cuda.default_stream()
    with torch.cuda.stream(side):
        inside = torch.cuda.current_stream() == side, torch.cuda.current_stream().stream_id
    after = torch.cuda.current_stream() == torch.cuda.default_stream()
    return before, inside, after, side.stream_id, torch.cuda.Stream().stream_id


def test_the_current_stream_follows_the_stream_context_and_streams_are_numbered_per_rank():
    first = simdist.run(_stream_state, simdist.Cluster.switch(2, device="H100"))
    assert first.returns == [(True, (True, 1), True, 1, 2)] * 2
    again = simdist.run(_fork_join, ONE, args=(1e-6, 2e-6, 3e-6, 4e-6)).trace.hash()
    assert simdist.run(_fork_join, ONE, args=(1e-6, 2e-6, 3e-6, 4e-6)).trace.hash() == again


# ---------------------------------------------------------------------------------------------- races
def _reads_a_side_streams_result(wait: str):
    torch.cuda.set_device(0)
    x = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x @ x  # SIDE_KERNEL
        z = y * 2  # the side stream itself may use its result
        done = side.record_event()
    if wait == "wait_stream":
        torch.cuda.current_stream().wait_stream(side)
    elif wait == "event":
        done.wait()
    elif wait == "event.synchronize":
        done.synchronize()
    elif wait == "stream.synchronize":
        side.synchronize()
    elif wait == "synchronize":
        torch.cuda.synchronize()
    total = y.sum()  # THE_READ
    return float(total + z.sum())


def test_memory_a_freed_or_moved_storage_had_is_not_mistaken_for_a_side_stream_kernels(monkeypatch):
    from simdist.comm import races

    detector = races.RaceDetector("warn", "nccl", lambda: 0.0)
    freed, moved, later = torch.ones(16), torch.ones(16), torch.zeros(16)
    at = {id(freed): races._memory(freed), id(moved): races._memory(moved)}
    detector.issue_on_stream(0, "aten.mul.Tensor", 1, "train.py:1", [freed, moved], [], done_at=1e-6)
    del freed  # its memory goes back to the allocator
    moved.untyped_storage().resize_(0)  # FSDP's free: the storage lives on, its memory does not
    moved.untyped_storage().resize_(64)
    real_memory = races._memory
    for old in at.values():
        # a later tensor the allocator placed where the kernel's input was
        monkeypatch.setattr(races, "_memory", lambda t, old=old: old if t is later else real_memory(t))
        detector.check_tensors(0, "aten.fill_.Scalar", later, True, lambda: "train.py:9")
    assert detector.races == []


def _line(marker: str) -> int:
    lines, first = inspect.getsourcelines(_reads_a_side_streams_result)
    return first + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.parametrize(
    "wait", ["wait_stream", "event", "event.synchronize", "stream.synchronize", "synchronize"]
)
def test_a_result_read_after_waiting_for_its_side_stream_is_no_race(wait):
    res = simdist.run(_reads_a_side_streams_result, ONE, args=(wait,), races="error")
    expected = simdist.run(_reads_a_side_streams_result, ONE, args=("none",), races="off").returns[0]
    assert res.returns[0] == expected and res.races == []


def test_a_result_read_without_waiting_for_its_side_stream_is_a_race_naming_both_lines():
    with pytest.raises(RaceError) as info:
        simdist.run(_reads_a_side_streams_result, ONE, args=("none",), races="error")
    text = str(info.value)
    assert f"test_cuda_streams.py:{_line('SIDE_KERNEL')}" in text
    assert f"test_cuda_streams.py:{_line('THE_READ')}" in text
    assert "aten.mm on side stream 1" in text and "on the default stream" in text and "wait_stream" in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", simdist.RaceWarning)
        res = simdist.run(_reads_a_side_streams_result, ONE, args=("none",), races="warn")
    # y's read, then z's (made on the side stream too, read on the default stream at the return)
    assert [(r.kind, r.first.op, r.first.stream) for r in res.races] == [
        ("access", "aten.mm", 1),
        ("access", "aten.mul.Tensor", 1),
    ]


def _two_side_streams(consumer_waits: bool):
    torch.cuda.set_device(0)
    x = torch.randn(64, 64, device="cuda")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    consumer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        y = x + 1
    if consumer_waits:
        consumer.wait_stream(producer)
    with torch.cuda.stream(consumer):
        z = y * 2
    torch.cuda.current_stream().wait_stream(consumer)
    # the default stream waited for the consumer, which (if it waited) had waited for the producer: waits are
    # transitive, so reading y here is ordered too
    return float((z - 2 * y).abs().max())


def test_waits_between_side_streams_are_transitive_and_a_side_stream_reading_another_unwaited_is_a_race():
    assert simdist.run(_two_side_streams, ONE, args=(True,), races="error").returns == [0.0]
    with pytest.raises(
        RaceError, match=r"read \(in aten.mul.Tensor on side stream 2\).*aten.add.Tensor on side stream 1"
    ):
        simdist.run(_two_side_streams, ONE, args=(False,), races="error")


def test_the_streams_example_in_the_docs_prints_what_the_docs_show(tmp_path, capsys):
    text = (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text()
    section = text[text.index("## Streams") :]
    code, shown = re.search(r"```python\n(.*?)```\n\n```\n(.*?)```", section, re.DOTALL).groups()
    script = tmp_path / "streams_example.py"
    script.write_text(code)
    runpy.run_path(str(script), run_name="streams_example")
    assert capsys.readouterr().out == shown


def _collective_on_a_side_stream(long: float, short: float):
    torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
    t = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    simdist.charge(long)  # the default stream is busy
    with torch.cuda.stream(side):
        simdist.charge(short)
        torch.distributed.all_reduce(t, async_op=True).wait()
    return t0


def test_a_collective_issued_on_a_side_stream_starts_when_that_stream_reaches_it():
    res = simdist.run(
        _collective_on_a_side_stream, simdist.Cluster.switch(2, device="H100"), args=(1e-3, 2e-6), races="off"
    )
    t0 = res.returns[0]
    (start,) = {s.start for s in res.trace.collectives() if s.rank == 0}
    assert math.isclose(start - t0, 2e-6, rel_tol=1e-9)


def _all_reduces_a_side_streams_result(wait: bool):
    torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
    side = torch.cuda.Stream()
    x = torch.ones(64, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grad = x * 2  # SIDE_GRAD
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    torch.distributed.all_reduce(grad)  # ALL_REDUCE
    return float(grad.sum())


def test_a_collective_issued_before_its_stream_waited_for_the_side_stream_that_wrote_its_buffer_is_a_race():
    pair = simdist.Cluster.switch(2, device="H100")
    assert (
        simdist.run(_all_reduces_a_side_streams_result, pair, args=(True,), races="error").returns
        == [256.0] * 2
    )
    with pytest.raises(RaceError) as info:
        simdist.run(_all_reduces_a_side_streams_result, pair, args=(False,), races="error")
    text = str(info.value)
    assert "wrote (in all_reduce #0 on group 0, issued on the default stream)" in text
    assert "aten.mul.Tensor on side stream 1" in text
    lines, first = inspect.getsourcelines(_all_reduces_a_side_streams_result)
    for marker in ("SIDE_GRAD", "ALL_REDUCE"):
        line = first + next(i for i, code in enumerate(lines) if marker in code)
        assert f"test_cuda_streams.py:{line}" in text


def _side_stream_in_a_backward_hook() -> None:
    """A backward hook (FSDP2's pre-backward all-gather copy-in, in miniature) runs an op on a side stream of the
    rank's own GPU."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    side = torch.cuda.Stream()
    x = torch.randn(64, 64, device="cuda", requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(side):
            torch.mm(grad, grad)
        return grad

    x.register_hook(hook)
    (x * 3).sum().backward()


def test_an_op_in_a_backward_hook_runs_on_its_devices_current_stream_on_every_gpu_of_a_node() -> None:
    """An op runs on the current stream of its tensors' device, on the first GPU of a node as on the others (the
    hook once found device 0's stream current on every GPU but the first: its matmul went to the default stream)."""
    res = simdist.run(_side_stream_in_a_backward_hook, simdist.Cluster.preset("dgx-h100", world_size=4))
    mms = [[s.stream for s in res.trace.spans if s.rank == r and s.name == "aten::mm"] for r in range(4)]
    assert mms == [["compute:stream1"]] * 4
