"""Hostile rank programs: endless loops, shared arguments, stray threads, futures' callbacks, odd exceptions,
concurrent runs, huge worlds."""

from __future__ import annotations

import math
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import tqdm
from hostile_cases import Case, check, params

import simdist
import simdist.clock.baton
import simdist.options

RING2 = simdist.Cluster.ring(2)


def _expect_all(value: float):
    """Oracle: every rank returns its own tensor, all equal to ``value``."""

    def check_(result: simdist.RunResult) -> None:
        for r in result.returns:
            assert torch.equal(r, torch.full_like(r, value)), result.returns
        storages = {r.untyped_storage().data_ptr() for r in result.returns}
        assert len(storages) == len(result.returns), "ranks returned one shared buffer"

    return check_



def _seeded_length_all_reduce() -> int:
    """Correct on real processes: every rank draws the same length from identically seeded generators."""
    random.seed(7)
    np.random.seed(7)
    dist.barrier()
    t = torch.ones(random.randint(1, 9) + int(np.random.randint(0, 9)))
    dist.all_reduce(t)
    return t.numel()

# --------------------------------------------------------------------------- arguments
def _add_then_all_reduce(t: torch.Tensor) -> torch.Tensor:
    t.add_(1)
    dist.all_reduce(t)
    return t


def _kw_list_append(log: list) -> list:
    log.append(dist.get_rank())
    return log


class _Uncopyable:
    def __deepcopy__(self, memo: dict) -> None:
        raise TypeError("this object holds a socket")


# --------------------------------------------------------------------------- never hands over
def _spins_forever() -> None:
    if dist.get_rank() == 1:
        while True:
            pass
    dist.barrier()


#: ends the spinning of _spins_catching_everything once its case has been checked: a thread that swallows every
#: interrupt cannot be stopped from outside, and would spin on for the rest of the test session
_STOP_SPINNING = threading.Event()


def _spins_catching_everything() -> None:
    if dist.get_rank() == 0:
        while not _STOP_SPINNING.is_set():
            try:
                while not _STOP_SPINNING.is_set():
                    pass
            except BaseException:  # noqa: BLE001, S110 - a hostile program swallows even the interrupt
                pass
    dist.barrier()


def _run_spinner_then_stop_it() -> None:
    _STOP_SPINNING.clear()
    try:
        simdist.run(_spins_catching_everything, RING2, watchdog=1.0)
    finally:
        _STOP_SPINNING.set()


def _blocks_in_c() -> None:
    if dist.get_rank() == 0:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire(timeout=4)  # C code: the interrupt lands when it returns
    dist.barrier()


def _sleeps() -> float:
    time.sleep(2.5 if dist.get_rank() else 0.5)
    dist.barrier()
    return simdist.now()


def _heartbeat_thread() -> int:
    beats: list = []

    def beat() -> None:
        while True:
            time.sleep(1.0)
            beats.append(simdist.now())

    threading.Thread(target=beat, daemon=True).start()
    time.sleep(10.5)
    return len(beats)


def _forgotten_thread() -> None:
    threading.Thread(target=dist.barrier).start()  # non-daemon, its barrier never matched by the other rank


def _threads_deadlock_on_locks(locks: list, ran_on: list) -> None:
    def take(first: threading.Lock, second: threading.Lock) -> None:
        first.acquire()
        time.sleep(0.1)  # simulated time: the other thread runs and takes its first lock
        second.acquire()
        ran_on.append(threading.current_thread().name)

    if dist.get_rank() == 0:
        a = threading.Thread(target=take, args=(locks[0], locks[1]), name="a-then-b")
        b = threading.Thread(target=take, args=(locks[1], locks[0]), name="b-then-a")
        a.start()
        b.start()
        a.join()
        b.join()
    dist.barrier()


def _run_lock_deadlock_then_release() -> tuple:
    """The run's error, the non-daemon threads it left, and what its stuck thread does once freed."""
    locks, ran_on = [threading.Lock(), threading.Lock()], []
    before = set(threading.enumerate())
    grace, simdist.clock.baton._UNWIND_GRACE = simdist.clock.baton._UNWIND_GRACE, 0.5
    try:
        simdist.run(_threads_deadlock_on_locks, RING2, args=(locks, ran_on), copy_args=False, watchdog=1.0)
    except simdist.WatchdogError as e:
        error = str(e)
    finally:
        simdist.clock.baton._UNWIND_GRACE = grace
    left = [t for t in threading.enumerate() if t not in before]
    non_daemon = [t.name for t in left if not t.daemon]
    for lock in locks:  # what a process's exit would do to the stuck thread: it must not run on
        if lock.locked():
            lock.release()
    for t in left:
        t.join(timeout=10)
    return error, non_daemon, [t.name for t in left if t.is_alive()], ran_on


def _check_lock_deadlock(result: tuple) -> None:
    error, non_daemon, alive, ran_on = result
    assert re.search(r"(?s)rank 0 \(its thread 'a-then-b'\) ran for .*second\.acquire\(\)", error), error
    assert (non_daemon, alive, ran_on) == ([], [], []), result


def _thread_start_refused() -> str:
    # what Python raises when the OS has no thread left to give
    name = "_start_new_thread" if hasattr(threading, "_start_new_thread") else "_start_joinable_thread"
    start = getattr(threading, name)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("can't start new thread")

    setattr(threading, name, refuse)
    try:
        threading.Thread(target=dist.barrier).start()
    except RuntimeError as e:
        refused = str(e)
    finally:
        setattr(threading, name, start)
    dist.barrier()
    return refused


def _waits_for_own_thread_event() -> None:
    done = threading.Event()
    threading.Thread(target=done.set).start()
    done.wait(3)  # the thread runs only once this rank hands over, which waiting on a threading.Event never does
    if not done.is_set():
        raise RuntimeError("never set")


# --------------------------------------------------------------------------- threads of a rank
def _collective_in_thread() -> dict:
    out: dict = {}

    def body() -> None:
        t = torch.full((3,), float(dist.get_rank() + 1))
        out["rank"], out["world"] = dist.get_rank(), dist.get_world_size()
        out["env"] = __import__("os").environ["RANK"]
        dist.all_reduce(t)
        out["t"] = t

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return out


def _check_thread_result(result: simdist.RunResult) -> None:
    for rank, out in enumerate(result.returns):
        assert (out["rank"], out["world"], out["env"]) == (rank, 2, str(rank))
        assert torch.equal(out["t"], torch.full((3,), 3.0))


def _thread_outlives_rank_function() -> None:
    def late() -> None:
        simdist.charge(1.0)
        dist.all_reduce(torch.ones(4))

    threading.Thread(target=late).start()  # non-daemon, never joined: the process exits when it ends


def _check_finish_after_thread(result: simdist.RunResult) -> None:
    ends = [result.trace.collectives(r)[0].end for r in range(2)]
    assert min(ends) > 1.0, ends
    assert result.finish_times == ends and result.sim_time == max(ends), (result.finish_times, ends)


def _rng_shared_with_thread() -> list:
    torch.manual_seed(dist.get_rank())
    drawn: list = []
    th = threading.Thread(target=lambda: drawn.append(torch.rand(2)))
    th.start()
    th.join()
    drawn.append(torch.rand(2))
    return drawn


def _check_rng(result: simdist.RunResult) -> None:
    for rank, drawn in enumerate(result.returns):
        g = torch.Generator().manual_seed(rank)  # one RNG per process: the thread draws first, then the rank
        assert torch.equal(drawn[0], torch.rand(2, generator=g)) and torch.equal(drawn[1], torch.rand(2, generator=g))


def _thread_and_rank_overlap() -> list:
    """The thread's all-reduce and the rank's own run in issue order on one group, as on one process."""
    order: list = []
    a = torch.ones(2)

    def body() -> None:
        dist.all_reduce(a)
        order.append("thread")

    th = threading.Thread(target=body)
    th.start()
    dist.barrier()
    order.append("rank")
    th.join()
    return [order, a]


def _check_overlap(result: simdist.RunResult) -> None:
    for order, a in result.returns:
        assert sorted(order) == ["rank", "thread"] and torch.equal(a, torch.full((2,), 2.0)), result.returns
    assert result.returns[0][0] == result.returns[1][0]


def _thread_raises() -> str:
    def bad() -> None:
        raise ValueError("thread boom")

    th = threading.Thread(target=bad)
    th.start()
    th.join()
    return "rank survived"


def _thread_raises_seen_by_excepthook() -> tuple:
    seen: list = []
    old = threading.excepthook
    threading.excepthook = lambda a: seen.append((a.exc_type, traceback.extract_tb(a.exc_traceback)[0].name))
    try:
        result = simdist.run(_thread_raises, RING2)
    finally:
        threading.excepthook = old
    return result.returns, seen


# --------------------------------------------------------------------------- futures
def _then_issues_collective() -> torch.Tensor:
    t = torch.full((4,), float(dist.get_rank() + 1))

    def second(fut: torch.futures.Future) -> torch.Tensor:
        (x,) = fut.value()
        dist.all_reduce(x)  # a collective inside a callback, waited there
        return x * 10

    return dist.all_reduce(t, async_op=True).get_future().then(second).wait()


def _chain_of_then() -> torch.Tensor:
    t = torch.full((2,), float(dist.get_rank()))
    fut = dist.all_reduce(t, async_op=True).get_future()
    fut = fut.then(lambda f: dist.all_reduce(f.value()[0], async_op=True).get_future().wait()[0] + 1)
    fut = fut.then(lambda f: f.value() * 2)
    return fut.wait()


# --------------------------------------------------------------------------- odd exceptions
class _BadStr(Exception):
    def __str__(self) -> str:
        raise ValueError("no text for you")


def _raises_bad_str() -> None:
    if dist.get_rank() == 1:
        raise _BadStr()
    dist.barrier()


def _raises_system_exit() -> None:
    if dist.get_rank() == 0:
        raise SystemExit(3)
    dist.barrier()


def _raises_keyboard_interrupt() -> None:
    if dist.get_rank() == 1:
        raise KeyboardInterrupt
    dist.barrier()


def _skips_one(n: int):
    def fn() -> None:
        t = torch.ones(2)
        if dist.get_rank() != n - 7:
            dist.all_reduce(t)

    return fn


def _mismatch_one(n: int):
    def fn() -> None:
        dtype = torch.float64 if dist.get_rank() == n - 3 else torch.float32
        dist.all_reduce(torch.ones(2, dtype=dtype))

    return fn


def _os_exit() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _installs_signal_handler() -> tuple:
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    return previous, callable(signal.getsignal(signal.SIGTERM))


def _default_dtype_per_rank() -> list:
    if dist.get_rank() == 0:
        torch.set_default_dtype(torch.float64)
    dist.barrier()  # rank 1 runs between rank 0's change and its next line
    return [torch.ones(1).dtype, torch.get_default_dtype()]


def _tf32_per_rank() -> list:
    if dist.get_rank() == 0:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")
    dist.barrier()  # rank 1 reads its switches between rank 0's change and its return
    return [torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()]


async def _async_step() -> None:
    dist.barrier()


def _generator_step():
    dist.barrier()
    yield


def _nested_run() -> None:
    simdist.run(lambda: None, RING2)


def _concurrent_runs(tmp: pathlib.Path) -> list:
    results: list = [None] * 4
    errors: list = []
    path = tmp / "ring2.json"
    RING2.save(path)

    def go(i: int) -> None:
        try:
            cluster = str(path) if i % 2 else RING2
            results[i] = simdist.run(_add_then_all_reduce, cluster, args=(torch.full((2,), float(i)),))
        except BaseException as e:  # noqa: BLE001 - collected for the check
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    return results


def _check_concurrent(results: list) -> None:
    for i, r in enumerate(results):
        for t in r.returns:
            assert torch.equal(t, torch.full((2,), 2.0 * (i + 1)))


def _seeds_from_the_clock() -> tuple[float, str]:
    """Seeds its generator from the wall clock and names its run directory by the date, as many scripts do."""
    random.seed(time.time())
    return random.random(), time.strftime("runs/%Y%m%d-%H%M%S")


def _same_twice(result: tuple[simdist.RunResult, simdist.RunResult]) -> None:
    first, second = result
    assert first.returns == second.returns and first.trace_hash == second.trace_hash


def _equal(got: list, expected: list) -> None:
    assert got == expected, got


def _trains_with_a_progress_bar() -> float:
    """Wraps its loop in a tqdm bar, as most training scripts do (tqdm starts its monitor thread)."""
    total = torch.zeros(1)
    for _ in tqdm.tqdm(range(4), desc=f"rank {dist.get_rank()}", disable=False, file=sys.stderr):
        dist.all_reduce(t := torch.ones(1))
        total += t
    return total.item()


def _sums_uninitialised_memory() -> float:
    """Reads a buffer it never wrote (a forgotten zeros), reduced across ranks."""
    acc = torch.empty(16)
    acc += torch.ones(16)
    dist.all_reduce(acc)
    return acc.sum().item()


def _nan_twice(result: tuple[simdist.RunResult, simdist.RunResult]) -> None:
    first, second = result
    assert first.trace_hash == second.trace_hash
    assert all(math.isnan(v) for v in first.returns + second.returns), (first.returns, second.returns)


CASES: list[Case] = [
    Case(
        "arg-copied-per-rank",
        "add_ then in-place all_reduce on a tensor passed to every rank through args=",
        lambda: simdist.run(_add_then_all_reduce, RING2, args=(torch.ones(4),)),
        check=_expect_all(4.0),
    ),
    Case(
        "kwargs-copied-per-rank",
        "every rank appends to one list passed through kwargs=",
        lambda: simdist.run(_kw_list_append, RING2, kwargs={"log": []}),
        check=lambda r: r.returns == [[0], [1]] or pytest.fail(str(r.returns)),
    ),
    Case(
        "arg-uncopyable",
        "an argument that cannot be deep-copied",
        lambda: simdist.run(lambda x: None, RING2, args=(_Uncopyable(),)),
        error=simdist.SimdistError,
        match=r"rank 0: could not copy the arguments.*copy_args=False",
    ),
    Case(
        "arg-shared-opt-out",
        "copy_args=False shares one read-only tensor among the ranks",
        lambda: simdist.run(lambda t: t, RING2, args=(torch.ones(2),), copy_args=False),
        check=lambda r: r.returns[0] is r.returns[1] or pytest.fail("not shared"),
    ),
    Case(
        "while-true",
        "a rank spins in `while True: pass` and never communicates",
        lambda: simdist.run(_spins_forever, RING2, watchdog=1.0),
        error=simdist.WatchdogError,
        match=r"(?s)rank 1 ran for .* without communicating.*in _spins_forever\n\s+while True:",
    ),
    Case(
        "while-true-swallows-interrupt",
        "a spinning rank catches BaseException and spins on",
        _run_spinner_then_stop_it,
        error=simdist.WatchdogError,
        match=r"rank 0 ran for",
        slow=True,
    ),
    Case(
        "long-c-call",
        "a rank blocks 4 s of wall-clock time in C code (a lock it holds itself)",
        lambda: simdist.run(_blocks_in_c, RING2, watchdog=1.0),
        error=simdist.WatchdogError,
        match=r"(?s)rank 0 ran for.*lock\.acquire\(timeout=4\)",
        slow=True,
    ),
    Case(
        "time-sleep",
        "ranks call time.sleep (0.5 s and 2.5 s) before a barrier",
        lambda: simdist.run(_sleeps, RING2, compute=False),
        check=lambda r: all(2.5 <= x < 2.6 for x in r.returns) or pytest.fail(str(r.returns)),
    ),
    Case(
        "heartbeat-daemon-thread",
        "a rank starts a daemon heartbeat thread that sleeps 1 s in a loop forever",
        lambda: simdist.run(_heartbeat_thread, RING2, compute=False),
        check=lambda r: r.returns == [10, 10] or pytest.fail(str(r.returns)),
    ),
    Case(
        "forgotten-foreground-thread",
        "rank 0's non-daemon thread waits in a barrier nobody else enters (the process would never exit)",
        lambda: simdist.run(lambda: _forgotten_thread() if dist.get_rank() == 0 else None, RING2),
        error=simdist.DeadlockError,
        match=r"rank 0, its thread 'Thread-\d+ \(barrier\)': .*barrier",
    ),
    Case(
        "thread-lock-deadlock",
        "two threads of a rank each hold a threading.Lock the other wants (taken without `with`, kept)",
        _run_lock_deadlock_then_release,
        check=_check_lock_deadlock,
        slow=True,
    ),
    Case(
        "thread-start-refused",
        "Thread.start in rank code raises (the OS has no thread to give); the rank catches it and goes on",
        lambda: simdist.run(_thread_start_refused, RING2, watchdog=5.0),
        check=lambda r: r.returns == ["can't start new thread"] * 2 or pytest.fail(str(r.returns)),
    ),
    Case(
        "thread-event-of-same-rank",
        "a rank waits on a threading.Event its own thread would set",
        lambda: simdist.run(_waits_for_own_thread_event, RING2, watchdog=1.0),
        error=simdist.WatchdogError,
        match=r"(?s)another thread of the same rank.*done\.wait",
        slow=True,
    ),
    Case(
        "watchdog-bad-value",
        "watchdog=-1",
        lambda: simdist.run(lambda: None, RING2, watchdog=-1),
        error=simdist.SimdistError,
        match=r"watchdog=-1: expected a positive number",
    ),
    Case(
        "thread-collective",
        "a rank starts a threading.Thread that calls get_rank, reads RANK and all-reduces",
        lambda: simdist.run(_collective_in_thread, RING2),
        check=_check_thread_result,
    ),
    Case(
        "thread-outlives-rank-function",
        "a rank starts a non-daemon thread that all-reduces at 1 s of simulated time, and returns at once",
        lambda: simdist.run(_thread_outlives_rank_function, RING2, compute=False),
        check=_check_finish_after_thread,
    ),
    Case(
        "thread-rng",
        "a rank and its thread draw from torch's global RNG",
        lambda: simdist.run(_rng_shared_with_thread, RING2),
        check=_check_rng,
    ),
    Case(
        "thread-and-rank-collectives",
        "a rank's thread all-reduces while the rank itself enters a barrier",
        lambda: simdist.run(_thread_and_rank_overlap, RING2),
        check=_check_overlap,
    ),
    Case(
        "thread-raises",
        "a thread the rank started raises ValueError",
        _thread_raises_seen_by_excepthook,
        check=lambda r: r == (["rank survived"] * 2, [(ValueError, "bad")] * 2) or pytest.fail(str(r)),
    ),
    Case(
        "then-callback-collective",
        "a future's then() callback issues an all_reduce and waits on it",
        lambda: simdist.run(_then_issues_collective, simdist.Cluster.switch(4)),
        check=lambda r: all(torch.equal(t, torch.full((4,), 400.0)) for t in r.returns) or pytest.fail(str(r.returns)),
    ),
    Case(
        "then-chain",
        "a chain of then() callbacks, the first waiting on a collective's future",
        lambda: simdist.run(_chain_of_then, simdist.Cluster.switch(3)),
        check=lambda r: all(torch.equal(t, torch.full((2,), 2.0 * (3 * 3 + 1))) for t in r.returns)
        or pytest.fail(str(r.returns)),
    ),
    Case(
        "exception-str-raises",
        "a rank raises an exception whose __str__ raises",
        lambda: simdist.run(_raises_bad_str, RING2),
        error=simdist.RankError,
        match=r"rank 1 raised _BadStr: <_BadStr.__str__ raised>",
    ),
    Case(
        "system-exit",
        "a rank calls sys.exit(3)",
        lambda: simdist.run(_raises_system_exit, RING2),
        error=simdist.RankError,
        match=r"rank 0 raised SystemExit: 3",
    ),
    Case(
        "keyboard-interrupt",
        "a rank raises KeyboardInterrupt",
        lambda: simdist.run(_raises_keyboard_interrupt, RING2),
        error=simdist.RankError,
        match=r"rank 1 raised KeyboardInterrupt",
    ),
    Case(
        "deadlock-1024",
        "one rank of 1,024 skips an all-reduce",
        lambda: simdist.run(_skips_one(1024), simdist.Cluster.switch(1024), compute=False),
        error=simdist.DeadlockError,
        match=r"never issued by rank 1017; issued by ranks 0-1016, 1018-1023\n",
        slow=True,
    ),
    Case(
        "mismatch-1024",
        "one rank of 1,024 all-reduces float64, the others float32",
        lambda: simdist.run(_mismatch_one(1024), simdist.Cluster.switch(1024), compute=False),
        error=simdist.CollectiveMismatchError,
        match=r"rank 1021: all_reduce\(shape=\(2,\), dtype=float64.*\n  ranks 0-1020, 1022-1023: all_reduce",
        slow=True,
    ),
    Case(
        "os-exit",
        "a rank calls os._exit(3), which would end the whole simulator process",
        lambda: simdist.run(_os_exit, RING2),
        error=simdist.RankError,
        match=r"rank 1 raised RankExit: os\._exit\(3\)",
    ),
    Case(
        "signal-handler",
        "rank code installs a SIGTERM handler (allowed in a process's main thread, refused in other threads)",
        lambda: simdist.run(_installs_signal_handler, RING2),
        check=lambda r: (r.returns == [(signal.SIG_DFL, True)] * 2 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        or pytest.fail(str(r.returns)),
    ),
    Case(
        "default-dtype-per-rank",
        "rank 0 calls torch.set_default_dtype(torch.float64); rank 1 creates tensors meanwhile",
        lambda: simdist.run(_default_dtype_per_rank, RING2),
        check=lambda r: (r.returns == [[torch.float64] * 2, [torch.float32] * 2] and torch.get_default_dtype() == torch.float32)
        or pytest.fail(str(r.returns)),
    ),
    Case(
        "tf32-per-rank",
        "rank 0 allows TF32 and sets float32 matmul precision 'medium'; rank 1 reads its own switches meanwhile",
        lambda: simdist.run(_tf32_per_rank, RING2),
        check=lambda r: (
            r.returns == [[True, "medium"], [False, "highest"]]
            and (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == (False, "highest")
        )
        or pytest.fail(str(r.returns)),
    ),
    Case(
        "async-function",
        "an `async def` step passed to simdist.run (its body would never run)",
        lambda: simdist.run(_async_step, RING2),
        error=simdist.RunArgumentError,
        match=r"_async_step is an async function",
    ),
    Case(
        "generator-function",
        "a generator function passed to simdist.run (its body would never run)",
        lambda: simdist.run(_generator_step, RING2),
        error=simdist.RunArgumentError,
        match=r"_generator_step is a generator function",
    ),
    Case(
        "not-callable",
        "simdist.run(5, cluster)",
        lambda: simdist.run(5, RING2),
        error=simdist.RunArgumentError,
        match=r"needs a function to run on every rank; got int",
    ),
    Case(
        "args-not-a-tuple",
        "args=torch.ones(3) instead of args=(torch.ones(3),) (a tensor would be unpacked row by row)",
        lambda: simdist.run(lambda *a: len(a), RING2, args=torch.ones(3)),
        error=simdist.RunArgumentError,
        match=r"args must be a tuple.*args=\(x,\)",
    ),
    Case(
        "kwargs-not-a-dict",
        "kwargs=[1]",
        lambda: simdist.run(lambda: None, RING2, kwargs=[1]),
        error=simdist.RunArgumentError,
        match=r"kwargs must be a dict",
    ),
    Case(
        "seed-too-large",
        "seed=2**70",
        lambda: simdist.run(lambda: None, RING2, seed=2**70),
        error=simdist.RunArgumentError,
        match=r"seed must be an int from -2\*\*63 to 2\*\*64 - 1",
    ),
    Case(
        "seed-string",
        "seed='1'",
        lambda: simdist.run(lambda: None, RING2, seed="1"),
        error=simdist.RunArgumentError,
        match=r"seed must be an int.*got '1'",
    ),
    Case(
        "seed-negative",
        "seed=-1 (torch.manual_seed accepts it: the same run as seed 2**64 - 1)",
        lambda: (
            simdist.run(lambda: torch.rand(2), RING2, seed=-1).returns,
            simdist.run(lambda: torch.rand(2), RING2, seed=2**64 - 1).returns,
        ),
        check=lambda r: (
            all(torch.equal(a, b) for a, b in zip(*r)) and not torch.equal(r[0][0], r[0][1])
        ) or pytest.fail(str(r)),
    ),
    Case(
        "memory-off-string",
        "memory='off' (a truthy string)",
        lambda: simdist.run(lambda: None, RING2, memory="off"),
        error=simdist.RunArgumentError,
        match=r"memory must be True or False, got str 'off'",
    ),
    Case(
        "ranks-seed-random-alike",
        "every rank seeds Python's random and NumPy alike, then draws a tensor length after a barrier",
        lambda: simdist.run(_seeded_length_all_reduce, simdist.Cluster.ring(3)),
        check=lambda r: r.returns == [r.returns[0]] * 3 or pytest.fail(str(r.returns)),
    ),
    Case(
        "unseeded-ranks-differ",
        "an unseeded program draws torch, random and NumPy numbers on every rank (processes start unseeded)",
        lambda: simdist.run(lambda: (torch.rand(1).item(), random.random(), float(np.random.rand())), RING2),
        check=lambda r: all(a != b for a, b in zip(*r.returns)) or pytest.fail(str(r.returns)),
    ),
    Case(
        "progress-typo",
        "progress='NCCL'",
        lambda: simdist.run(lambda: None, RING2, progress="NCCL"),
        error=simdist.RunArgumentError,
        match=r"progress must be one of \('nccl', 'gloo'\), got 'NCCL'",
    ),
    Case(
        "gloo-threads-absurd",
        "gloo_threads=10**9",
        lambda: simdist.run(lambda: None, RING2, progress="gloo", gloo_threads=10**9),
        error=simdist.RunArgumentError,
        match=r"gloo_threads must be an int from 1 to 1024",
    ),
    Case(
        "races-typo",
        "races='maybe'",
        lambda: simdist.run(lambda: None, RING2, races="maybe"),
        error=simdist.RunArgumentError,
        match=r"races must be one of",
    ),
    Case(
        "trace-typo",
        "trace='all'",
        lambda: simdist.run(lambda: None, RING2, trace="all"),
        error=simdist.RunArgumentError,
        match=r"trace must be one of \(.messages., .collectives.\), got .all.",
    ),
    Case(
        "nested-run",
        "rank code calls simdist.run",
        lambda: simdist.run(_nested_run, RING2),
        error=simdist.SimdistError,
        match=r"^rank 0 called simdist.run at .*test_hostile_programs.py:\d+ in _nested_run, inside a "
        r"simulated run: runs cannot be nested .*call simdist.run from plain Python outside rank code",
    ),
    Case(
        "concurrent-runs",
        "four simdist.run calls at once from four Python threads, clusters given as objects and as files",
        lambda: _concurrent_runs(pathlib.Path(tempfile.mkdtemp())),
        check=_check_concurrent,
    ),
    Case(
        "reads_uninitialised_memory",
        "accumulates into torch.empty instead of torch.zeros and all-reduces it, in two runs",
        lambda: (simdist.run(_sums_uninitialised_memory, RING2), simdist.run(_sums_uninitialised_memory, RING2)),
        check=_nan_twice,
    ),
    Case(
        "tqdm_progress_bar",
        "wraps its training loop in a tqdm progress bar (a watchdog limit of 5 s)",
        lambda: simdist.run(_trains_with_a_progress_bar, RING2, watchdog=5),
        check=lambda res: _equal(res.returns, [8.0, 8.0]),
    ),
    Case(
        "seeds_from_the_clock",
        "seeds random from time.time() and names its run directory by time.strftime, in two runs",
        lambda: (
            simdist.run(_seeds_from_the_clock, RING2),
            time.sleep(0.01),
            simdist.run(_seeds_from_the_clock, RING2),
        )[::2],
        check=_same_twice,
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)


def test_watchdog_unwinds_every_thread() -> None:
    """After a watchdog stop no rank thread is left running, and the next run works."""
    before = threading.active_count()
    with pytest.raises(simdist.WatchdogError):
        simdist.run(_spins_forever, simdist.Cluster.switch(4), watchdog=0.5)
    assert threading.active_count() == before
    assert simdist.run(_add_then_all_reduce, RING2, args=(torch.ones(1),)).returns[0].item() == 4.0


def test_watchdog_default_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$SIMDIST_WATCHDOG sets the limit; inf turns it off; a bad value is a clear error."""
    monkeypatch.setenv("SIMDIST_WATCHDOG", "0.5")
    with pytest.raises(simdist.WatchdogError, match=r"watchdog limit 0.5 s"):
        simdist.run(_spins_forever, RING2)
    monkeypatch.setenv("SIMDIST_WATCHDOG", "soon")
    with pytest.raises(simdist.SimdistError, match=r"\$SIMDIST_WATCHDOG='soon'"):
        simdist.run(lambda: None, RING2)
    monkeypatch.setenv("SIMDIST_WATCHDOG", "inf")
    assert simdist.run(_sleeps_briefly, RING2).returns == [None, None]
    assert not math.isinf(simdist.options.WATCHDOG_PYTEST)


def _sleeps_briefly() -> None:
    time.sleep(0.01)
    dist.barrier()


_TRACED_CALL_AFTER_WATCHDOG = """
import sys, threading
import torch.distributed as dist
import simdist
import simdist.clock.baton

simdist.clock.baton._UNWIND_GRACE = 1.5  # seconds an interrupted thread gets to unwind: keep the test short

def spins():
    if dist.get_rank() == 1:
        while True:
            pass
    dist.barrier()

def blocks_in_c():
    if dist.get_rank() == 0:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire(timeout=float(sys.argv[1]))
    dist.barrier()

for fn in (spins, blocks_in_c):
    try:
        simdist.run(fn, simdist.Cluster.ring(2), watchdog=0.5)
    except simdist.WatchdogError:
        pass
sys.settrace(lambda *a: None)  # as hypothesis and coverage do
(lambda: None)()
print("traced call returned")
"""


@pytest.mark.slow
# blocked in C past the 0.5 s watchdog: unwound within the 1.5 s grace period, or abandoned
@pytest.mark.parametrize("c_seconds", [1.2, 4])
def test_a_watchdog_stop_leaves_no_interrupt_pending(c_seconds: float) -> None:
    """After the watchdog interrupts a rank (or gives up on one stuck in C), traced Python calls still return."""
    out = subprocess.run(
        [sys.executable, "-c", _TRACED_CALL_AFTER_WATCHDOG, str(c_seconds)],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert "traced call returned" in out.stdout, out.stderr[-2000:]
