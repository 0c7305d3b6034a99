"""Matrix product with NumPy matmul semantics: 1-D operands promoted, batch dimensions broadcast."""

from __future__ import annotations

from simdist.autograd.dispatch import emit1
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.ops.reduce import sum_to
from simdist.autograd.shapes import matmul_shape, result_dtype
from simdist.autograd.tensor import Tensor


class Matmul(Function):
    """a @ b."""

    op = "matmul"

    @staticmethod
    def forward(ctx: Node, a: Tensor, b: Tensor) -> Tensor:
        """NumPy matmul shape; saves both inputs."""
        ctx.save_for_backward(a, b)
        meta = TensorMeta(matmul_shape(a.shape, b.shape), result_dtype(a.dtype, b.dtype))
        return emit1("matmul", (a, b), meta)

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """d/da = g @ b^T, d/db = a^T @ g, summed over broadcast batch axes."""
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        # Work on the >= 2-D forms matmul promoted 1-D operands to, then undo the promotion.
        a2 = a if a.ndim > 1 else a.reshape((1,) + a.shape)
        b2 = b if b.ndim > 1 else b.reshape(b.shape + (1,))
        g2 = grad
        if b.ndim == 1:
            g2 = g2.reshape(g2.shape + (1,))
        if a.ndim == 1:
            g2 = g2.reshape(g2.shape[:-1] + (1,) + g2.shape[-1:])
        grad_a = grad_b = None
        if need_a:
            grad_a = sum_to(g2 @ b2.mT, a2.shape)
            if a.ndim == 1:
                grad_a = grad_a.reshape(a.shape)
        if need_b:
            grad_b = sum_to(a2.mT @ g2, b2.shape)
            if b.ndim == 1:
                grad_b = grad_b.reshape(b.shape)
        return grad_a, grad_b
