"""Hostile rank programs: endless loops, shared arguments, stray threads, futures' callbacks, odd exceptions,
concurrent runs, huge worlds."""

from __future__ import annotations

import math
import pathlib
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist

RING2 = simdist.Cluster.ring(2)


def _expect_all(value: float):
    """Oracle: every rank returns its own tensor, all equal to ``value``."""

    def check_(result: simdist.RunResult) -> None:
        for r in result.returns:
            assert torch.equal(r, torch.full_like(r, value)), result.returns
        storages = {r.untyped_storage().data_ptr() for r in result.returns}
        assert len(storages) == len(result.returns), "ranks returned one shared buffer"

    return check_


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


def _spins_catching_everything() -> None:
    if dist.get_rank() == 0:
        while True:
            try:
                while True:
                    pass
            except BaseException:  # noqa: BLE001, S110 - a hostile program swallows even the interrupt
                pass
    dist.barrier()


def _sleeps_in_c() -> None:
    if dist.get_rank() == 0:
        time.sleep(4)  # C code: the interrupt lands when it returns
    dist.barrier()


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
        lambda: simdist.run(_spins_catching_everything, RING2, watchdog=1.0),
        error=simdist.WatchdogError,
        match=r"rank 0 ran for",
        slow=True,
    ),
    Case(
        "long-c-call",
        "a rank sleeps 4 s of wall-clock time in C code",
        lambda: simdist.run(_sleeps_in_c, RING2, watchdog=1.0),
        error=simdist.WatchdogError,
        match=r"(?s)rank 0 ran for.*time\.sleep",
        slow=True,
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
        "nested-run",
        "rank code calls simdist.run",
        lambda: simdist.run(_nested_run, RING2),
        error=simdist.SimdistError,
        match=r"cannot be nested inside another simulated run \(it was called by a rank\)",
    ),
    Case(
        "concurrent-runs",
        "four simdist.run calls at once from four Python threads, clusters given as objects and as files",
        lambda: _concurrent_runs(pathlib.Path(tempfile.mkdtemp())),
        check=_check_concurrent,
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
    assert not math.isinf(simdist.engine.runner.WATCHDOG_PYTEST)


def _sleeps_briefly() -> None:
    time.sleep(0.01)
    dist.barrier()
