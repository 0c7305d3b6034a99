"""Elementwise arithmetic with NumPy broadcasting: add, sub, mul, div, neg, pow (tensor or scalar exponent)."""

from __future__ import annotations

from simdist.autograd.dispatch import emit1
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.ops.compare import compare, logical_and, where
from simdist.autograd.ops.reduce import sum_to
from simdist.autograd.shapes import binary_meta, floating_meta
from simdist.autograd.tensor import Tensor

Grads = tuple[Tensor | None, Tensor | None]


def _meta(op: str, a: Tensor, b: Tensor) -> TensorMeta:
    return binary_meta(a.meta, b.meta, op)


class Add(Function):
    """a + b."""

    op = "add"

    @staticmethod
    def forward(ctx: Node, a: Tensor, b: Tensor) -> Tensor:
        """Broadcast shape, promoted dtype."""
        return emit1("add", (a, b), _meta("add", a, b))

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Grads:
        """d/da = d/db = 1, summed back over broadcast axes."""
        need_a, need_b = ctx.needs_input_grad
        return (
            sum_to(grad, ctx.input_metas[0].shape) if need_a else None,
            sum_to(grad, ctx.input_metas[1].shape) if need_b else None,
        )


class Sub(Function):
    """a - b."""

    op = "sub"

    @staticmethod
    def forward(ctx: Node, a: Tensor, b: Tensor) -> Tensor:
        """Broadcast shape, promoted dtype."""
        return emit1("sub", (a, b), _meta("sub", a, b))

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Grads:
        """d/da = 1, d/db = -1, summed back over broadcast axes."""
        need_a, need_b = ctx.needs_input_grad
        return (
            sum_to(grad, ctx.input_metas[0].shape) if need_a else None,
            sum_to(-grad, ctx.input_metas[1].shape) if need_b else None,
        )


class Mul(Function):
    """a * b."""

    op = "mul"

    @staticmethod
    def forward(ctx: Node, a: Tensor, b: Tensor) -> Tensor:
        """Broadcast shape, promoted dtype; saves both inputs."""
        ctx.save_for_backward(a, b)
        return emit1("mul", (a, b), _meta("mul", a, b))

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Grads:
        """d/da = b, d/db = a."""
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        return (
            sum_to(grad * b, a.shape) if need_a else None,
            sum_to(grad * a, b.shape) if need_b else None,
        )


class Div(Function):
    """a / b (true division)."""

    op = "div"

    @staticmethod
    def forward(ctx: Node, a: Tensor, b: Tensor) -> Tensor:
        """Broadcast shape, floating dtype; saves both inputs."""
        ctx.save_for_backward(a, b)
        return emit1("div", (a, b), floating_meta(_meta("div", a, b)))

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Grads:
        """d/da = 1/b, d/db = -a/b**2."""
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        return (
            sum_to(grad / b, a.shape) if need_a else None,
            # d(a/b)/db = -(a/b)/b, grouped as torch does so results agree to the last bit more often.
            sum_to(-grad * ((a / b) / b), b.shape) if need_b else None,
        )


class Neg(Function):
    """-x."""

    op = "neg"

    @staticmethod
    def forward(ctx: Node, x: Tensor) -> Tensor:
        """Same shape and dtype."""
        return emit1("neg", (x,), x.meta)

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """d/dx = -1."""
        return -grad


class Pow(Function):
    """a ** b for a tensor exponent; both sides get gradients (the exponent's through log(a))."""

    op = "pow"

    @staticmethod
    def forward(ctx: Node, a: Tensor, b: Tensor) -> Tensor:
        """Broadcast shape, promoted dtype; saves inputs and output."""
        meta = _meta("pow", a, b)
        out = emit1("pow", (a, b), meta)
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Grads:
        """d/da = b * a**(b-1), d/db = a**b * log(a)."""
        a, b, out = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        grad_a = grad_b = None
        if need_a:
            # b * a**(b-1) is 0 * inf at a == 0, b == 0; torch defines it as 0 there, and so do we.
            grad_a = sum_to(where(compare("eq", b, b._lift(0)), 0.0, grad * (b * a ** (b - 1))), a.shape)
        if need_b:
            # a**b * log(a) is 0 * -inf at a == 0; for b >= 0 the limit is 0 (torch's convention).
            at_zero = logical_and(compare("eq", a, a._lift(0)), compare("ge", b, b._lift(0)))
            grad_b = sum_to(grad * where(at_zero, 0.0, out * a.log()), b.shape)
        return grad_a, grad_b


class PowScalar(Function):
    """x ** exponent for a Python-number exponent (an attribute, not an input)."""

    op = "pow_scalar"

    @staticmethod
    def forward(ctx: Node, x: Tensor, exponent: float) -> Tensor:
        """Same shape, floating dtype; saves the input."""
        ctx.save_for_backward(x)
        ctx.exponent = exponent
        return emit1("pow_scalar", (x,), floating_meta(x.meta), {"exponent": exponent})

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """d/dx = p * x**(p-1) (0 for p == 0)."""
        (x,) = ctx.saved_tensors
        p = ctx.exponent
        if p == 0.0:
            # x**0 is constant; the formula below would give 0 * x**-1, which is nan at x == 0.
            return grad * 0.0
        return grad * (p * x ** (p - 1.0))
