"""``torch.cuda.Event`` and ``torch.cuda.Stream`` on a simulated device, in simulated time.

Each rank's device runs one compute stream (simdist's model): a stream object rank code creates is a handle on
it, ``torch.cuda.stream(s)`` and ``set_stream`` track which handle is current (per host thread and device),
and waits between streams order nothing that is not already in order. An event records where the compute
stream will be once everything queued before it has run: ``query()`` tells whether the host's clock has reached
that point, ``synchronize()`` waits for it, and ``elapsed_time`` is the simulated milliseconds between two
recorded events, refused with CUDA's "device not ready" while the later one has not completed.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from simdist.cuda import device as current
from simdist.cudart.api import index_of
from simdist.cudart.state import active
from simdist.errors import CudaError

#: device_type of a CUDA stream (c10::DeviceType::CUDA)
_CUDA_TYPE = 1
_thread = threading.local()
_stream_ids = itertools.count(1)


def _streams() -> dict[int, int]:
    """The calling thread's current stream id per device index (0: the default stream)."""
    streams = getattr(_thread, "streams", None)
    if streams is None:
        streams = _thread.streams = {}
    return streams


# ---------------------------------------------------------------------------------------------- streams
def stream_new(cls: type, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
    """``torch.cuda.Stream(device, priority)`` (a new handle on the device's stream), or with ``stream_id``,
    ``device_index`` and ``device_type`` (torch's own code rebuilding a handle it was given)."""
    self = object.__new__(cls)
    if "stream_id" in kwargs:
        self.stream_id = int(kwargs["stream_id"])
        self.device_index = int(kwargs.get("device_index", current.current()))
    else:
        self.stream_id = next(_stream_ids)
        self.device_index = current.check(index_of(device))
    self.device_type = _CUDA_TYPE
    self.priority = priority
    return self


def stream_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """Everything is set by ``__new__``."""


def stream_device(self: Any) -> torch.device:
    return torch.device("cuda", self.device_index)


def stream_wait_event(self: Any, event: Any) -> None:
    """One stream per device: work after the wait is already ordered after the event."""


def stream_wait_stream(self: Any, stream: Any) -> None:
    """One stream per device: already in order."""


def stream_record_event(self: Any, event: Any = None) -> Any:
    """Record ``event`` (a new one if None) where the device's stream is now."""
    if event is None:
        event = torch.cuda.Event()
    event.record(self)
    return event


def stream_query(self: Any) -> bool:
    """Whether the device's stream has run everything queued on it, by the host's clock."""
    ctx = _ctx()
    return ctx.time.device_now() <= ctx.now()


def stream_synchronize(self: Any) -> None:
    """Wait on the host until the device's stream is idle."""
    _ctx().synchronize()


def stream_is_capturing(self: Any) -> bool:
    """CUDA graphs are not simulated: no stream is ever capturing."""
    return False


def stream_eq(self: Any, other: Any) -> bool:
    return (
        isinstance(other, torch.cuda.Stream)
        and other.device_index == self.device_index
        and other.stream_id == self.stream_id
    )


def stream_hash(self: Any) -> int:
    return hash((self.stream_id, self.device_index))


def stream_repr(self: Any) -> str:
    return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.stream_id:#x} (simulated)>"


def current_stream(device: Any = None) -> Any:
    """The calling thread's current stream on ``device``."""
    index = current.check(index_of(device))
    return torch.cuda.Stream(stream_id=_streams().get(index, 0), device_index=index, device_type=_CUDA_TYPE)


def default_stream(device: Any = None) -> Any:
    """The device's default stream."""
    index = current.check(index_of(device))
    return torch.cuda.Stream(stream_id=0, device_index=index, device_type=_CUDA_TYPE)


def set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
    """Make a stream current on its device for the calling thread (``set_stream``, ``torch.cuda.stream(s)``)."""
    _streams()[int(device_index)] = int(stream_id)


# ---------------------------------------------------------------------------------------------- events
def event_new(
    cls: type, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs: Any
) -> Any:
    """A new simulated event (not recorded yet)."""
    self = object.__new__(cls)
    self.enable_timing = bool(enable_timing)
    self.blocking = bool(blocking)
    self._time: float | None = None
    self._device_index: int | None = None
    return self


def event_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """Everything is set by ``__new__``."""


def event_record(self: Any, stream: Any = None) -> None:
    """Stamp the event where the device's stream will be once everything queued before it has run."""
    self._time = _ctx().time.device_now()
    self._device_index = current.current() if stream is None else stream.device_index


def event_query(self: Any) -> bool:
    """Whether the device has reached the event by the host's clock (True for an event never recorded)."""
    return self._time is None or self._time <= _ctx().now()


def event_synchronize(self: Any) -> None:
    """Wait on the host until the device reaches the event."""
    if self._time is None:
        return
    ctx = _ctx()
    ctx.settle()
    wait = self._time - ctx.now()
    if wait > 0:
        ctx.baton.sleep(wait, "cudaEventSynchronize")


def event_wait(self: Any, stream: Any = None) -> None:
    """One stream per device: work queued after the wait already follows the event."""


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
