"""Reductions (sum, mean) and their adjoint, broadcasting: expand a tensor to a shape, sum a gradient back."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from simdist.autograd.dispatch import emit1
from simdist.autograd.errors import ShapeError
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.shapes import broadcast_shapes, float_dtype, normalize_axes, reduced_shape, sum_to_axes
from simdist.autograd.sites import call_site
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


class Expand(Function):
    """x broadcast to `shape` (NumPy rules); backward sums the gradient back to x's shape."""

    op = "expand"

    @staticmethod
    def forward(ctx: Node, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The target shape; x must broadcast to it."""
        shape = tuple(int(s) for s in shape)
        if broadcast_shapes(x.shape, shape, "expand") != shape:
            raise ShapeError(
                f"expand at {call_site()}: cannot broadcast shape {x.shape} to {shape}, expected the target to "
                "contain the input's shape (sizes equal or 1 in the input). Pick a target the input broadcasts to"
            )
        return emit1("expand", (x,), TensorMeta(shape, x.dtype), {"shape": shape})

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """Sum the gradient back to x's shape."""
        return sum_to(grad, ctx.input_metas[0].shape)


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


def sum_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum `t` over the axes that broadcasting added or stretched, giving `shape`; `t` itself if already so."""
    if t.shape == shape:
        return t
    if broadcast_shapes(shape, t.shape, "sum_to") != t.shape:
        raise ShapeError(
            f"sum_to at {call_site()}: shape {shape} does not broadcast to {t.shape}, so {t.shape} cannot be "
            f"summed back to it; expected a shape that broadcasts to {t.shape}"
        )
    axes = sum_to_axes(t.shape, shape)
    out = Sum.apply(t, axis=axes, keepdims=True) if axes else t
    return out if out.shape == shape else out.reshape(shape)
