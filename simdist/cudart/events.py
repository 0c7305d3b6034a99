"""``torch.cuda.Event`` on a simulated device, in simulated time.

An event records where a stream (the current one unless named) will be once everything queued on it before has
run: ``query()`` tells whether the host's clock has reached that point, ``synchronize()`` waits for it,
``wait(stream)`` makes a stream's later work wait for it (:mod:`simdist.cudart.streams`), and ``elapsed_time``
is the simulated milliseconds between two recorded events (of any streams of the device), refused with CUDA's
"device not ready" while the later one has not completed.
"""

from __future__ import annotations

from typing import Any

from simdist.cuda import device as current
from simdist.cudart.state import active, caller
from simdist.errors import CudaError


# ---------------------------------------------------------------------------------------------- events
def event_new(
    cls: type, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs: Any
) -> Any:
    """A new simulated event (not recorded yet)."""
    self = object.__new__(cls)
    self.enable_timing = bool(enable_timing)
    self.blocking = bool(blocking)
    self._time: float | None = None
    #: what it orders after it, per stream (see ``RaceDetector.clock``), once recorded
    self._clock: dict[int, float] = {}
    self._device_index: int | None = None
    return self


def event_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """Everything is set by ``__new__``."""


def event_record(self: Any, stream: Any = None) -> None:
    """Stamp the event where ``stream`` (the current stream for None) will be once everything queued on it has
    run."""
    ctx = _ctx()
    rank, current_stream = caller()
    number = current_stream if stream is None else int(stream.stream_id)
    self._time = ctx.time.stream_end(number)
    self._clock = ctx.races.clock(rank, number, self._time)
    self._device_index = current.current() if stream is None else stream.device_index


def event_query(self: Any) -> bool:
    """Whether the device has reached the event by the host's clock (True for an event never recorded)."""
    return self._time is None or self._time <= _ctx().now()


def event_synchronize(self: Any) -> None:
    """Wait on the host until the device reaches the event."""
    if self._time is None:
        return
    ctx = _ctx()
    ctx.time.wait_for_device(self._time)
    ctx.races.stream_waited(caller()[0], None, self._clock)


def event_wait(self: Any, stream: Any = None) -> None:
    """Make ``stream``'s (the current stream's for None) work queued from now on wait for the event, as
    ``cudaStreamWaitEvent``; an event never recorded is no wait, as on CUDA."""
    if self._time is None:
        return
    ctx = _ctx()
    rank, current_stream = caller()
    number = current_stream if stream is None else int(stream.stream_id)
    ctx.time.stream_wait(number, self._time)
    ctx.races.stream_waited(rank, number, self._clock)


def event_elapsed_time(self: Any, end_event: Any) -> float:
    """Simulated milliseconds from this event to ``end_event``, both recorded and reached by the host's clock."""
    if not (self.enable_timing and end_event.enable_timing):
        raise CudaError(
            "CUDA error: invalid resource handle: both events must be created with torch.cuda.Event(enable_timing=True) "
            "to measure the time between them"
        )
    if self._time is None or end_event._time is None:
        raise CudaError(
            "CUDA error: invalid resource handle: both events must be recorded (event.record()) before "
            "elapsed_time"
        )
    if not (event_query(self) and event_query(end_event)):
        raise CudaError(
            "CUDA error: device not ready: the device has not reached the end event yet on the host's clock; "
            "call end_event.synchronize() or torch.cuda.synchronize() before elapsed_time, as on a GPU"
        )
    return (end_event._time - self._time) * 1e3


def event_repr(self: Any) -> str:
    state = "not recorded" if self._time is None else f"recorded at {self._time * 1e6:.3f} us"
    return f"<torch.cuda.Event {state} (simulated)>"


def event_ipc_handle(self: Any) -> Any:
    raise CudaError("CUDA IPC is not simulated: events cannot be shared between processes in a simulated run")


def _ctx() -> Any:
    emulation = active()
    assert emulation is not None, "simulated CUDA events used outside a run"
    return emulation.ctx
