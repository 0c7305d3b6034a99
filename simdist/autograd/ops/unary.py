"""Elementwise functions of one tensor: exp, log, tanh, sigmoid, relu."""

from __future__ import annotations

from simdist.autograd.dispatch import emit1
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.ops.compare import compare, where
from simdist.autograd.shapes import floating_meta
from simdist.autograd.tensor import Tensor


def _floating(op: str, x: Tensor) -> Tensor:
    return emit1(op, (x,), floating_meta(x.meta))


class Exp(Function):
    """e ** x; backward reuses the output."""

    op = "exp"

    @staticmethod
    def forward(ctx: Node, x: Tensor) -> Tensor:
        """Same shape, floating dtype; saves the output."""
        out = _floating("exp", x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """d/dx = e**x (the saved output)."""
        (out,) = ctx.saved_tensors
        return grad * out


class Log(Function):
    """Natural log of x."""

    op = "log"

    @staticmethod
    def forward(ctx: Node, x: Tensor) -> Tensor:
        """Same shape, floating dtype; saves the input."""
        ctx.save_for_backward(x)
        return _floating("log", x)

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """d/dx = 1/x."""
        (x,) = ctx.saved_tensors
        return grad / x


class Tanh(Function):
    """tanh(x); backward is 1 - tanh(x)**2 from the output."""

    op = "tanh"

    @staticmethod
    def forward(ctx: Node, x: Tensor) -> Tensor:
        """Same shape, floating dtype; saves the output."""
        out = _floating("tanh", x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """d/dx = 1 - tanh(x)**2."""
        (out,) = ctx.saved_tensors
        return grad * (1.0 - out * out)


class Sigmoid(Function):
    """1 / (1 + e ** -x); backward is s * (1 - s) from the output s."""

    op = "sigmoid"

    @staticmethod
    def forward(ctx: Node, x: Tensor) -> Tensor:
        """Same shape, floating dtype; saves the output."""
        out = _floating("sigmoid", x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """d/dx = s * (1 - s)."""
        (out,) = ctx.saved_tensors
        return grad * (1.0 - out) * out


class Relu(Function):
    """max(x, 0); the gradient passes where the output is positive (0 at x == 0, as in torch)."""

    op = "relu"

    @staticmethod
    def forward(ctx: Node, x: Tensor) -> Tensor:
        """Same shape and dtype; saves the output."""
        out = emit1("relu", (x,), x.meta)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> Tensor:
        """The gradient where the output is positive, else 0."""
        (out,) = ctx.saved_tensors
        # A mask, not a product: grad * 0 would turn an inf or nan gradient into nan where torch gives 0.
        return where(compare("gt", out, out._lift(0)), grad, 0.0)
