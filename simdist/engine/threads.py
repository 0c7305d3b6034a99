"""Threads that rank code starts act as their rank: they take the baton like it, one thread at a time.

During a run, ``threading.Thread.start`` called from a rank's code starts the thread as one of the rank's
threads (:meth:`Baton.spawn`): it sees the rank's process groups, environment and RNG (one RNG per rank, as one
per process), and first runs when the starting thread hands the baton back (issues or waits on communication,
or finishes). ``Thread.join`` from a rank thread waits in simulated time. To the interpreter every such thread
is a daemon, so nothing a run started can keep the process from exiting; ``daemon`` reads as the program set
it, and the run itself waits for the non-daemon ones. Threads started outside rank code are untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from simdist.clock.baton import Baton, RankState, current_rank_state
from simdist.patching import replaced

_init = threading.Thread.__init__
_start = threading.Thread.start
_join = threading.Thread.join


@contextlib.contextmanager
def rank_threads(baton: Baton, wrap: Callable[[int, Callable[[], Any]], Callable[[], Any]]) -> Iterator[None]:
    """Make threads started by rank code act as their rank while the block runs.

    ``wrap(rank, body)`` returns what the thread runs: ``body`` inside the rank's world and dispatch modes.
    """

    def init(self: threading.Thread, *args: Any, daemon: bool | None = None, **kwargs: Any) -> None:
        # A thread inherits daemon-ness from the thread that creates it; a rank's function runs in its
        # process's main thread, which is not a daemon (the simulator's rank threads are). Threads the rank
        # started pass theirs on, as in a process.
        state = current_rank_state()
        if daemon is None and state is not None and state.parent is None:
            daemon = False
        _init(self, *args, daemon=daemon, **kwargs)

    def start(self: threading.Thread) -> None:
        state = current_rank_state()
        if state is None or getattr(self, "_simdist_child", None) is not None:
            return _start(self)
        if self._started.is_set():  # type: ignore[attr-defined]
            raise RuntimeError("threads can only be started once")
        child = baton.spawn(wrap(state.rank, self.run), thread=self)
        self._simdist_child = child  # type: ignore[attr-defined]
        # The OS thread starts as a daemon, so that the interpreter never waits for it at exit (the run waits
        # for the rank's non-daemon threads in simulated time, and a thread left stuck in C code after a
        # failed run must not keep the process alive); Python reads the flag only while starting a thread,
        # and ``daemon`` reads what the program asked for afterwards.
        daemon = self.daemon
        self._daemonic = True  # type: ignore[attr-defined]
        try:
            return _start(self)
        except BaseException:
            baton.discard(child)  # no thread was started ("can't start new thread"): nothing to wait for
            del self._simdist_child  # type: ignore[attr-defined]
            raise
        finally:
            self._daemonic = daemon  # type: ignore[attr-defined]

    def join(self: threading.Thread, timeout: float | None = None) -> None:
        child: RankState | None = getattr(self, "_simdist_child", None)
        if child is None or current_rank_state() is None:
            return _join(self, timeout)
        if current_rank_state() is child:
            raise RuntimeError("cannot join current thread")
        what = f"rank {child.rank} joining its thread {self.name!r}"
        if timeout is None:
            baton.block(child.done, what)
        else:
            baton.block(baton.env.any_of([child.done, baton.env.timeout(max(float(timeout), 0.0))]), what)
        if child.finished:
            _join(self)  # the thread has handed the baton back; it is leaving threading's own bookkeeping

    with replaced(
        "simdist.engine.threads",
        {"threading.Thread.__init__": init, "threading.Thread.start": start, "threading.Thread.join": join},
    ):
        yield
