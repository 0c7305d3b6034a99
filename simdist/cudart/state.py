"""The run whose simulated CUDA devices ``torch.cuda`` answers for, and which rank is asking.

In a simulated run, rank code (a thread of a rank) asks; any other thread gets torch's own answers. A process
that emulates CUDA by itself (one rank per process, as ``python -m real --emulate-cuda`` starts them) is all rank
code: every thread of it asks for its one rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from simdist.clock.baton import current_rank_state
from simdist.comm.context import RunContext
from simdist.compute.devices import DeviceSpec
from simdist.cuda import device
from simdist.cuda.rank import RankCuda


@dataclass
class Emulation:
    """One run's simulated CUDA runtime: its communication context (the clock events read), device model, GPUs
    per node and ranks."""

    ctx: RunContext | Any
    spec: DeviceSpec
    per_node: int
    ranks: list[RankCuda]
    #: whether a memory function has already warned that the run accounts no memory
    warned_memory: bool = False
    #: each rank's open NVTX ranges by handle (``range_start``), and the last handle given
    nvtx_handles: dict[int, dict[Any, Any]] = field(default_factory=dict)
    #: the process's own rank when it emulates CUDA by itself (every thread is its code); None in a simulated run
    process_rank: RankCuda | None = None


_active: list[Emulation] = []


def active() -> Emulation | None:
    """The run emulating CUDA now, or None."""
    return _active[-1] if _active else None


def activate(emulation: Emulation | None) -> None:
    """Make ``emulation`` the run ``torch.cuda`` answers for (None: no run)."""
    _active.clear()
    if emulation is not None:
        _active.append(emulation)


def in_rank_code() -> bool:
    """Whether the calling thread is rank code of an emulation (a rank thread, or any thread of a process that
    emulates CUDA by itself)."""
    if current_rank_state() is not None:
        return True
    return bool(_active) and _active[-1].process_rank is not None


def rank() -> RankCuda | None:
    """The calling rank's simulated devices, or None outside rank code (where torch's own functions answer)."""
    emulation = active()
    if emulation is None:
        return None
    if emulation.process_rank is not None:
        return emulation.process_rank
    state = current_rank_state()
    return None if state is None else emulation.ranks[state.rank]


def in_ranks(original: Any, emulated: Any) -> Any:
    """``emulated`` called from rank code, ``original`` (torch's own) from anywhere else."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not in_rank_code():
            return original(*args, **kwargs)
        return emulated(*args, **kwargs)

    call.__name__ = getattr(original, "__name__", getattr(emulated, "__name__", "call"))
    call.__qualname__ = getattr(original, "__qualname__", call.__name__)
    call.__doc__ = getattr(original, "__doc__", None)
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def caller() -> tuple[int, int]:
    """The calling rank and the number of its current stream; in a process of its own (``python -m real
    --emulate-cuda``), which has no simulated rank, rank 0 and the thread's current stream."""
    state = current_rank_state()
    if state is not None:
        return state.rank, state.stream
    return 0, device.current_stream(device.current())


@contextlib.contextmanager
def device_work(index: int) -> Iterator[None]:
    """The calling rank thread's device work goes to its current stream on device ``index`` meanwhile: an op on that
    device's tensors runs there whatever the thread's current device (torch guards each op to its tensors' device;
    an autograd hook may run while the current device is another)."""
    state = current_rank_state()
    if state is None or index == device.current():
        yield
        return
    saved = state.stream
    state.stream = device.current_stream(index)
    try:
        yield
    finally:
        state.stream = saved


def follow() -> None:
    """Send the calling rank thread's device work to its current stream on its current device (after either
    changed)."""
    state = current_rank_state()
    if state is not None:
        state.stream = device.current_stream(device.current())
