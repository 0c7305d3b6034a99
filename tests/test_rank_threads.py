"""Threads that rank code starts: when a rank finishes, that nothing of a run outlives it, nested runs."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import tqdm
from alpha_beta import all_reduce_seconds
from hypothesis import given
from hypothesis import strategies as st

import simdist

LAT = 5e-6
BW = 100e9
#: a ring of two CPU ranks whose all-reduces take the ring algorithm, for closed-form times
RING = simdist.Cluster.ring(2, bandwidth=BW, latency=LAT, device="cpu", algorithms={"all_reduce": "ring"})
NUMEL = 1024


def _thread_all_reduces(main: list[float], thread: list[float]) -> None:
    """The rank's thread charges ``thread[rank]`` seconds then all-reduces; the rank charges ``main[rank]``
    seconds and returns without joining it."""
    rank = dist.get_rank()

    def body() -> None:
        simdist.charge(thread[rank])
        dist.all_reduce(torch.ones(NUMEL))

    threading.Thread(target=body).start()
    simdist.charge(main[rank])


seconds = st.floats(0.0, 2.0, allow_nan=False).map(lambda s: round(s, 3))


@given(main=st.lists(seconds, min_size=2, max_size=2), thread=st.lists(seconds, min_size=2, max_size=2))
def test_a_rank_finishes_when_its_last_non_daemon_thread_does(main: list[float], thread: list[float]) -> None:
    """A process exits when its last non-daemon thread ends: so does a rank, at the closed-form time."""
    res = simdist.run(_thread_all_reduces, RING, args=(main, thread))
    # the all-reduce starts once both threads issued it, and takes the ring's closed-form time
    done = max(thread) + all_reduce_seconds("ring", 2, NUMEL * 4, LAT, 1 / BW)
    want = [max(m, done) for m in main]
    assert res.finish_times == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert res.sim_time == pytest.approx(max(want), rel=1e-9, abs=1e-12)


def _daemon_outlives_rank(main: float, daemon: float) -> None:
    def starts_another() -> None:  # a thread started by a daemon thread is a daemon too, as in a process
        threading.Thread(target=simdist.charge, args=(daemon,)).start()

    threading.Thread(target=simdist.charge, args=(daemon,), daemon=True).start()
    threading.Thread(target=starts_another, daemon=True).start()
    simdist.charge(main)
    dist.barrier()


@pytest.mark.parametrize("daemon", [0.5, 3.0])
def test_daemon_threads_do_not_hold_a_rank(daemon: float) -> None:
    """A daemon thread still running when its rank's function returns does not delay the rank's finish."""
    res = simdist.run(_daemon_outlives_rank, RING, args=(1.0, daemon), compute=False)
    barriers = [res.trace.collectives(r)[0].end for r in range(2)]
    assert res.finish_times == barriers
    assert all(1.0 < b < 1.001 for b in barriers)


def _queues_on_the_device(seconds: float) -> float:
    threading.Thread(target=simdist.charge, args=(seconds,)).start()
    return simdist.now()


def test_a_rank_on_a_gpu_finishes_when_its_threads_device_work_does() -> None:
    """On a GPU host that runs ahead, a thread's queued compute holds its rank until the device has run it."""
    res = simdist.run(_queues_on_the_device, simdist.Cluster.ring(2, device="H100"), args=(0.25,))
    assert res.returns == [0.0, 0.0]
    assert res.finish_times == [0.25, 0.25]


#: runs programs that each leave a thread stuck in C code (a lock), reports each run's error, then lists the
#: threads the runs left: the process must then exit at once
_LEFT_BEHIND = """
import threading, time
import torch.distributed as dist
import simdist
import simdist.clock.baton

simdist.clock.baton._UNWIND_GRACE = 0.5  # seconds an interrupted thread gets to unwind: keep the test short
locks = [threading.Lock() for _ in range(3)]
ran_after: list = []


def released_later():
    # the lock wait ends (after 2 s of wall-clock time) once the run has been reported
    def wait() -> None:
        locks[0].acquire(timeout=2)
        ran_after.append("the thread ran user code after the run")

    if dist.get_rank() == 0:
        locks[0].acquire()
        worker = threading.Thread(target=wait, name="released")
        worker.start()
        worker.join()
    dist.barrier()


def held_by_main():
    # the rank's thread waits for a lock its main thread holds and never releases
    if dist.get_rank() == 0:
        locks[1].acquire()
        worker = threading.Thread(target=locks[1].acquire, name="held")
        worker.start()
        worker.join()
    dist.barrier()


def stuck_while_unwinding():
    # rank 1 fails; rank 0, unwound from its barrier, blocks in its finally block
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    locks[2].acquire()
    try:
        dist.barrier()
    finally:
        locks[2].acquire()


before = set(threading.enumerate())
start = time.monotonic()
for fn in (released_later, held_by_main, stuck_while_unwinding):
    try:
        simdist.run(fn, simdist.Cluster.ring(2), watchdog=1.0)
    except simdist.SimdistError as e:
        print(fn.__name__, "reported", type(e).__name__, flush=True)
time.sleep(max(0.0, 3 - (time.monotonic() - start)))
left = [t for t in threading.enumerate() if t not in before]
print("non-daemon left", [t.name for t in left if not t.daemon])
print("released but alive", [t.name for t in left if t.name == "released"])
for line in ran_after:
    print(line)
"""


@pytest.mark.slow
def test_nothing_of_a_run_outlives_it() -> None:
    """After a run reports a thread stuck in C, no thread of it is non-daemon, none runs user code again (the
    one whose wait ends later unwinds at once), and the process exits at once."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _LEFT_BEHIND], check=False, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as e:
        printed = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
        pytest.fail(f"the process did not exit within 60 s; it printed:\n{printed}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "released_later reported WatchdogError",
        "held_by_main reported WatchdogError",
        "stuck_while_unwinding reported RankError",
        "non-daemon left []",
        "released but alive []",
    ], out.stdout + out.stderr[-3000:]


def _runs_inside() -> None:
    if dist.get_rank() == 1:
        simdist.run(lambda: None, simdist.Cluster.ring(2))  # the nested call
    dist.barrier()


def _runs_inside_a_thread() -> str:
    caught: list = []

    def body() -> None:
        try:
            _runs_inside()
        except simdist.SimdistError as e:
            caught.append(str(e))
            dist.barrier()

    th = threading.Thread(target=body, name="nester")
    th.start()
    th.join()
    if caught:
        raise simdist.SimdistError(caught[0])


@pytest.mark.parametrize(
    "fn,who", [(_runs_inside, "rank 1"), (_runs_inside_a_thread, "rank 1 (its thread 'nester')")]
)
def test_a_nested_run_names_the_rank_and_its_call_site(fn: Callable[[], None], who: str) -> None:
    """The error names the rank (and its thread), the line of the nested call and what to do instead."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.endswith("# the nested call"))
    with pytest.raises(simdist.SimdistError) as info:
        simdist.run(fn, RING)
    text = str(info.value)
    site = f"{__file__}:{line} in _runs_inside"
    assert text.startswith(f"{who} called simdist.run at {site}, inside a simulated run"), text
    assert "call simdist.run from plain Python" in text, text


def _with_a_progress_bar() -> int:
    total = 0
    for i in tqdm.tqdm(range(3), file=io.StringIO()):
        total += i
    dist.barrier()
    return total


def test_rank_code_with_a_tqdm_progress_bar_runs_and_tqdm_is_restored() -> None:
    # tqdm's monitor thread, started by the first bar, waits in wall-clock time: in a rank it kept the rank's turn
    # until the watchdog stopped the run
    before = tqdm.std.tqdm.monitor_interval
    res = simdist.run(_with_a_progress_bar, simdist.Cluster.switch(2, device="cpu"), watchdog=5)
    assert res.returns == [3, 3]
    assert tqdm.std.tqdm.monitor_interval == before


_THREAD_COUNTS = r"""
import ctypes, re, threading
import torch
import simdist

# OpenMP's own count for the calling thread (MKL's follows it in torch's set_num_threads), read without torch:
# torch.get_num_threads() would set the thread's count first
maps = open("/proc/self/maps").read().split()
omp = ctypes.CDLL(next(p for p in maps if re.search(r"/lib(g|i)?omp[^/]*\.so", p)))

def counts():
    seen = [omp.omp_get_max_threads()]
    t = threading.Thread(target=lambda: seen.append(omp.omp_get_max_threads()))
    t.start()
    t.join()
    return seen

before = torch.get_num_threads()
print("a new thread outside a run", counts()[1])
print("in a run", simdist.run(counts, simdist.Cluster.ring(2)).returns)
print("torch's count after it as before it", torch.get_num_threads() == before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds OpenMP's library in /proc/self/maps")
def test_rank_threads_run_torch_with_the_runs_intra_op_thread_count() -> None:
    """A run sets torch's intra-op count to one; a thread of rank code gets it too. Without that, MKL's count,
    kept per thread, would be the environment's (here four) until the thread's first parallel region, and a
    small matmul in a rank would run four threads on the one CPU a run is pinned to."""
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    env.pop("MKL_NUM_THREADS", None)
    out = subprocess.run(
        [sys.executable, "-c", _THREAD_COUNTS],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "a new thread outside a run 4",  # what a thread starts with: the check can tell
        "in a run [[1, 1], [1, 1]]",  # each rank's thread and the thread it starts
        "torch's count after it as before it True",
    ], out.stdout + out.stderr[-3000:]
