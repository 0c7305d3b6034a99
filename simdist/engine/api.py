"""Functions rank code may call to read or spend simulated time (no-ops outside a simulated run)."""

from __future__ import annotations

import math

from simdist.engine.world import _state


def now() -> float:
    """The calling rank's simulated time in seconds (0.0 outside a simulated run)."""
    sim = _state["sim"]
    return sim.now() if sim is not None else 0.0


def charge(seconds: float | str, name: str = "compute") -> None:
    """Spend ``seconds`` (a number, or a unit string such as "250us") of simulated compute on the calling rank.

    Models a kernel not run for real; a no-op outside a simulated run.
    """
    sim = _state["sim"]
    if sim is None:
        return
    from simdist.errors import ClusterSpecError
    from simdist.units import parse_time

    try:
        value = parse_time(seconds)
    except ClusterSpecError as e:  # a bad argument of rank code, not a bad cluster
        raise ValueError(f"charge: {e}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"compute time must be a finite number of seconds >= 0, got {seconds!r}")
    sim.charge(value, name)


def set_algorithms(group: object | None = None, **algorithms: str) -> None:
    """Fix the algorithm of collectives on ``group`` (the default group when None), e.g. ``all_reduce="tree"``.

    Call it from rank code; it applies to every rank of the group and overrides the cluster's choice. Outside a
    simulated run (e.g. the same code under ``real``) it only checks its arguments.
    Algorithms: ``ring``, ``tree``, ``direct``, ``rhd`` (recursive halving/doubling) or ``auto``.
    """
    import torch.distributed as dist

    from simdist.comm.algorithms import SUPPORTED

    for coll, algo in algorithms.items():
        if coll not in SUPPORTED:
            raise ValueError(f"unknown collective {coll!r}; choose from {sorted(SUPPORTED)}")
        if algo != "auto" and algo not in SUPPORTED[coll]:
            raise ValueError(f"algorithm {algo!r} does not implement {coll}; choose from {SUPPORTED[coll]} or 'auto'")
    pg = group if group is not None else dist.group.WORLD
    state = getattr(pg, "state", None)
    if state is None:  # a real run (or no run): the real backend chooses its own algorithms
        return
    state.algorithms.update({c: a for c, a in algorithms.items() if a != "auto"})
    for c, a in algorithms.items():
        if a == "auto":
            state.algorithms.pop(c, None)
