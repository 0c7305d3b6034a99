"""Thread-per-rank execution with a baton: exactly one thread (the simpy loop or one rank) runs at a time.

Why threads: torch keeps grad mode, the autograd engine's queues and the dispatch-mode stack per OS thread, so
each rank needs its own thread; blocking calls (``Work.wait()`` inside an autograd hook) then simply block that
thread. Why a baton: only one thread runs at any moment, which makes the interleaving a pure function of the
simpy event order and therefore deterministic.

The simpy loop runs in the thread that called :meth:`Baton.run`. A rank that must wait for simulated time
(:meth:`Baton.block`) attaches a callback to a simpy event and hands the baton back; when the event fires, the
callback hands the baton to that rank and waits until the rank hands it back (it blocks again or finishes).

A rank may own further threads (:meth:`Baton.spawn`): threads its code starts, and the thread that runs its
futures' callbacks. They act as that rank and take the baton like it, one at a time.

The watchdog: a thread that keeps the baton longer than ``watchdog`` wall-clock seconds (a ``while True:``
loop, CPU work that never communicates) stops the run with a :class:`WatchdogError` naming the rank, its
Python stack and its simulated time; the thread is interrupted with an asynchronous :class:`RankAbort`.

Nothing of a run outlives it: when :meth:`Baton.run` returns every thread has ended, except threads stuck in
C code, which are daemons that raise :class:`RankAbort` as soon as they return to Python (see ``_abandon``).
"""

from __future__ import annotations

import _thread
import ctypes
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import simpy
import torch

from simdist.errors import WatchdogError
from simdist.layers import is_simulator_frame


class RankAbort(BaseException):
    """Raised inside a rank thread to unwind it when the run has failed elsewhere.

    A ``BaseException`` so that user code's ``except Exception`` does not swallow it.
    """


class RankCrashed(RankAbort):
    """Raised inside every thread of a rank whose process died (a crash fault), wherever it waits, until it
    ends: the process is gone, so none of its threads takes another step in simulated time."""


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
    #: torch's default dtype as this rank last left it (process-wide in torch, per process in a real launch)
    default_dtype: torch.dtype = torch.float32
    #: what the rank is blocked on (a human-readable description with the call site), or None when runnable
    waiting_on: str | None = None
    #: compute time (seconds) charged since the rank's last synchronisation point (host-synchronous ranks), or
    #: host time spent launching kernels since then (a host that runs ahead of its device)
    pending: float = 0.0
    #: a host that runs ahead: the simulated time (seconds) it waited for its device until, without handing the
    #: baton on, before its ``pending`` time (a value read, a stream's synchronisation); 0.0 when it has not since
    #: its last synchronisation point. Its host time is ``max(env.now, at) + pending`` (see ``RankTime.host``).
    at: float = 0.0
    #: simulated time (seconds) at which the rank's compute stream has run everything queued on it (ranks
    #: whose host runs ahead of the device; threads of a rank share their owner's)
    stream_end: float = 0.0
    #: the stream this thread's device work goes to: 0 is the rank's compute stream (CUDA's default stream),
    #: another number one of the rank's side streams (``torch.cuda.Stream``); per thread, as CUDA's is
    stream: int = 0
    #: simulated time (seconds) at which each side stream of the rank has run everything queued on it (the
    #: owner's: the rank's threads share its streams)
    side_ends: dict[int, float] = field(default_factory=dict)
    #: simulated time (seconds) at which the thread was done: the rank's function returned, or the body of a
    #: thread the rank started did (its pending compute and, for a host that runs ahead, its device included)
    finish_time: float = 0.0
    #: the rank this thread belongs to, for a thread the rank's code or its futures started; None for the rank's
    #: own thread. The two share torch's RNG as threads of one process do.
    parent: RankState | None = None
    #: what the thread runs instead of the rank's function (threads the rank started)
    body: Callable[[], Any] | None = None
    #: fires when the thread finishes (a rank's ``Thread.join`` waits for it)
    done: simpy.Event | None = None
    #: a thread of the simulator's own acting as the rank (its future callbacks): never keeps a run going
    service: bool = False
    #: True while the thread runs user code (the watchdog may interrupt it only then)
    in_user: bool = False
    #: the watchdog has sent this thread an asynchronous RankAbort
    interrupted: bool = False
    #: why the rank's process died (a crash fault), on the rank's own state; None while it lives
    crashed: str | None = None

    @property
    def owner(self) -> RankState:
        """The rank's own state (itself, for a rank thread)."""
        return self.parent if self.parent is not None else self


_current = threading.local()


class PerRankState(Protocol):
    """Process state that is one per rank, put in place as a rank's thread takes the baton and kept as it hands it
    back (as torch's RNG and default dtype are; the run registers them in :attr:`Baton.per_rank`)."""

    def enter(self, rank: int) -> None:
        """``rank``'s thread is about to run: put its state in place."""

    def leave(self, rank: int) -> None:
        """``rank``'s thread has stopped running: keep its state as it left it."""


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


#: how often (wall-clock seconds) the simpy thread looks at a rank that keeps the baton
_WATCH_PERIOD = 1.0
#: how long (wall-clock seconds) an interrupted thread gets to unwind before it is abandoned
_UNWIND_GRACE = 5.0


class Baton:
    """Runs ``world_size`` rank threads one at a time under a simpy environment."""

    def __init__(
        self,
        env: simpy.Environment,
        world_size: int,
        target: Callable[[int], Any],
        *,
        initial_rng_state: Callable[[int], torch.Tensor],
        stack_size: int = 0,
        watchdog: float = float("inf"),
        simulated: Sequence[int] | None = None,
    ) -> None:
        self.env = env
        self.target = target
        self.ranks = [RankState(r) for r in range(world_size)]
        #: the ranks whose threads run (ascending; a symmetric run's few): the others never start and count as
        #: finished from the outset
        self.simulated: tuple[int, ...] = tuple(range(world_size)) if simulated is None else tuple(simulated)
        if simulated is not None:
            running = set(self.simulated)
            for state in self.ranks:
                state.finished = state.rank not in running
        #: ranks whose function has not returned yet
        self._unfinished = len(self.simulated)
        #: threads the ranks started (see :meth:`spawn`), in start order
        self.children: list[RankState] = []
        self._main_sem = _signal()
        self._initial_rng = initial_rng_state
        self._initial_dtype = torch.get_default_dtype()
        #: torch's intra-op thread count for every thread of rank code: the running thread's, read in :meth:`run`
        self._intra_op_threads = 1
        #: further per-rank process state, swapped like the RNG at every hand-off (cheap attribute swaps only)
        self.per_rank: list[PerRankState] = []
        self._stack_size = stack_size
        #: wall-clock seconds a thread may keep the baton before the run is stopped
        self.watchdog = watchdog
        # Taken by the watchdog to interrupt a thread and by a thread leaving user code, so that an
        # asynchronous exception never lands inside the baton's own hand-off.
        self._watch_lock = threading.Lock()
        self.failure: BaseException | None = None
        self.aborting = False
        self.running: RankState | None = None
        #: called in the simpy thread when every unfinished rank is blocked and no event is scheduled
        self.on_stall: Callable[[], BaseException | None] | None = None
        #: threads the watchdog could not unwind (stuck inside C code); they are left behind as daemons
        self.abandoned: list[RankState] = []
        #: whether a rank has crashed (see :meth:`mark_crashed`): waits look for their rank's death only then
        self.any_crashed = False

    # ----------------------------------------------------------------- rank side
    def block(self, event: simpy.Event, description: str) -> Any:
        """Block the calling rank until ``event`` fires; returns the event's value.

        ``description`` says what the rank waits on (shown in deadlock reports).
        """
        state = current_rank_state()
        assert state is not None, "Baton.block called outside a rank thread"
        self._leave_user_code(state)
        if self.aborting:
            raise RankAbort()
        if self.any_crashed and state.owner.crashed is not None:
            raise RankCrashed(state.owner.crashed)
        if not event.processed:
            state.waiting_on = description
            event.callbacks.append(lambda _ev, s=state: self._resume(s))
            self._hand_back(state)
            state.waiting_on = None
        state.in_user = True
        if self.aborting:
            raise RankAbort()
        if self.any_crashed and state.owner.crashed is not None:
            raise RankCrashed(state.owner.crashed)
        if not event.ok:
            raise event.value
        return event.value

    def sleep(self, seconds: float, description: str = "compute") -> None:
        """Advance the calling rank's simulated time by ``seconds``."""
        if seconds > 0:
            self.block(self.env.timeout(seconds), description)

    def spawn(
        self,
        body: Callable[[], Any],
        *,
        rank: int | None = None,
        thread: threading.Thread | None = None,
        name: str = "",
        service: bool = False,
    ) -> RankState:
        """A thread that acts as ``rank`` (default: the calling rank) and runs ``body()`` when the baton reaches it.

        It first runs at the current simulated time, after the calling thread hands the baton back. With
        ``thread`` (a not yet started ``threading.Thread``) that thread is used: its ``run`` is replaced and the
        caller starts it; otherwise a daemon thread named ``name`` is started here. A ``service`` thread (the
        simulator's own) does not keep the run going once the ranks finished.
        """
        if rank is None:
            parent = current_rank_state()
            assert parent is not None, "Baton.spawn without rank= called outside a rank thread"
            rank = parent.rank
        owner = self.ranks[rank]
        child = RankState(rank, parent=owner, body=body, done=self.env.event(), started=True, service=service)
        self.children.append(child)
        ev = self.env.event()
        ev.owner_rank = rank  # type: ignore[attr-defined]  # whose step it is, when a perturbed run orders ties
        ev.callbacks.append(lambda _ev, s=child: self._resume(s))
        ev.succeed()
        if thread is None:
            child.thread = threading.Thread(target=self._thread_main, args=(child,), name=name, daemon=True)
            child.thread.start()
        else:
            child.thread = thread
            thread.run = lambda: self._thread_main(child)  # type: ignore[method-assign]
        return child

    def discard(self, child: RankState) -> None:
        """Forget ``child``, a thread :meth:`spawn` prepared whose OS thread could not be started."""
        child.finished = True
        self.children.remove(child)

    def _leave_user_code(self, state: RankState) -> None:
        """Mark ``state`` as running simulator code: from here on the watchdog's interrupt cannot land.

        Raises :class:`RankAbort` if the watchdog interrupted the thread (its asynchronous exception, if not yet
        delivered, is taken here first).
        """
        while True:
            try:
                with self._watch_lock:
                    state.in_user = False
                break
            except RankAbort:  # delivered just before the lock: nothing is pending any more, go on
                continue
        if state.interrupted:
            # Take a pending interrupt here rather than cancel it: CPython 3.11 leaves its interpreter-wide
            # "asynchronous exception" flag set after a cancel, and a traced call then never returns. It is
            # delivered at the next function call.
            try:
                for _ in range(3):
                    _noop()
            except RankAbort:
                pass
            raise RankAbort()

    def _hand_back(self, state: RankState) -> None:
        owner = state.owner
        owner.rng_state = torch.get_rng_state()
        owner.default_dtype = torch.get_default_dtype()
        for kept in self.per_rank:
            kept.leave(owner.rank)
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
            # made here, where torch is warm: a rank thread's first torch calls cost several times more
            state.rng_state = self._initial_rng(state.rank)
            state.thread = threading.Thread(
                target=self._thread_main, args=(state,), name=f"simdist-rank-{state.rank}", daemon=True
            )
            state.thread.start()
        else:
            owner = state.owner
            torch.set_rng_state(owner.rng_state)
            if torch.get_default_dtype() != owner.default_dtype:
                torch.set_default_dtype(owner.default_dtype)
            for kept in self.per_rank:
                kept.enter(owner.rank)
            self.running = state
            state.sem.release()
        self._wait_for(state)
        if state.finished and state.thread is not None and not self.is_abandoned(state):
            # the thread's last references (its frames, its thread-local state) go as it exits: before the run
            # goes on, so that what they free is freed at this point of simulated time, whatever the OS does
            state.thread.join()
        if (
            state.exc is not None
            and self.failure is None
            and not isinstance(state.exc, RankAbort)
            and state.parent is None
        ):
            self.failure = state.exc
            self.aborting = True

    def _wait_for(self, state: RankState) -> None:
        """Wait until ``state``'s thread hands the baton back; stop the run if it keeps it too long."""
        if self.watchdog == float("inf"):
            self._main_sem.acquire()
            return
        start = time.monotonic()
        while not self._main_sem.acquire(timeout=min(_WATCH_PERIOD, self.watchdog)):
            held = time.monotonic() - start
            if held >= self.watchdog and self._interrupt(state, held):
                return

    def _take_back(self, state: RankState) -> None:
        """Take the baton back from ``state``'s thread now: a signal's handler raised in this thread while it ran
        (the user's Ctrl-C).

        Waiting for it to hand over could take until the watchdog's limit, or forever without one: a rank
        computing in a loop never hands over.
        """
        while not self._main_sem.acquire(timeout=0.05):
            if self._interrupt(state, 0.0):
                return

    def _interrupt(self, state: RankState, held: float) -> bool:
        """Stop the run: ``state``'s thread has kept the baton ``held`` seconds. True once the baton is back."""
        with self._watch_lock:
            if not state.in_user:
                return False  # it is handing the baton back right now
            frame = sys._current_frames().get(state.thread.ident) if state.thread is not None else None
            stack = _user_stack(frame)
            if self.failure is None:
                thread = state.thread.name if state.parent is not None and state.thread is not None else ""
                self.failure = WatchdogError(state.rank, held, self.watchdog, max(self.env.now, state.at) + state.pending, stack, thread)
            self.aborting = True
            state.interrupted = True
            _async_raise(state.thread, RankAbort)
        # A thread inside C code (a lock, a long kernel) sees the interrupt only when it returns to Python.
        deadline = time.monotonic() + _UNWIND_GRACE
        while not self._main_sem.acquire(timeout=0.1):
            if time.monotonic() > deadline:
                with self._watch_lock:
                    if self._main_sem.acquire(blocking=False):
                        return True  # it handed the baton back just now
                    self.abandoned.append(state)
                self._abandon(state)
                return True
            with self._watch_lock:
                if state.in_user:  # it caught the interrupt and went on: send another
                    _async_raise(state.thread, RankAbort)
        return True

    def _abandon(self, state: RankState) -> None:
        """Leave ``state``'s thread (in :attr:`abandoned`), stuck in C code with a :class:`RankAbort` pending:
        the run goes on without it, and the thread can neither keep the process alive nor run on once its C
        call returns.

        The interrupt stays pending on that thread: CPython raises it at the thread's first Python instruction
        after the call (re-taking the GIL re-arms it), so none of its code runs after the run but ``finally``
        blocks and handlers of ``BaseException``. Only the interpreter-wide flag that asks every thread to
        look for one is cleared (see :func:`_reset_async_flag`), and the thread is made a daemon. It no
        longer hands the baton back when it ends: the baton has moved on.
        """
        _reset_async_flag()
        if state.thread is not None:
            # read by the interpreter only while starting a thread (threads of rank code start as daemons, see
            # engine/threads.py); set here so that ``threading.enumerate()`` tells the truth about it
            state.thread._daemonic = True  # type: ignore[attr-defined]

    def _thread_main(self, state: RankState) -> None:
        _current.state = state
        # MKL's thread count is kept per thread, and torch sets a new thread's own only at its first parallel
        # region, which small ops never reach: until then MKL's kernels (a matmul) run as many threads as the
        # machine has cores, on the one CPU a run is pinned to, and each waits out the others' time slices.
        torch.set_num_threads(self._intra_op_threads)
        if state.parent is None:
            torch.set_rng_state(state.rng_state)
            torch.set_default_dtype(self._initial_dtype)
            for kept in self.per_rank:
                kept.enter(state.rank)
        else:
            state.sem.acquire()  # a rank's further thread starts at once but runs only with the baton
        self.running = state
        state.in_user = True
        try:
            try:
                if self.aborting:
                    raise RankAbort()
                if state.owner.crashed is not None:
                    raise RankCrashed(state.owner.crashed)
                if state.body is not None:
                    state.result = state.body()
                else:
                    state.result = self.target(state.rank)
            finally:
                self._leave_user_code(state)
        except RankAbort as e:
            state.exc = e
        except BaseException as e:  # noqa: BLE001 - every failure of user code is reported by run()
            state.exc = e
            state.traceback_text = _format_exception(e)
        finally:
            state.finished = True
            if state.parent is None:
                self._unfinished -= 1
            state.waiting_on = None
            if state.done is not None and not self.aborting:
                state.done.succeed()
            state.owner.rng_state = torch.get_rng_state()
            state.owner.default_dtype = torch.get_default_dtype()
            for kept in self.per_rank:
                kept.leave(state.owner.rank)
            _current.state = None
            with self._watch_lock:
                if not self.is_abandoned(state):
                    self.running = None
                    self._main_sem.release()
        exc = state.exc
        if state.parent is not None and exc is not None and not isinstance(exc, RankAbort):
            # As in a real process, an exception that ends a thread the rank started does not end the rank:
            # it reaches threading.excepthook (which prints it), outside the baton, from the user's frames on.
            tb = exc.__traceback__
            while tb is not None and _is_own(tb.tb_frame.f_code.co_filename):
                tb = tb.tb_next
            exc = exc.with_traceback(tb)
            threading.excepthook(threading.ExceptHookArgs((type(exc), exc, tb, threading.current_thread())))

    def mark_crashed(self, rank: int, why: str) -> None:
        """Record that ``rank``'s process died (``why``): its threads raise :class:`RankCrashed` at their next wait.
        The calling rank's own thread raises it itself; :meth:`crash` ends the threads that wait."""
        self.ranks[rank].crashed = why
        self.any_crashed = True

    def crash(self, rank: int, why: str) -> str | None:
        """End ``rank``'s process now (simpy side): each of its threads raises :class:`RankCrashed` where it
        waits, or as it starts. Returns what its own thread was waiting on (None: it had finished, had not started
        or had already crashed, its other threads then ending now).
        """
        owner = self.ranks[rank]
        first = owner.crashed is None
        if first:
            self.mark_crashed(rank, why)
        where = owner.waiting_on if first and owner.started and not owner.finished else None
        # threads a rank started and its callback thread die with it; each is parked in its hand-back (no rank
        # runs while the simpy thread does), so resuming it makes its wait raise
        for state in [owner, *(c for c in self.children if c.parent is owner)]:
            if state.started and not state.finished and state.thread is not None and not self.is_abandoned(state):
                self._resume(state)
        return where

    def start_all(self) -> None:
        """Start every simulated rank at simulated time 0, in rank order."""
        for state in (self.ranks[r] for r in self.simulated):
            ev = self.env.event()
            ev.owner_rank = state.rank  # type: ignore[attr-defined]  # see spawn
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
        self._intra_op_threads = torch.get_num_threads()
        try:
            self.start_all()
            env = self.env
            while not self.aborting:
                if self._unfinished == 0 and self._only_daemons_left():
                    break  # as a process exits when its main thread ends, killing its daemon threads
                if env.peek() == float("inf"):
                    if self._unfinished == 0 and not self._foreground():
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
            # A rank holds the baton only while this thread waits for it, where nothing of the simulator raises:
            # what was raised there came from a signal's handler (Ctrl-C's KeyboardInterrupt, or whatever a
            # handler installed by the program raises, such as torch elastic's SignalException).
            running = self.running
            if running is not None:
                self._take_back(running)
        finally:
            self._unwind()
            threading.stack_size(old_stack)
            torch.set_grad_enabled(grad_was)

    def process_threads(self, rank: int) -> list[RankState]:
        """``rank``'s own thread and the non-daemon threads its code started: its process ends with the last.

        Daemon threads are left out (a process exits without waiting for them), and so are the simulator's
        own service threads.
        """
        owner = self.ranks[rank]
        started = [c for c in self.children if c.parent is owner and not c.service]
        return [owner, *(c for c in started if not c.thread.daemon)]

    def _foreground(self) -> list[RankState]:
        """Unfinished non-daemon threads the ranks started: a process waits for them before it exits."""
        return [c for c in self.children if not c.finished and not c.service and not c.thread.daemon]

    def _only_daemons_left(self) -> bool:
        """Every rank finished, and only daemon threads the ranks started are still running."""
        user = [c for c in self.children if not c.finished and not c.service]
        return bool(user) and all(c.thread.daemon for c in user)

    def _unwind(self) -> None:
        """Resume every blocked thread with ``aborting`` set so it raises :class:`RankAbort` and exits.

        A thread that gets stuck in C code while it unwinds (a ``finally`` block waiting on a lock) is
        abandoned by the watchdog like one that held the baton, and not waited for.
        """
        self.aborting = True
        threads = [*self.ranks, *self.children]
        for state in threads:
            if state.started and not state.finished and not self.is_abandoned(state):
                state.sem.release()
                self._wait_for(state)
        for state in threads:
            if state.thread is not None and state.started and not self.is_abandoned(state):
                state.thread.join()

    def is_abandoned(self, state: RankState) -> bool:
        """Whether the watchdog left ``state``'s thread behind, stuck in C code (see :meth:`_abandon`)."""
        return any(s is state for s in self.abandoned)


def _is_own(filename: str) -> bool:
    """Whether a frame of ``filename`` is threading's or the simulator's own (how a rank thread runs)."""
    return filename == threading.__file__ or is_simulator_frame(filename)


def _user_stack(frame: Any) -> str:
    """The stack of ``frame`` as text, without the thread start-up and run frames above the user's code."""
    if frame is None:
        return "(no Python frame)\n"
    frames = traceback.extract_stack(frame)
    start = next((i for i, f in enumerate(frames) if not _is_own(f.filename)), 0)
    return "".join(traceback.format_list(frames[start:]))


def _noop() -> None:
    """A Python call: where a pending asynchronous exception is delivered."""


class _FlagReset(BaseException):
    """Sent to a thread of :func:`_reset_async_flag`'s own, which takes it."""


def _reset_async_flag() -> None:
    """Clear CPython's interpreter-wide "asynchronous exception pending" flag.

    ``PyThreadState_SetAsyncExc`` sets that flag and only a thread taking an asynchronous exception clears it;
    while it stays set (the target is stuck in C code), any call made under ``sys.settrace`` (hypothesis,
    coverage, debuggers) spins forever in CPython 3.11. So a thread is started to take one. Clearing
    the flag leaves other threads' pending exceptions pending: each is raised when its thread returns to
    Python, as re-taking the GIL sets the flag again for that thread.
    """
    ready = threading.Event()

    def take() -> None:
        ready.set()
        try:
            while True:
                _noop()
        except _FlagReset:
            pass

    sink = threading.Thread(target=take, name="simdist-async-flag-reset", daemon=True)
    sink.start()
    ready.wait()
    _async_raise(sink, _FlagReset)
    sink.join()


def _async_raise(thread: threading.Thread | None, exc: type[BaseException]) -> None:
    """Raise ``exc`` in ``thread`` at its next Python instruction."""
    if thread is None or thread.ident is None:
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


def _format_exception(e: BaseException) -> str:
    """``e``'s traceback as text from the user's first frame on (the thread's start-up and the run's own frames
    above it left out), even when its ``__str__`` raises."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and _is_own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    try:
        return "".join(traceback.format_exception(type(e), e, tb))
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the traceback
        frames = "".join(traceback.format_tb(tb))
        return f"Traceback (most recent call last):\n{frames}{type(e).__name__}: <__str__ raised>\n"
