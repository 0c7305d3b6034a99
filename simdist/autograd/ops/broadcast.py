"""Broadcasting and its adjoint: expand a tensor to a shape, and sum a gradient back to the input's shape."""

from __future__ import annotations

from simdist.autograd.dispatch import emit1
from simdist.autograd.errors import ShapeError
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.shapes import broadcast_shapes, sum_to_axes
from simdist.autograd.sites import call_site
from simdist.autograd.tensor import Tensor


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


def sum_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum `t` over the axes that broadcasting added or stretched, giving `shape`; `t` itself if already so."""
    if t.shape == shape:
        return t
    if broadcast_shapes(shape, t.shape, "sum_to") != t.shape:
        raise ShapeError(
            f"sum_to at {call_site()}: shape {shape} does not broadcast to {t.shape}, so {t.shape} cannot be "
            f"summed back to it; expected a shape that broadcasts to {t.shape}"
        )
    from simdist.autograd.ops.reduce import Sum

    axes = sum_to_axes(t.shape, shape)
    out = Sum.apply(t, axis=axes, keepdims=True) if axes else t
    return out if out.shape == shape else out.reshape(shape)
