"""Which simulated CUDA device a host thread is on, and how many there are.

CUDA's current device belongs to the host thread (``cudaSetDevice``): every thread starts on device 0, and
``torch.cuda.set_device`` in one thread leaves the others where they were. The emulated runtime keeps the same
rule. The count is process-wide while a run lasts: the GPUs of one node of the cluster, as ``device_count()``
answers on each of its machines. The C++ device guard (``simdist.cuda.native``) reads the same thread-local
value, so ``.cuda()``, ``.to("cuda")`` and ``torch.cuda.device(i)`` agree with ``torch.cuda.current_device()``.

The current stream belongs to the host thread too, one per device (``torch.cuda.set_stream``): the thread's
device work goes to its current stream on its current device (``simdist.cudart.state.follow`` tells the rank's
time which one that is).
"""

from __future__ import annotations

import threading

import torch

from simdist.errors import CudaError

_thread = threading.local()
#: the GPUs of a node while a run emulates CUDA; 0 otherwise (no simulated device exists)
_count = [0]


def count() -> int:
    """How many simulated CUDA devices each rank sees (0 outside a run that emulates CUDA)."""
    return _count[0]


def set_count(n: int) -> None:
    """Make ``n`` simulated devices visible (``0``: none)."""
    _count[0] = int(n)


def current() -> int:
    """The calling thread's current device index (0 until it sets one)."""
    return getattr(_thread, "index", 0)


def set_current(index: int) -> None:
    """Make ``index`` the calling thread's current device; refused as CUDA refuses an unknown ordinal."""
    _thread.index = check(index)


def current_stream(index: int) -> int:
    """The number of the calling thread's current stream on device ``index`` (0: the default stream)."""
    streams = getattr(_thread, "streams", None)
    return 0 if streams is None else streams.get(index, 0)


def set_current_stream(index: int, stream: int) -> None:
    """Make stream number ``stream`` the calling thread's current stream on device ``index``."""
    streams = getattr(_thread, "streams", None)
    if streams is None:
        streams = _thread.streams = {}
    streams[index] = stream


#: how many devices torch can name in one process (``c10::DeviceIndex`` is 8 bits: ``torch.device("cuda", 128)`` is
#: ``cuda:-128``)
TORCH_MAX_DEVICES = 128


def check(index: int) -> int:
    """``index`` if a simulated device has it; otherwise CUDA's invalid-ordinal error, with the count."""
    if not 0 <= index < _count[0]:
        wrapped = ""
        # an index of 128 to 255 that torch wrapped to -128 to -1
        if -TORCH_MAX_DEVICES <= index < 0 and _count[0] > TORCH_MAX_DEVICES:
            wrapped = (
                f"; torch numbers devices with 8 bits, so cuda:{index + 256} is cuda:{index} and no index past "
                f"cuda:{TORCH_MAX_DEVICES - 1} can be named: give the cluster nodes of at most {TORCH_MAX_DEVICES} "
                f"GPUs (a two_level cluster or a preset such as dgx-h100, whose ranks see their own node's GPUs)"
            )
        raise CudaError(
            f"CUDA error: invalid device ordinal: device {index} does not exist; this simulated node has "
            f"{_count[0]} GPUs (cuda:0 to cuda:{_count[0] - 1}), as many as the cluster has GPUs per node{wrapped}"
        )
    return index


def resolve(index: int | None) -> torch.device:
    """``torch.device("cuda", index)``, the calling thread's current device for an index of None; an index the node
    does not have is refused."""
    return torch.device("cuda", current() if index is None else check(index))
