"""Whether ops record graph nodes: no_grad(), enable_grad(), set_grad_enabled(); per thread, as in torch."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _Scratch:
    """The ctx an op's forward gets when nothing is recorded: it accepts what forward stores and keeps none of
    the saved tensors (so an unrecorded op never extends a tensor's life)."""

    saved_tensors: tuple[()] = ()

    def save_for_backward(self, *tensors: object) -> None:
        """Keep nothing: no backward will run for an unrecorded op."""


class _GradMode(threading.local):
    # A plain attribute read is the cheapest check the hot path (every op) can make.
    enabled: bool = True
    #: how many backward passes are running in this thread (executors tag the commands they emit with it)
    backward_depth: int = 0

    def __init__(self) -> None:
        # One per thread, so ops running in different threads never share attributes set on it.
        self.scratch = _Scratch()


MODE = _GradMode()


def in_backward() -> bool:
    """True while a backward pass runs in this thread (its ops are the backward's, not the forward's)."""
    return MODE.backward_depth > 0


def is_grad_enabled() -> bool:
    """True when ops on tensors that require grad record graph nodes."""
    return MODE.enabled


class set_grad_enabled:
    """Set grad mode to `mode` for a `with` block (or, called bare, from now on); restores the old mode on exit."""

    def __init__(self, mode: bool) -> None:
        self._previous = MODE.enabled
        self._mode = bool(mode)
        MODE.enabled = self._mode

    def __enter__(self) -> None:
        MODE.enabled = self._mode

    def __exit__(self, *exc: object) -> None:
        MODE.enabled = self._previous


class _ModeContext:
    """Context manager and decorator that runs a block with grad mode forced to `_target`."""

    _target = True

    def __enter__(self) -> None:
        self._previous = MODE.enabled
        MODE.enabled = self._target

    def __exit__(self, *exc: object) -> None:
        MODE.enabled = self._previous

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with type(self)():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class no_grad(_ModeContext):
    """Ops inside do not record graph nodes; their results have requires_grad=False."""

    _target = False


class enable_grad(_ModeContext):
    """Ops inside record graph nodes again, even within no_grad()."""

    _target = True
