"""``dist.Work`` handles whose ``wait()`` blocks in simulated time."""

from __future__ import annotations

import os
import sys
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import simpy
import torch
import torch.distributed as dist
from torch.futures import Future

from simdist.clock.baton import current_rank_state
from simdist.comm.drain import drain_at_end_of_backward
from simdist.comm.thread_world import acting_as
from simdist.errors import ProcessTornDown, SimTimeoutError

if TYPE_CHECKING:  # annotations only: the run's context imports the machinery, not the other way
    from simdist.comm.context import RunContext


#: values of ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` with which NCCL's watchdog takes the process down on an error or a
#: timeout (1: TearDown, 3: SkipCleanUp; 0 and 2 leave the process running)
TEAR_DOWN = ("1", "3")
#: ProcessGroupNCCL's ``OpType`` names where they are not the op's name without underscores
_OP_TYPES = {
    "reduce_scatter": "REDUCE_SCATTER",
    "reduce_scatter_tensor": "_REDUCE_SCATTER_BASE",
    "all_gather_into_tensor": "_ALLGATHER_BASE",
    "all_to_all_single": "ALLTOALL_BASE",
    "all_to_all": "ALLTOALL",
}


class SimFuture(Future):
    """A ``torch.futures.Future`` whose ``wait()`` blocks the calling rank in simulated time.

    torch's own ``Future.wait()`` blocks the OS thread in C++, which would stop the whole simulation (the
    future is completed by the simulator, which waits for the rank). ``then()`` returns a future that waits
    the same way. A future with callbacks is completed in its rank's callback thread (:mod:`callbacks`), so
    those callbacks may issue and wait on collectives.
    """

    def __init__(self, sim: RunContext, event: simpy.Event, description: str, work: SimWork | None = None) -> None:
        super().__init__()
        self._sim = sim
        self._event = event
        self._description = description
        self._work = weakref.ref(work) if work is not None else None
        self.chained = False
        #: fires when the value is set; only for chained futures, whose value is set in the callback thread
        self._ready: simpy.Event | None = None

    def _block(self) -> None:
        if not _in_rank_thread():
            return
        if not self._event.processed and self._sim.baton is not None:
            self._sim.baton.block(self._event, self._description)
        if self._ready is not None and not self._ready.triggered:
            self._sim.baton.block(self._ready, self._description + " (its callbacks)")
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

    def done(self) -> bool:
        """Whether complete at the calling rank's current simulated time; polling lets simulated time pass."""
        if not _in_rank_thread():
            return super().done()
        self._sim.settle()
        if self._event.processed:
            work = self._work() if self._work is not None else None
            if work is not None:
                self._sim.races.observed(work)
            return True
        self._sim.let_time_pass(self._event, self._description)
        return False

    def then(self, callback: Any) -> Future:
        """Chain ``callback``; the returned future's ``wait()`` also blocks in simulated time."""
        if not self.chained:
            self.chained = True
            ready = self._ready = self._sim.env.event()
            # First of the callbacks (they run in the order added): the value is there before they run.
            self.add_done_callback(lambda _f: ready.triggered or ready.succeed())
        inner = super().then(_after_completion(self._sim, callback))
        return _drained(_ThenFuture([self], inner))


def _after_completion(sim: RunContext, callback: Any) -> Any:
    """``callback`` run with the race checks of its rank off: it runs once the operation has completed
    (in the simulator, or at once in the rank when the future is already done), so reading the
    operation's buffers there is not a race."""

    def run(fut: Future) -> Any:
        state = current_rank_state()
        if state is None or state.rank in sim.races.suspended:
            return callback(fut)
        sim.races.suspended.add(state.rank)
        try:
            return callback(fut)
        finally:
            sim.races.suspended.discard(state.rank)

    return run


def _drained(fut: _ThenFuture) -> _ThenFuture:
    """``fut``, waited for before the current backward pass returns if it was chained inside one.

    torch's DDP reducer waits in C++ for the future its comm hook returns (e.g. PowerSGD's chain of
    ``then()``); the chain's later collectives are issued by callbacks, so the works alone are not enough.
    """
    drain_at_end_of_backward(fut, taken_by_torch=False)
    return fut


class _ThenFuture(Future):
    """A future derived from simdist futures (``then()``, ``collect_all``): waits for them in simulated time,
    then for ``inner``, the torch future that holds the value."""

    def __init__(self, roots: list[Any], inner: Future) -> None:
        super().__init__()
        sim = self._sim = roots[0]._sim
        self._roots = roots
        self._inner = inner
        #: fires once this future has its value (callbacks may complete it in a rank's callback thread)
        ready = self._ready = sim.env.event()
        # First of the callbacks (they run in the order added): the value is there before they run.
        self.add_done_callback(lambda _f: ready.triggered or ready.succeed())
        inner.add_done_callback(lambda f: self._settle(f))

    def _settle(self, f: Future) -> None:
        try:
            self.set_result(f.value())
        except Exception as e:  # noqa: BLE001 - the callback's error becomes this future's error
            self.set_exception(e)

    def _block(self) -> None:
        for root in self._roots:
            root._block()
        if _in_rank_thread() and not self._ready.triggered:
            self._sim.baton.block(self._ready, "a future chained with then()")

    def block_until_done(self) -> None:
        """Wait in simulated time until the value is set, without raising the callbacks' error."""
        self._block()

    def wait(self) -> Any:
        """Block (in simulated time) until the roots are done; return the value."""
        self._block()
        return super().wait()

    def value(self) -> Any:
        """The value, once the roots are done."""
        self._block()
        return super().value()

    def then(self, callback: Any) -> Future:
        """Chain further; the result again waits for the roots in simulated time."""
        return _drained(_ThenFuture([self], super().then(_after_completion(self._sim, callback))))


def sim_roots(futures: Any) -> list[Any]:
    """The simdist futures among ``futures`` (each has ``_block()``: wait in simulated time until it is done)."""
    return [f for f in futures if isinstance(f, (SimFuture, _ThenFuture))]


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _caller_is_torch() -> bool:
    """Whether ``get_future`` was called by torch (its C++ reducer, or one of its own comm hooks)."""
    frame = sys._getframe(2)
    return frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR)


def _in_rank_thread() -> bool:
    return current_rank_state() is not None


class SimWork(dist.Work):
    """The handle of one rank's part of a collective or point-to-point operation.

    Completes at the simulated time that rank's part finishes; ``get_future()`` then holds the output
    tensors (what DDP's communication hooks read).
    """

    def __init__(self, sim: RunContext, description: str, outputs: list[torch.Tensor], timeout: float | None) -> None:
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
        #: run at completion, before the work counts as done (e.g. copying a flat buffer back into a list)
        self.on_complete: Any = None
        #: the global rank whose part this is (set by the issuing process group)
        self.rank = -1
        #: the collective's running schedule, from its start until this rank's part completes
        self.messages: Any = None

    # ---------------------------------------------------------------- completion (simpy thread)
    def complete(self) -> None:
        """Mark done at the current simulated time and fulfil the future."""
        if self.event.triggered:
            return
        if self.on_complete is not None:
            self.on_complete()
        self.messages = None
        self.completed_at = self.sim.env.now
        entry = self.__dict__.get("_race_entry")
        if entry is not None:
            entry.done_at = self.completed_at
        self.event.succeed()
        if self.future.chained and self.rank >= 0:
            future, outputs = self.future, self.outputs
            self.sim.callbacks.post(self.rank, lambda: future.set_result(outputs))
            return
        with acting_as(self.rank):  # a future without callbacks: nothing runs as the rank but the value's setting
            self.future.set_result(self.outputs)

    # ---------------------------------------------------------------- torch API (rank threads)
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block the calling rank until done; raises :class:`SimTimeoutError` after ``timeout``."""
        self.block_until_done(timeout)
        self.sim.races.observed(self)
        return True

    def block_until_done(self, timeout: timedelta | float | None = None) -> None:
        """``wait()`` without handing the buffers back to rank code (the race detector still counts them owned)."""
        self.sim.settle()
        if self.event.processed:
            return
        limit = self.timeout
        if timeout is not None:
            limit = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            if limit <= 0:  # torch treats a zero/negative timedelta as "no timeout"
                limit = self.timeout
        env = self.sim.env
        if limit is None:
            self.sim.baton.block(self.event, self.description)
            return
        deadline = env.timeout(limit)
        self.sim.baton.block(env.any_of([self.event, deadline]), self.description)
        if not self.event.triggered:
            text = f"Timed out after {limit:g} s of simulated time: {self.description}. " + self.sim.who_is_missing(self)
            state = getattr(self, "group_state", None)
            if state is not None and state.backend_name == "nccl":
                text = f"{self._watchdog_text(limit)} {text}"
                handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip()
                if handling in TEAR_DOWN:
                    raise ProcessTornDown(
                        f"{text}\nSome NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA "
                        f"kernels, subsequent GPU operations might run on corrupted/incomplete data. To avoid data "
                        f"inconsistency, we are taking the entire process down. (TORCH_NCCL_ASYNC_ERROR_HANDLING="
                        f"{handling} in rank {self.rank}'s environment: NCCL's watchdog ends the process)"
                    )
            raise SimTimeoutError(text)

    def _watchdog_text(self, limit: float) -> str:
        """The line ProcessGroupNCCL's watchdog logs for this work when it times out."""
        name = getattr(self, "op_name", "")
        op = _OP_TYPES.get(name, name.replace("_", "").upper())
        numel = getattr(self, "numel", None)
        numel_text = f", NumelIn={numel[0]}, NumelOut={numel[1]}" if numel is not None else ""
        ms = round(limit * 1000)
        return (
            f"[Rank {self.rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={self.seq + 1}, "
            f"OpType={op}{numel_text}, Timeout(ms)={ms}) ran for {ms} milliseconds before timing out."
        )

    def is_completed(self) -> bool:
        """Whether the operation has finished at the calling rank's current simulated time.

        Polling (``while not work.is_completed(): ...``) lets simulated time pass: a ``False`` moves the rank
        on to the simulation's next event, as real time passes between two polls on real hardware.
        """
        self.sim.settle()
        if self.event.processed:
            self.sim.races.observed(self)
            return True
        if _in_rank_thread():
            self.sim.let_time_pass(self.event, self.description)
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
        if torch._C._current_graph_task_id() != -1 and torch._C._current_autograd_node() is None:
            # Taken in an engine callback at the end of backward (torch DDP with static_graph launches its
            # first iteration's all-reduces there), where C++ waits on it next: wait here, in simulated time.
            self.wait()
        else:
            drain_at_end_of_backward(self, taken_by_torch=_caller_is_torch())
        return self.future

    def synchronize(self) -> None:
        """No device streams to synchronise with on CPU."""

    def _source_rank(self) -> int:
        return self.source_rank
