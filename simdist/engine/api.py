"""Functions rank code may call to read or spend simulated time (no-ops outside a simulated run)."""

from __future__ import annotations

from simdist.engine.world import _state


def now() -> float:
    """The calling rank's simulated time in seconds (0.0 outside a simulated run)."""
    sim = _state["sim"]
    return sim.now() if sim is not None else 0.0


def charge(seconds: float, name: str = "compute") -> None:
    """Spend ``seconds`` of simulated compute on the calling rank (e.g. to model a kernel not run for real)."""
    if seconds < 0:
        raise ValueError(f"compute time must be >= 0 seconds, got {seconds}")
    sim = _state["sim"]
    if sim is not None:
        sim.charge(seconds, name)


def set_algorithms(group: object | None = None, **algorithms: str) -> None:
    """Fix the algorithm of collectives on ``group`` (the default group when None), e.g. ``all_reduce="tree"``.

    Call it from rank code; it applies to every rank of the group and overrides the cluster's choice.
    Algorithms: ``ring``, ``tree``, ``direct``, ``rhd`` (recursive halving/doubling) or ``auto``.
    """
    import torch.distributed as dist

    from simdist.comm.algorithms import SUPPORTED

    pg = group if group is not None else dist.group.WORLD
    state = getattr(pg, "state", None)
    if state is None:
        raise RuntimeError("set_algorithms needs a group of a simulated run (call it from rank code)")
    for coll, algo in algorithms.items():
        if coll not in SUPPORTED:
            raise ValueError(f"unknown collective {coll!r}; choose from {sorted(SUPPORTED)}")
        if algo != "auto" and algo not in SUPPORTED[coll]:
            raise ValueError(f"algorithm {algo!r} does not implement {coll}; choose from {SUPPORTED[coll]} or 'auto'")
    state.algorithms.update({c: a for c, a in algorithms.items() if a != "auto"})
    for c, a in algorithms.items():
        if a == "auto":
            state.algorithms.pop(c, None)
