"""Comparisons (bool results that never require grad) and where(), which routes gradients by a mask."""

from __future__ import annotations

from typing import Any

import numpy as np

from simdist.autograd.dispatch import emit1
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.ops.reduce import sum_to
from simdist.autograd.shapes import broadcast_shapes, result_dtype
from simdist.autograd.tensor import Tensor

_BOOL = np.dtype(bool)


def compare(op: str, a: Tensor, b: Tensor) -> Tensor:
    """a <op> b for op in gt, ge, lt, le, eq: a bool tensor, constant for autograd (as in torch)."""
    return emit1(op, (a, b), TensorMeta(broadcast_shapes(a.shape, b.shape, op), _BOOL))


def logical_and(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise and of two bool tensors."""
    # mul of two bools is a bool and-ing them, so the command set needs no separate op.
    return emit1("mul", (a, b), TensorMeta(broadcast_shapes(a.shape, b.shape, "logical_and"), _BOOL))


class Where(Function):
    """cond ? a : b elementwise (all three broadcast); cond gets no gradient."""

    op = "where"

    @staticmethod
    def forward(ctx: Node, cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
        """Broadcast shape of all three, dtype of a and b promoted; saves cond."""
        ctx.save_for_backward(cond)
        shape = broadcast_shapes(broadcast_shapes(cond.shape, a.shape, "where"), b.shape, "where")
        return emit1("where", (cond, a, b), TensorMeta(shape, result_dtype(a.dtype, b.dtype)))

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> tuple[None, Tensor | None, Tensor | None]:
        """The gradient goes to a where cond holds and to b elsewhere."""
        (cond,) = ctx.saved_tensors
        _, need_a, need_b = ctx.needs_input_grad
        zero = grad._lift(0.0)
        return (
            None,
            sum_to(Where.apply(cond, grad, zero), ctx.input_metas[1].shape) if need_a else None,
            sum_to(Where.apply(cond, zero, grad), ctx.input_metas[2].shape) if need_b else None,
        )


def where(cond: Tensor, a: Any, b: Any) -> Tensor:
    """a where cond is true, else b; a Python number takes the other operand's dtype."""
    if not isinstance(a, Tensor):
        if not isinstance(b, Tensor):
            raise TypeError("where(cond, a, b) needs a or b to be a Tensor; got two Python values")
        a = b._lift(a)
    if not isinstance(b, Tensor):
        b = a._lift(b)
    return Where.apply(cond, a, b)
