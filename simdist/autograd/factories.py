"""Creating tensors: from host data, or filled with a constant by the executor (no host array needed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from simdist.autograd.dispatch import emit
from simdist.autograd.executor import Executor, TensorMeta, current_executor
from simdist.autograd.tensor import Tensor


def tensor(
    data: Any, dtype: Any = None, *, requires_grad: bool = False, executor: Executor | None = None
) -> Tensor:
    """A new leaf holding a copy of `data` (NumPy's dtype inference: Python floats give float64)."""
    return Tensor(data, dtype, requires_grad=requires_grad, executor=executor)


def full(
    shape: Sequence[int] | int,
    value: float,
    dtype: Any = np.float64,
    *,
    requires_grad: bool = False,
    executor: Executor | None = None,
) -> Tensor:
    """A new leaf of `shape` filled with `value`."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    ex = executor if executor is not None else current_executor()
    (t,) = emit("full", (), (TensorMeta(shape, np.dtype(dtype)),), {"value": value}, ex)
    return t.requires_grad_(requires_grad) if requires_grad else t


def zeros(shape: Sequence[int] | int, dtype: Any = np.float64, **kwargs: Any) -> Tensor:
    """A new leaf of zeros."""
    return full(shape, 0, dtype, **kwargs)


def ones(shape: Sequence[int] | int, dtype: Any = np.float64, **kwargs: Any) -> Tensor:
    """A new leaf of ones."""
    return full(shape, 1, dtype, **kwargs)


def full_like(t: Tensor, value: float, **kwargs: Any) -> Tensor:
    """A new leaf with t's shape, dtype and executor, filled with `value`."""
    return full(t.shape, value, t.dtype, executor=t.executor, **kwargs)


def zeros_like(t: Tensor, **kwargs: Any) -> Tensor:
    """A new leaf of zeros shaped like t."""
    return full_like(t, 0, **kwargs)


def ones_like(t: Tensor, **kwargs: Any) -> Tensor:
    """A new leaf of ones shaped like t."""
    return full_like(t, 1, **kwargs)
