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
