"""Thread-per-rank execution with a baton: exactly one thread (the simpy loop or one rank) runs at a time.

Why threads: torch keeps grad mode, the autograd engine's queues and the dispatch-mode stack per OS thread, so
each rank needs its own thread; blocking calls (``Work.wait()`` inside an autograd hook) then simply block that
thread. Why a baton: only one thread runs at any moment, which makes the interleaving a pure function of the
simpy event order and therefore deterministic.

The simpy loop runs in the thread that called :meth:`Baton.run`. A rank that must wait for simulated time
(:meth:`Baton.block`) attaches a callback to a simpy event and hands the baton back; when the event fires, the
callback hands the baton to that rank and waits until the rank hands it back (it blocks again or finishes).
"""

from __future__ import annotations

import _thread
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import simpy
import torch


class RankAbort(BaseException):
    """Raised inside a rank thread to unwind it when the run has failed elsewhere.

    A ``BaseException`` so that user code's ``except Exception`` does not swallow it.
    """


@dataclass
class RankState:
    """Book-keeping for one rank thread."""

    rank: int
    thread: threading.Thread | None = None
    sem: Any = field(default_factory=lambda: _signal())
    started: bool = False
    finished: bool = False
    result: Any = None
    exc: BaseException | None = None
    traceback_text: str = ""
    rng_state: torch.Tensor | None = None
    #: what the rank is blocked on (a human-readable description with the call site), or None when runnable
    waiting_on: str | None = None
    #: compute time (seconds) charged since the rank's last synchronisation point
    pending: float = 0.0
    #: simulated time (seconds) at which the rank's function returned
    finish_time: float = 0.0


_current = threading.local()


def _signal() -> Any:
    """A binary signal: ``release()`` raises it, ``acquire()`` waits for it and lowers it.

    A raw lock created locked; unlike ``threading.Semaphore`` (a Condition that allocates a lock per wait)
    it costs one futex operation per hand-off.
    """
    lock = _thread.allocate_lock()
    lock.acquire()
    return lock


def current_rank_state() -> RankState | None:
    """The :class:`RankState` of the calling rank thread, or None outside a simulated rank."""
    return getattr(_current, "state", None)


class Baton:
    """Runs ``world_size`` rank threads one at a time under a simpy environment."""

    def __init__(
        self,
        env: simpy.Environment,
        world_size: int,
        target: Callable[[int], Any],
        *,
        initial_rng_state: torch.Tensor,
        stack_size: int = 0,
    ) -> None:
        self.env = env
        self.target = target
        self.ranks = [RankState(r) for r in range(world_size)]
        self._main_sem = _signal()
        self._initial_rng = initial_rng_state
        self._stack_size = stack_size
        self.failure: BaseException | None = None
        self.aborting = False
        self.running: RankState | None = None
        #: called in the simpy thread when every unfinished rank is blocked and no event is scheduled
        self.on_stall: Callable[[], BaseException | None] | None = None

    # ----------------------------------------------------------------- rank side
    def block(self, event: simpy.Event, description: str) -> Any:
        """Block the calling rank until ``event`` fires; returns the event's value.

        ``description`` says what the rank waits on (shown in deadlock reports).
        """
        state = current_rank_state()
        assert state is not None, "Baton.block called outside a rank thread"
        if self.aborting:
            raise RankAbort()
        if not event.processed:
            state.waiting_on = description
            event.callbacks.append(lambda _ev, s=state: self._resume(s))
            self._hand_back(state)
            state.waiting_on = None
        if self.aborting:
            raise RankAbort()
        if not event.ok:
            raise event.value
        return event.value

    def sleep(self, seconds: float, description: str = "compute") -> None:
        """Advance the calling rank's simulated time by ``seconds``."""
        if seconds > 0:
            self.block(self.env.timeout(seconds), description)

    def _hand_back(self, state: RankState) -> None:
        state.rng_state = torch.get_rng_state()
        self.running = None
        self._main_sem.release()
        state.sem.acquire()

    # ----------------------------------------------------------------- simpy side
    def _resume(self, state: RankState) -> None:
        """Give the baton to ``state``'s thread and wait until it hands it back."""
        if state.finished:
            return
        if not state.started:
            state.started = True
            state.thread = threading.Thread(
                target=self._thread_main, args=(state,), name=f"simdist-rank-{state.rank}", daemon=True
            )
            state.thread.start()
        else:
            torch.set_rng_state(state.rng_state)
            self.running = state
            state.sem.release()
        self._main_sem.acquire()
        if state.exc is not None and self.failure is None and not isinstance(state.exc, RankAbort):
            self.failure = state.exc
            self.aborting = True

    def _thread_main(self, state: RankState) -> None:
        _current.state = state
        self.running = state
        torch.set_rng_state(self._initial_rng)
        try:
            state.result = self.target(state.rank)
        except RankAbort as e:
            state.exc = e
        except BaseException as e:  # noqa: BLE001 - every failure of user code is reported by run()
            state.exc = e
            state.traceback_text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        finally:
            state.finished = True
            state.waiting_on = None
            self.running = None
            _current.state = None
            self._main_sem.release()

    def start_all(self) -> None:
        """Start every rank at simulated time 0, in rank order."""
        for state in self.ranks:
            ev = self.env.event()
            ev.callbacks.append(lambda _ev, s=state: self._resume(s))
            ev.succeed()

    def run(self) -> None:
        """Drive the simulation until every rank finished, a rank failed, or nothing can progress."""
        old_stack = threading.stack_size()
        if self._stack_size:
            threading.stack_size(self._stack_size)
        # Simulator code in this thread writes into users' tensors (message arrivals, collective set-up when
        # a stream frees up): never record that for autograd, whatever tensors it touches.
        grad_was = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            self.start_all()
            env = self.env
            while not self.aborting:
                if env.peek() == float("inf"):
                    if all(s.finished for s in self.ranks):
                        break
                    err = self.on_stall() if self.on_stall else None
                    if env.peek() != float("inf") and err is None:
                        continue
                    self.failure = err or RuntimeError("simulation stalled")
                    self.aborting = True
                    break
                env.step()
        except BaseException as e:  # noqa: BLE001 - an error raised by simulator code in the simpy thread
            if self.failure is None:
                self.failure = e
            self.aborting = True
        finally:
            self._unwind()
            threading.stack_size(old_stack)
            torch.set_grad_enabled(grad_was)

    def _unwind(self) -> None:
        """Resume every blocked rank with ``aborting`` set so it raises :class:`RankAbort` and exits."""
        self.aborting = True
        for state in self.ranks:
            if state.started and not state.finished:
                state.sem.release()
                self._main_sem.acquire()
        for state in self.ranks:
            if state.thread is not None:
                state.thread.join()
