"""Reductions over axes: sum and mean (axis=None for all axes, keepdims as in NumPy)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from simdist.autograd.dispatch import emit1
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.ops.broadcast import Expand
from simdist.autograd.shapes import float_dtype, normalize_axes, reduced_shape
from simdist.autograd.tensor import Tensor

Axis = int | Sequence[int] | None


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    # NumPy sums bools and narrow integers in 64-bit integers; floats keep their dtype.
    if dtype.kind == "b" or (dtype.kind == "i" and dtype.itemsize < 8):
        return np.dtype(np.int64)
    if dtype.kind == "u" and dtype.itemsize < 8:
        return np.dtype(np.uint64)
    return dtype


def _unreduce(ctx: Node, grad: Tensor) -> Tensor:
    """The gradient of a reduction's output spread back over the reduced axes."""
    shape = ctx.input_metas[0].shape
    if not ctx.keepdims:
        kept = reduced_shape(shape, ctx.axes, True)
        if grad.shape != kept:
            grad = grad.reshape(kept)
    return grad if grad.shape == shape else Expand.apply(grad, shape=shape)


class Sum(Function):
    """Sum over axes."""

    op = "sum"

    @staticmethod
    def forward(ctx: Node, x: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
        """x's shape without (or with size 1 at, if keepdims) the reduced axes."""
        ctx.axes = axes = normalize_axes(axis, x.ndim, "sum")
        ctx.keepdims = keepdims = bool(keepdims)
        meta = TensorMeta(reduced_shape(x.shape, axes, keepdims), _sum_dtype(x.dtype))
        return emit1("sum", (x,), meta, {"axes": axes, "keepdims": keepdims})

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """The gradient spread back over the reduced axes."""
        return _unreduce(ctx, grad)


class Mean(Function):
    """Arithmetic mean over axes."""

    op = "mean"

    @staticmethod
    def forward(ctx: Node, x: Tensor, axis: Axis = None, keepdims: bool = False) -> Tensor:
        """As sum, in a floating dtype."""
        ctx.axes = axes = normalize_axes(axis, x.ndim, "mean")
        ctx.keepdims = keepdims = bool(keepdims)
        ctx.count = math.prod(x.shape[a] for a in (range(x.ndim) if axes is None else axes))
        meta = TensorMeta(reduced_shape(x.shape, axes, keepdims), float_dtype(x.dtype))
        return emit1("mean", (x,), meta, {"axes": axes, "keepdims": keepdims})

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """The gradient spread back over the reduced axes, divided by their element count."""
        if grad.dtype.itemsize < 4:  # the count itself may not fit a half-precision float
            return _unreduce(ctx, grad) * (1.0 / ctx.count)
        return _unreduce(ctx, grad) / ctx.count
