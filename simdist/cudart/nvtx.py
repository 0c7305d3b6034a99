"""NVTX ranges in rank code: named spans in the trace, on the host's timeline and projected onto the device.

``torch.cuda.nvtx.range_push(name)`` / ``range_pop()`` (and ``range(name)``, built on them) open and close a
range per host thread, nested as a stack; ``range_start`` / ``range_end`` a range by handle; ``mark`` an instant.
Each closed range becomes two spans of the rank: on stream ``nvtx``, from the host's time at the push to its
time at the pop (what Nsight Systems draws on the CPU thread: short, since the host runs ahead of its device),
and on stream ``nvtx:device``, from where the thread's current stream was at the push (where the range's first
kernel starts) to where it was at the pop (where its last kernel ends), as Nsight Systems projects a range onto
the GPU. Both carry the range's nesting ``depth`` (0 for the outermost). A pop without a push returns -1, as
NVTX returns a negative depth on error; a range still open when the rank ends is not recorded.

``torch.profiler.record_function(name)`` ranges the rank's code opens (as a context manager or a decorator) are
recorded the same way, nested with the NVTX ranges; torch's own (an optimizer's step, DDP's forward) are not, so
programs that do not annotate themselves keep their traces.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.autograd import profiler

from simdist.clock.baton import current_rank_state
from simdist.clock.sites import TORCH_DIR
from simdist.comm.context import RunContext
from simdist.cudart.state import active, in_rank_code
from simdist.trace.trace import NVTX, NVTX_DEVICE

_thread = threading.local()


class NvtxRanges:
    """``torch.cuda.nvtx``'s native functions: recorded in rank code, torch's stub (which raises on a CPU build)
    elsewhere."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Any:
        original = getattr(self._stub, name, None)
        own = _RECORDERS.get(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if current_rank_state() is None:
                if in_rank_code():  # a real process emulating CUDA by itself: no trace to record ranges in
                    return 0
                if original is None:
                    raise AttributeError(f"{type(self._stub).__name__!r} object has no attribute {name!r}")
                return original(*args, **kwargs)
            return own(*args, **kwargs) if own is not None else 0

        return call


def _ctx() -> RunContext:
    emulation = active()
    assert emulation is not None, "NVTX ranges recorded outside a run"
    return emulation.ctx


def _open(name: str) -> tuple[str, float, float]:
    ctx = _ctx()
    return str(name), ctx.now(), ctx.time.stream_end()


def _close(opened: tuple[str, float, float], depth: int) -> None:
    """Record range ``opened`` (its name, host and device start), closed now, at nesting ``depth``."""
    ctx = _ctx()
    name, host_start, device_start = opened
    rank = current_rank_state().rank
    ctx.trace.span(rank, NVTX, name, host_start, ctx.now(), {"depth": depth})
    ctx.trace.span(
        rank, NVTX_DEVICE, name, device_start, max(device_start, ctx.time.stream_end()), {"depth": depth}
    )


def _stack() -> list[tuple[str, float, float]]:
    stack = getattr(_thread, "stack", None)
    if stack is None:
        stack = _thread.stack = []
    return stack


def range_push(msg: str) -> int:
    """Open a range on the calling thread's stack: its zero-based depth."""
    stack = _stack()
    stack.append(_open(msg))
    return len(stack) - 1


def range_pop() -> int:
    """Close the innermost open range of the calling thread: its depth, or -1 if none is open."""
    stack = _stack()
    if not stack:
        return -1
    opened = stack.pop()
    _close(opened, len(stack))
    return len(stack)


def range_start(msg: str) -> int:
    """Open a range that any thread of the rank may end: its handle."""
    ranges = _handles()
    ranges["next"] = handle = ranges.get("next", 0) + 1
    ranges[handle] = _open(msg)
    return handle


def range_end(handle: int) -> None:
    """Close the range ``range_start`` returned ``handle`` for (an unknown handle is ignored, as NVTX does)."""
    opened = _handles().pop(int(handle), None)
    if opened is not None:
        _close(opened, 0)


def mark(msg: str) -> None:
    """An instant: a range of no length on both streams."""
    _close(_open(msg), len(_stack()))


def _handles() -> dict[Any, Any]:
    """The open ``range_start`` ranges of the calling rank (shared by its threads), by handle."""
    emulation = active()
    assert emulation is not None
    rank = current_rank_state().rank
    return emulation.nvtx_handles.setdefault(rank, {})


_RECORDERS = {
    "rangePushA": range_push,
    "rangePop": range_pop,
    "rangeStartA": range_start,
    "rangeEnd": range_end,
    "markA": mark,
}


#: files whose frames stand between ``record_function.__enter__`` and the code that opened the range
_CONTEXT_FILES = (os.path.abspath(contextlib.__file__), os.path.abspath(profiler.__file__))


def _opened_by_user(frame: FrameType | None) -> bool:
    """Whether the code that opened a ``record_function`` range (the first frame outside the context machinery,
    from ``frame`` outwards) is the program's, not torch's."""
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _CONTEXT_FILES:
        frame = frame.f_back
    return frame is not None and not os.path.abspath(frame.f_code.co_filename).startswith(TORCH_DIR)


def record_function_methods() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``record_function.__enter__`` and ``__exit__`` that also record the program's own ranges in rank code."""
    enter, leave = profiler.record_function.__enter__, profiler.record_function.__exit__

    def __enter__(self: Any) -> Any:
        out = enter(self)
        if current_rank_state() is not None and _opened_by_user(sys._getframe(1)):
            # a decorator enters the same object once per call, recursion included
            self._simdist_ranges = getattr(self, "_simdist_ranges", 0) + 1
            range_push(self.name)
        return out

    def __exit__(self: Any, *exc: Any) -> Any:
        try:
            return leave(self, *exc)
        finally:
            if getattr(self, "_simdist_ranges", 0) > 0 and current_rank_state() is not None:
                self._simdist_ranges -= 1
                range_pop()

    return __enter__, __exit__
