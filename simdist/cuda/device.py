"""Which simulated CUDA device a host thread is on, and how many there are.

CUDA's current device belongs to the host thread (``cudaSetDevice``): every thread starts on device 0, and
``torch.cuda.set_device`` in one thread leaves the others where they were. The emulated runtime keeps the same
rule. The count is process-wide while a run lasts: the GPUs of one node of the cluster, as ``device_count()``
answers on each of its machines. The C++ device guard (``simdist.cuda.native``) reads the same thread-local
value, so ``.cuda()``, ``.to("cuda")`` and ``torch.cuda.device(i)`` agree with ``torch.cuda.current_device()``.
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


def check(index: int) -> int:
    """``index`` if a simulated device has it; otherwise CUDA's invalid-ordinal error, with the count."""
    if not 0 <= index < _count[0]:
        raise CudaError(
            f"CUDA error: invalid device ordinal: device {index} does not exist; this simulated node has "
            f"{_count[0]} GPUs (cuda:0 to cuda:{_count[0] - 1}), as many as the cluster has GPUs per node"
        )
    return index


def resolve(index: int | None) -> torch.device:
    """``torch.device("cuda", index)``, the calling thread's current device for an index of None; an index the node
    does not have is refused."""
    return torch.device("cuda", current() if index is None else check(index))
