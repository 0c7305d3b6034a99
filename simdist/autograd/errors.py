"""Errors raised by the autograd engine: each says what was expected, what was found, where, and what to do."""

from __future__ import annotations

from simdist.errors import SimdistError


class AutogradError(SimdistError):
    """Base class of every error the autograd engine raises on purpose."""


class ShapeError(AutogradError, ValueError):
    """Shapes that do not fit: an op's inputs, a loss gradient, or a gradient a backward returned."""


class GraphCycleError(AutogradError, RuntimeError):
    """A (hand-built) graph has a cycle, so it has no reverse topological order to run backward in."""


class NonDifferentiableError(AutogradError, RuntimeError):
    """A gradient is needed through an op that has no backward."""


class GraphReleasedError(AutogradError, RuntimeError):
    """Backward reached a node whose saved tensors an earlier pass freed (it ran without retain_graph)."""


class BackwardError(AutogradError, RuntimeError):
    """A backward pass was asked for something it cannot do (no gradient to start from, a malformed backward)."""


class ExecutorError(AutogradError, RuntimeError):
    """Tensors on different executors were combined, or an executor broke its contract (wrong shape or dtype)."""


class GradcheckError(AutogradError, AssertionError):
    """Analytic and numerical gradients disagree beyond the tolerance."""
