"""``dist.Work`` handles whose ``wait()`` blocks in simulated time."""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import simpy
import torch
import torch.distributed as dist
from torch.futures import Future


class SimTimeoutError(dist.DistBackendError):
    """A collective or point-to-point operation did not complete within its timeout (simulated seconds)."""


class SimFuture(Future):
    """A ``torch.futures.Future`` whose ``wait()`` blocks the calling rank in simulated time.

    torch's own ``Future.wait()`` blocks the OS thread in C++, which would stop the whole simulation (the
    future is completed by the simulator, which waits for the rank). ``then()`` returns a future that waits
    the same way.
    """

    def __init__(self, sim: Any, event: simpy.Event, description: str, work: SimWork | None = None) -> None:
        super().__init__()
        self._sim = sim
        self._event = event
        self._description = description
        self._work = weakref.ref(work) if work is not None else None

    def _block(self) -> None:
        if not _in_rank_thread():
            return
        if not self._event.processed and self._sim.baton is not None:
            self._sim.baton.block(self._event, self._description)
        work = self._work() if self._work is not None else None
        if work is not None:
            self._sim.races.observed(work)

    def wait(self) -> Any:
        """Block (in simulated time) until done; return the value."""
        self._block()
        return super().wait()

    def value(self) -> Any:
        """The value; blocks in simulated time first if not done yet."""
        self._block()
        return super().value()

    def then(self, callback: Any) -> Future:
        """Chain ``callback``; the returned future's ``wait()`` also blocks in simulated time."""
        inner = super().then(callback)
        outer = _ThenFuture(self, inner)
        return outer


class _ThenFuture(Future):
    """The future ``SimFuture.then`` returns: waits for its parent in simulated time, then for ``inner``."""

    def __init__(self, parent: SimFuture, inner: Future) -> None:
        super().__init__()
        self._parent = parent
        self._inner = inner
        inner.add_done_callback(lambda f: self._settle(f))

    def _settle(self, f: Future) -> None:
        try:
            self.set_result(f.value())
        except Exception as e:  # noqa: BLE001 - the callback's error becomes this future's error
            self.set_exception(e)

    def wait(self) -> Any:
        """Block (in simulated time) until the parent is done; return the callback's value."""
        self._parent._block()
        return super().wait()

    def value(self) -> Any:
        """The callback's value."""
        self._parent._block()
        return super().value()

    def then(self, callback: Any) -> Future:
        """Chain further; the result again waits for the root in simulated time."""
        return _ThenFuture(self._parent, super().then(callback))


def _in_rank_thread() -> bool:
    from simdist.engine.baton import current_rank_state

    return current_rank_state() is not None


class SimWork(dist.Work):
    """The handle of one rank's part of a collective or point-to-point operation.

    Completes at the simulated time that rank's part finishes; ``get_future()`` then holds the output
    tensors (what DDP's communication hooks read).
    """

    def __init__(self, sim: Any, description: str, outputs: list[torch.Tensor], timeout: float | None) -> None:
        super().__init__()
        self.sim = sim
        self.description = description
        self.outputs = outputs
        self.timeout = timeout
        self.event: simpy.Event = sim.env.event()
        self.future: Future = SimFuture(sim, self.event, description, self)
        self.source_rank = -1
        self.error: BaseException | None = None
        self.issued_at = sim.env.now
        self.completed_at: float | None = None

    # ---------------------------------------------------------------- completion (simpy thread)
    def complete(self) -> None:
        """Mark done at the current simulated time and fulfil the future."""
        if self.event.triggered:
            return
        self.completed_at = self.sim.env.now
        entry = self.__dict__.get("_race_entry")
        if entry is not None:
            entry.done_at = self.completed_at
        self.event.succeed()
        self.future.set_result(self.outputs)

    # ---------------------------------------------------------------- torch API (rank threads)
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block the calling rank until done; raises :class:`SimTimeoutError` after ``timeout``."""
        self.sim.settle()
        if self.event.processed:
            self.sim.races.observed(self)
            return True
        limit = self.timeout
        if timeout is not None:
            limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            if limit <= 0:  # torch treats a zero/negative timedelta as "no timeout"
                limit = self.timeout
        env = self.sim.env
        if limit is None:
            self.sim.baton.block(self.event, self.description)
            self.sim.races.observed(self)
            return True
        deadline = env.timeout(limit)
        self.sim.baton.block(env.any_of([self.event, deadline]), self.description)
        if not self.event.triggered:
            raise SimTimeoutError(
                f"Timed out after {limit:g} s of simulated time: {self.description}. "
                + self.sim.who_is_missing(self)
            )
        self.sim.races.observed(self)
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished at the calling rank's current simulated time."""
        self.sim.settle()
        if self.event.processed:
            self.sim.races.observed(self)
            return True
        return False

    def is_success(self) -> bool:
        """Whether it finished without error."""
        return self.event.processed

    def exception(self) -> BaseException | None:
        """The error it failed with, if any."""
        return self.error

    def result(self) -> list[torch.Tensor]:
        """The output tensors."""
        return self.outputs

    def get_future(self) -> Future:
        """A ``torch.futures.Future`` completed with the output tensors."""
        from simdist.comm.process_group import drain_at_end_of_backward

        drain_at_end_of_backward(self)
        return self.future

    def synchronize(self) -> None:
        """No device streams to synchronise with on CPU."""

    def _source_rank(self) -> int:
        return self.source_rank
