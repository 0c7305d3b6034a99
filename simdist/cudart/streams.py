"""``torch.cuda.Stream`` on a simulated device: streams that run beside each other in simulated time.

Each rank's device has its default stream (the rank's compute stream) and the side streams its code makes
(``torch.cuda.Stream()``, numbered from 1 per rank). Work goes to the calling thread's current stream
(``torch.cuda.stream(s)``, ``set_stream``: per host thread and device, as on CUDA) and starts when that stream
is free, whatever the other streams are doing; one stream waits for another only through an event
(``wait_event``, ``Event.wait``) or ``wait_stream``, and the host through ``synchronize``. The values are
computed eagerly in program order, so they are those of the program written for one stream; what a stream
reads before it waited for the stream that writes it is a race (:mod:`simdist.comm.races`).
"""

from __future__ import annotations

from typing import Any

import torch

from simdist.cuda import device as current
from simdist.cudart.api import index_of
from simdist.cudart.state import active, caller, follow, rank

#: device_type of a CUDA stream (c10::DeviceType::CUDA)
CUDA_TYPE = 1


def stream_new(cls: type, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
    """``torch.cuda.Stream(device, priority)`` (a new side stream of the rank), or with ``stream_id``,
    ``device_index`` and ``device_type`` (torch's own code rebuilding a handle it was given)."""
    self = object.__new__(cls)
    if "stream_id" in kwargs:
        self.stream_id = int(kwargs["stream_id"])
        self.device_index = int(kwargs.get("device_index", current.current()))
    else:
        self.device_index = current.check(index_of(device))
        cuda = rank()
        assert cuda is not None, "torch.cuda.Stream() is answered from rank code only"
        cuda.use()
        self.stream_id = cuda.new_stream()
    self.device_type = CUDA_TYPE
    self.priority = priority
    return self


def stream_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """Everything is set by ``__new__``."""


def stream_device(self: Any) -> torch.device:
    return torch.device("cuda", self.device_index)


def stream_wait_event(self: Any, event: Any) -> None:
    """Work queued on this stream from now on waits for ``event``."""
    event.wait(self)


def stream_wait_stream(self: Any, stream: Any) -> None:
    """Work queued on this stream from now on waits for everything queued on ``stream`` so far."""
    self.wait_event(stream.record_event())


def stream_record_event(self: Any, event: Any = None) -> Any:
    """Record ``event`` (a new one if None) where this stream is now."""
    if event is None:
        event = torch.cuda.Event()
    event.record(self)
    return event


def stream_query(self: Any) -> bool:
    """Whether this stream has run everything queued on it, by the host's clock."""
    ctx = _ctx()
    return ctx.time.stream_end(self.stream_id) <= ctx.now()


def stream_synchronize(self: Any) -> None:
    """Wait on the host until this stream has run everything queued on it."""
    ctx = _ctx()
    ctx.time.synchronize_stream(self.stream_id)
    rank = caller()[0]
    ctx.races.stream_waited(rank, None, ctx.races.clock(rank, self.stream_id, ctx.now()))


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
    return torch.cuda.Stream(
        stream_id=current.current_stream(index), device_index=index, device_type=CUDA_TYPE
    )


def default_stream(device: Any = None) -> Any:
    """The device's default stream."""
    index = current.check(index_of(device))
    return torch.cuda.Stream(stream_id=0, device_index=index, device_type=CUDA_TYPE)


def set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
    """Make a stream current on its device for the calling thread (``set_stream``, ``torch.cuda.stream(s)``)."""
    current.set_current_stream(int(device_index), int(stream_id))
    follow()


def _ctx() -> Any:
    emulation = active()
    assert emulation is not None, "simulated CUDA streams used outside a run"
    return emulation.ctx
