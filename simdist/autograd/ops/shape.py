"""Ops that move values without changing them: reshape, permute (transpose) and cast."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from simdist.autograd.dispatch import emit1
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.shapes import permute_axes, reshape_shape
from simdist.autograd.tensor import Tensor


class Reshape(Function):
    """x with the same elements in a new shape (one size may be -1)."""

    op = "reshape"

    @staticmethod
    def forward(ctx: Node, x: Tensor, shape: Sequence[int]) -> Tensor:
        """The new shape (-1 resolved); same element count."""
        new = reshape_shape(x.shape, shape)
        return emit1("reshape", (x,), TensorMeta(new, x.dtype), {"shape": new})

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """The gradient reshaped back."""
        return grad.reshape(ctx.input_metas[0].shape)


class Permute(Function):
    """x with its axes reordered: output axis i is input axis axes[i]."""

    op = "permute"

    @staticmethod
    def forward(ctx: Node, x: Tensor, axes: Sequence[int]) -> Tensor:
        """x's shape permuted by axes."""
        ctx.axes = axes = permute_axes(axes, x.ndim)
        shape = tuple(x.shape[a] for a in axes)
        return emit1("permute", (x,), TensorMeta(shape, x.dtype), {"axes": axes})

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """The gradient permuted back (inverse permutation)."""
        inverse = [0] * len(ctx.axes)
        for i, a in enumerate(ctx.axes):
            inverse[a] = i
        return Permute.apply(grad, axes=tuple(inverse))


class Cast(Function):
    """x converted to another dtype; the gradient is converted back."""

    op = "cast"

    @staticmethod
    def forward(ctx: Node, x: Tensor, dtype: np.dtype) -> Tensor:
        """Same shape, the new dtype."""
        return emit1("cast", (x,), TensorMeta(x.shape, np.dtype(dtype)))

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """The gradient cast back to x's dtype."""
        return Cast.apply(grad, dtype=ctx.input_metas[0].dtype)
