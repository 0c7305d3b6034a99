"""simdist's own per-op code is never compiled by ``torch.compile``.

Rank code may compile its model (``torch.compile(model, backend="eager")``). dynamo then compiles every Python
frame the compiled code reaches, and a dispatch mode's ``__torch_dispatch__`` is such a frame: it would trace the
cost model, the race detector and the simulated GPU's unwrapping with fake tensors, and fail. torch's own remedy
wraps each call in a dynamo-disabling shim, which costs microseconds per op and imports ``torch._dynamo`` (seconds)
on first use. Marking the code object instead costs nothing per call: dynamo's frame evaluator skips it and every
frame it calls, so simdist's code runs as plain Python inside compiled code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def never_compiled(fn: _F) -> _F:
    """Mark ``fn`` (a function, or a classmethod or staticmethod object) so that dynamo never compiles it or
    anything it calls; returns ``fn``."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if frames is not None and code is not None and hasattr(frames, "set_code_exec_strategy"):
        skip = frames._FrameAction.SKIP
        frames.set_code_exec_strategy(code, frames._FrameExecStrategy(skip, skip))
    return fn
