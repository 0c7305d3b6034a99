"""The run whose simulated CUDA devices ``torch.cuda`` answers for, and which rank is asking."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simdist.clock.baton import current_rank_state
from simdist.comm.context import RunContext
from simdist.compute.devices import DeviceSpec
from simdist.cuda.rank import RankCuda


@dataclass
class Emulation:
    """One run's simulated CUDA runtime: its communication context, device model, GPUs per node and ranks."""

    ctx: RunContext
    spec: DeviceSpec
    per_node: int
    ranks: list[RankCuda]
    #: whether a memory function has already warned that the run accounts no memory
    warned_memory: bool = False


_active: list[Emulation] = []


def active() -> Emulation | None:
    """The run emulating CUDA now, or None."""
    return _active[-1] if _active else None


def activate(emulation: Emulation | None) -> None:
    """Make ``emulation`` the run ``torch.cuda`` answers for (None: no run)."""
    _active.clear()
    if emulation is not None:
        _active.append(emulation)


def rank() -> RankCuda | None:
    """The calling rank's simulated devices, or None outside rank code (where torch's own functions answer)."""
    state = current_rank_state()
    emulation = active()
    if state is None or emulation is None:
        return None
    return emulation.ranks[state.rank]


def in_ranks(original: Any, emulated: Any) -> Any:
    """``emulated`` called from rank code, ``original`` (torch's own) from anywhere else."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if current_rank_state() is None:
            return original(*args, **kwargs)
        return emulated(*args, **kwargs)

    call.__name__ = getattr(original, "__name__", getattr(emulated, "__name__", "call"))
    call.__qualname__ = getattr(original, "__qualname__", call.__name__)
    call.__doc__ = getattr(original, "__doc__", None)
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call
