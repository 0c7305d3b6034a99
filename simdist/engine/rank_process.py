"""What rank code reads of its own process, one per rank as one per process in a real launch: the clock, the
process id and the command line.

- The clock: ``time.time()``, ``time.perf_counter()``, ``time.monotonic()`` and their ``_ns`` forms read the
  rank's simulated host time (:func:`simdist.now`, compute charged but not yet slept off included) plus a fixed
  base (:data:`CLOCK_BASES`), so a step timed with them takes its simulated time, as ``time.sleep`` already waits
  in it, and a value read from them (a seed, a file name) is the same in every run. All ranks share the bases, as
  the hosts of a cluster share a synchronised wall clock.
- The process id: ``os.getpid()`` answers ``FIRST_PID + rank``. Those numbers are above Linux's largest process
  id, so no live process has one: ``os.kill(os.getpid(), ...)`` in rank code fails with ``ProcessLookupError``
  rather than signal the simulator or another program.
- The command line: each rank has a ``sys.argv`` list of its own (:class:`RankArgv`), put in place at every
  hand-off of the baton.
- The ``__main__`` module: a rank that runs a script as torchrun runs it has one of its own
  (:class:`RankMains`), so ``pickle`` and ``torch.save`` find the script's classes as ``__main__.Name`` (as in
  the rank's own process) and ``sys.modules["__main__"]`` is the script's module there.

Outside rank threads each of them answers as before the run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

from simdist.clock.baton import current_rank_state
from simdist.patching import RANK_CALENDAR, RANK_CLOCKS

#: what each clock of :data:`simdist.patching.RANK_CLOCKS` reads at simulated time 0, in seconds: the wall clock
#: 2026-01-01 00:00:00 UTC, the others a day after a host's start. Fixed, not read when the run starts: a program
#: that seeds its generators from ``time.time()`` or names its files by it does the same in every run.
WALL_CLOCK_BASE = 1_767_225_600.0
UPTIME_BASE = 86_400.0
CLOCK_BASES = {name: WALL_CLOCK_BASE if name.startswith("time") else UPTIME_BASE for name in RANK_CLOCKS}

#: the process id of rank 0 (``os.getpid()`` in rank r answers FIRST_PID + r): one above Linux's PID_MAX_LIMIT
FIRST_PID = (1 << 22) + 1


def rank_clocks(now: Callable[[], float]) -> dict[str, Callable[[], float | int]]:
    """``time``'s clocks (:data:`simdist.patching.RANK_CLOCKS`) as rank code reads them: each one's base
    (:data:`CLOCK_BASES`) plus ``now()``, the calling rank's simulated time in seconds (``_ns`` clocks in
    nanoseconds)."""
    out: dict[str, Callable[[], float | int]] = {}
    for name in RANK_CLOCKS:
        ns = name.endswith("_ns")
        base = CLOCK_BASES[name] * 1e9 if ns else CLOCK_BASES[name]
        out[name] = _rank_clock(name, getattr(time, name), base, ns, now)
    return out


def rank_calendar(clock: Callable[[], float]) -> dict[str, Callable[..., Any]]:
    """``time``'s calendar functions (:data:`simdist.patching.RANK_CALENDAR`) as rank code calls them: given no
    time, they read ``clock`` (the rank's ``time.time``) where the C functions read the system clock."""
    real = {name: getattr(time, name) for name in RANK_CALENDAR}

    def seconds(secs: float | None = None) -> float | None:
        return clock() if secs is None and current_rank_state() is not None else secs

    def localtime(secs: float | None = None) -> time.struct_time:
        return real["localtime"](seconds(secs))

    def gmtime(secs: float | None = None) -> time.struct_time:
        return real["gmtime"](seconds(secs))

    def ctime(secs: float | None = None) -> str:
        return real["ctime"](seconds(secs))

    def asctime(t: Any = None) -> str:
        return real["asctime"](real["localtime"](seconds()) if t is None else t)

    def strftime(format: str, t: Any = None) -> str:
        return real["strftime"](format, real["localtime"](seconds()) if t is None else t)

    out: dict[str, Callable[..., Any]] = {
        "localtime": localtime,
        "gmtime": gmtime,
        "ctime": ctime,
        "asctime": asctime,
        "strftime": strftime,
    }
    for name, fn in out.items():
        fn.__doc__ = real[name].__doc__
    return out


def _rank_clock(
    name: str, real: Callable[[], float | int], base: float, ns: bool, now: Callable[[], float]
) -> Callable[[], float | int]:
    def clock() -> float | int:
        if current_rank_state() is None:
            return real()
        if ns:
            return int(base) + round(now() * 1e9)
        return base + now()

    clock.__name__ = clock.__qualname__ = name
    clock.__doc__ = real.__doc__
    return clock


def rank_getpid() -> Callable[[], int]:
    """``os.getpid`` as rank code reads it: ``FIRST_PID + rank`` in rank code, the real id elsewhere."""
    real = os.getpid

    def getpid() -> int:
        state = current_rank_state()
        return real() if state is None else FIRST_PID + state.rank

    getpid.__doc__ = real.__doc__
    return getpid


class RankArgv:
    """Each rank's ``sys.argv``: a list of its own, starting as ``argv``, put in place whenever the rank's thread
    takes the baton and kept as it hands it back (a :class:`simdist.clock.baton.PerRankState`).

    A real list (``json.dump(sys.argv)``, ``isinstance(sys.argv, list)`` and C code reading its items see the
    rank's own), which rank code may change or replace (``sys.argv = [...]``) for itself alone.
    """

    def __init__(self, argv: Iterable[str]) -> None:
        self._argv = tuple(argv)
        self._lists: dict[int, list[str]] = {}

    def enter(self, rank: int) -> None:
        """Put ``rank``'s list in place."""
        mine = self._lists.get(rank)
        if mine is None:
            mine = self._lists[rank] = list(self._argv)
        sys.argv = mine

    def leave(self, rank: int) -> None:
        """Keep what ``sys.argv`` is now as ``rank``'s (it may have replaced the list)."""
        self._lists[rank] = sys.argv


class RankMains:
    """Each rank's ``sys.modules["__main__"]``: the module a rank made its own (:func:`own_main_module`), else the
    process's, put in place whenever a rank's thread takes the baton (a :class:`simdist.clock.baton.PerRankState`)."""

    def __init__(self) -> None:
        self.process = sys.modules.get("__main__")
        self._modules: dict[int, ModuleType] = {}

    def enter(self, rank: int) -> None:
        """Put ``rank``'s ``__main__`` in place."""
        mine = self._modules.get(rank, self.process)
        if mine is not None:
            sys.modules["__main__"] = mine

    def leave(self, rank: int) -> None:
        """Nothing to keep: a rank's module is recorded when it is made."""

    def own(self, rank: int, module: ModuleType) -> None:
        """From now on ``module`` is ``rank``'s ``__main__``."""
        self._modules[rank] = module
        sys.modules["__main__"] = module


#: the run in progress's :class:`RankMains` (at most one run at a time)
_mains: list[RankMains] = []


@contextlib.contextmanager
def rank_mains() -> Iterator[RankMains]:
    """During the block ranks may have ``__main__`` modules of their own; the process's comes back after it."""
    mains = RankMains()
    _mains.append(mains)
    try:
        yield mains
    finally:
        _mains.remove(mains)
        if mains.process is not None:
            sys.modules["__main__"] = mains.process


def own_main_module(module: ModuleType) -> None:
    """Make ``module`` the calling rank's ``sys.modules["__main__"]`` for the rest of the run."""
    state = current_rank_state()
    if state is None or not _mains:
        raise RuntimeError("own_main_module is for rank code inside a run")
    _mains[-1].own(state.owner.rank, module)
