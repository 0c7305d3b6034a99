"""Functions rank code may call to read or spend simulated time, or to fix algorithms (no-ops outside a run)."""

from __future__ import annotations

import math

import torch.distributed as dist

from simdist import algorithms
from simdist.c10d import backend
from simdist.errors import ClusterSpecError
from simdist.units import parse_time


def now() -> float:
    """The calling rank's simulated time in seconds (0.0 outside a simulated run)."""
    sim = backend.active()
    return sim.now() if sim is not None else 0.0


def synchronize() -> None:
    """Wait on the calling rank's host until its device has run everything queued on it, on every stream
    (``torch.cuda.synchronize``).

    A no-op outside a simulated run, and where the host waits for its compute anyway (CPU devices, gloo-like
    progress).
    """
    sim = backend.active()
    if sim is not None:
        sim.synchronize()


def charge(seconds: float | str, name: str = "compute") -> None:
    """Spend ``seconds`` (a number, or a unit string such as "250us") of simulated compute on the calling rank.

    Models a kernel not run for real, queued on the calling thread's current stream (a CUDA side stream inside
    ``torch.cuda.stream(s)``); a no-op outside a simulated run.
    """
    sim = backend.active()
    if sim is None:
        return
    try:
        value = parse_time(seconds)
    except ClusterSpecError as e:  # a bad argument of rank code, not a bad cluster
        raise ValueError(f"charge: {e}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"compute time must be a finite number of seconds >= 0, got {seconds!r}")
    sim.charge(value, name)


def set_algorithms(group: object | None = None, **choices: str) -> None:
    """Fix the algorithm of collectives on ``group`` (the default group when None), e.g. ``all_reduce="tree"``.

    Call it from rank code; it applies to every rank of the group and overrides the cluster's choice. Outside a
    simulated run (e.g. the same code under ``real``) it only checks its arguments. The algorithms of each
    collective are listed by ``simdist.algorithms.names(collective)``; ``"auto"`` returns to the cheapest.
    """
    for coll, algo in choices.items():
        algorithms.check_choice(coll, algo)
    pg = group if group is not None else dist.group.WORLD
    state = getattr(pg, "state", None)
    if state is None:  # a real run (or no run): the real backend chooses its own algorithms
        return
    state.algorithms.update({c: a for c, a in choices.items() if a != algorithms.AUTO})
    for c, a in choices.items():
        if a == algorithms.AUTO:
            state.algorithms.pop(c, None)
