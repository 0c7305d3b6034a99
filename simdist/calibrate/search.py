"""The one-dimensional search and the loss the nonlinear fits (a device's figures, NCCL's corrections) share."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

#: a log error beyond this factor counts linearly, not squared (:func:`log_loss`)
HUBER = 2.0


def golden(loss: Callable[[float], float], lo: float, hi: float, tol: float = 1e-3) -> float:
    """The ``x`` in [lo, hi] minimising a unimodal ``loss`` (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
    f1, f2 = loss(x1), loss(x2)
    while hi - lo > tol:
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - g * (hi - lo)
            f1 = loss(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + g * (hi - lo)
            f2 = loss(x2)
    return (lo + hi) / 2


def bracketed(loss: Callable[[float], float], lo: float, hi: float, tol: float = 1e-3, points: int = 24) -> float:
    """The ``x`` in [lo, hi] minimising ``loss`` where it may have several valleys: the best of ``points`` evenly
    spaced trials, refined by :func:`golden` between its neighbours (a model whose choice of algorithm changes
    with its parameters, as NCCL's does, is not unimodal in them)."""
    xs = [lo + (hi - lo) * i / points for i in range(points + 1)]
    best = min(range(len(xs)), key=lambda i: loss(xs[i]))
    return golden(loss, xs[max(best - 1, 0)], xs[min(best + 1, points)], tol)


def log_loss(predicted: np.ndarray, measured: np.ndarray, weight: np.ndarray | float = 1.0) -> float:
    """Weighted Huber loss of the log errors: quadratic within a factor ``HUBER`` of the measurement, linear
    beyond, so that one call a loaded machine delayed hundreds of times does not decide a fit."""
    r = np.abs(np.log(predicted / measured))
    d = math.log(HUBER)
    return float(np.sum(weight * np.where(r < d, r * r, 2 * d * r - d * d)))
