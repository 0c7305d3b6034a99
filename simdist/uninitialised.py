"""Uninitialised memory in a run: filled as torch fills it under ``torch.use_deterministic_algorithms(True)``.

``torch.empty`` and the ops built on it hand out whatever memory the allocator had, so values read from it
differ between runs and between ranks. A run fills them as torch's deterministic mode does
(``torch.utils.deterministic.fill_uninitialized_memory``): NaN for floating-point and complex tensors, the
largest value for integer and bool ones. A program that reads memory it never wrote then shows NaN on every
rank in every run, instead of a value that changes silently. The rank's dispatch mode (the compute cost mode,
the race check, else :class:`FillMode`) and the simulated GPU's ops call :func:`fill`; the fill takes no
simulated time (the program's own ``torch.empty`` launches no kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from simdist.untraced import never_compiled

aten = torch.ops.aten

#: factories whose whole output is uninitialised
FACTORIES = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_strided.default,
        aten.empty_permuted.default,
    }
)
#: in-place resizes whose new elements are uninitialised
RESIZES = frozenset({aten.resize_.default, aten.resize_as_.default})
#: every op :func:`fill` acts on
OPS = FACTORIES | RESIZES


def value(dtype: torch.dtype) -> float | int | bool:
    """What torch's deterministic mode writes into uninitialised memory of ``dtype``."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def _has_data(t: Any) -> bool:
    """Whether ``t`` is a plain tensor with memory of its own (not meta, fake or another subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


def stored_bytes(func: Any, args: Any) -> int | None:
    """Before a resize: the bytes its tensor's storage holds (what stays initialised), else None."""
    if func in RESIZES and args and _has_data(args[0]):
        return args[0].untyped_storage().nbytes()
    return None


def fill(func: Any, out: Any, before: int | None = None) -> None:
    """Fill what ``func`` (one of :data:`OPS`) left uninitialised in ``out``; ``before``: :func:`stored_bytes`."""
    if not _has_data(out) or out.numel() == 0 or out.is_quantized:
        return
    with torch.no_grad():
        if func in FACTORIES:
            out.fill_(value(out.dtype))
        elif before is not None and out.is_contiguous():
            start = max(0, before // out.element_size() - out.storage_offset())
            if start < out.numel():
                out.view(-1)[start:].fill_(value(out.dtype))


class FillMode(TorchDispatchMode):
    """A rank's dispatch mode where the run needs no other: fills what :data:`OPS` leave uninitialised."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    @never_compiled
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in OPS:
            return func(*args, **(kwargs or {}))
        before = stored_bytes(func, args)
        out = func(*args, **(kwargs or {}))
        fill(func, out, before)
        return out
