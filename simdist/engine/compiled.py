"""``torch.compile`` in rank code: what it compiles runs as a fused region of the rank's cost mode, so elementwise
chains are priced as the fused kernels a compiler makes of them (simdist.compute.fusion).

dynamo compiles nothing under a ``TorchDispatchMode`` (it runs the original code eagerly, whatever the backend),
and every rank thread runs under simdist's cost mode: so a compiled function or module runs its eager code here,
op by op, and only its price is what the compiler would make of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from simdist.compute import ComputeCostMode


def _cost_mode() -> ComputeCostMode | None:
    """The calling thread's cost mode, if it runs under one."""
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, ComputeCostMode)), None)


def _fused(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, each of its calls a fused region of the calling thread's cost mode."""

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        cost = _cost_mode()
        if cost is None:
            return call(*args, **kwargs)
        with cost.fusing():
            return call(*args, **kwargs)

    return run


def fusing_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` whose result runs as a fused region: a function is wrapped; a module (torch's
    ``OptimizedModule``, kept as torch makes it) has its forward wrapped."""

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(backend=...) as a decorator with arguments
            return lambda m: compile(m, **kwargs)
        compiled = original(model, **kwargs)
        if isinstance(compiled, torch.nn.Module):
            compiled.forward = _fused(compiled.forward)
            return compiled
        return _fused(compiled)

    return compile
