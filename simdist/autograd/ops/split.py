"""Multi-output split (and chunk) with its adjoint, multi-input cat."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from simdist.autograd.dispatch import emit
from simdist.autograd.errors import ShapeError
from simdist.autograd.executor import TensorMeta
from simdist.autograd.function import Function
from simdist.autograd.graph import Node
from simdist.autograd.shapes import chunk_sizes, normalize_axis, result_dtype, split_sizes
from simdist.autograd.sites import call_site
from simdist.autograd.tensor import Tensor


class Split(Function):
    """x cut along `axis` into pieces of `sizes`; one output per piece. Backward concatenates the gradients."""

    op = "split"

    @staticmethod
    def forward(ctx: Node, x: Tensor, sizes: tuple[int, ...], axis: int) -> tuple[Tensor, ...]:
        """One output per piece, sized along axis."""
        ctx.axis = axis
        indices = tuple(itertools.accumulate(sizes))[:-1]
        metas = tuple(TensorMeta(x.shape[:axis] + (s,) + x.shape[axis + 1 :], x.dtype) for s in sizes)
        return emit("split", (x,), metas, {"indices": indices, "axis": axis})

    @staticmethod
    def backward(ctx: Node, *grads: Tensor) -> Tensor:
        """The pieces' gradients concatenated."""
        # The engine hands zeros for pieces that received no gradient, so every piece is present.
        return grads[0] if len(grads) == 1 else Cat.apply(*grads, axis=ctx.axis)


class Cat(Function):
    """Tensors joined along `axis` (equal sizes elsewhere). Backward splits the gradient."""

    op = "cat"

    @staticmethod
    def forward(ctx: Node, *xs: Tensor, axis: int) -> Tensor:
        """Inputs joined along axis; equal sizes elsewhere required."""
        first = xs[0].shape
        for i, x in enumerate(xs):
            if (
                x.ndim != len(first)
                or x.shape[:axis] + x.shape[axis + 1 :] != first[:axis] + first[axis + 1 :]
            ):
                raise ShapeError(
                    f"cat at {call_site()}: input {i} has shape {x.shape}, input 0 has {first}; expected equal "
                    f"sizes on every axis but {axis}. Reshape the inputs to agree off the joined axis"
                )
        ctx.axis = axis
        ctx.sizes = sizes = tuple(x.shape[axis] for x in xs)
        dtype = xs[0].dtype
        for x in xs[1:]:
            dtype = result_dtype(dtype, x.dtype)
        shape = first[:axis] + (sum(sizes),) + first[axis + 1 :]
        return emit("cat", xs, (TensorMeta(shape, dtype),), {"axis": axis})[0]

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> tuple[Tensor | None, ...]:
        """The gradient split back into the inputs' sizes."""
        pieces = Split.apply(grad, sizes=ctx.sizes, axis=ctx.axis)
        return tuple(p if need else None for p, need in zip(pieces, ctx.needs_input_grad))


def split(x: Tensor, sections: int | Sequence[int], axis: int = 0) -> tuple[Tensor, ...]:
    """Pieces of x along `axis`: an int is the piece size (the last may be smaller), a sequence the sizes."""
    axis = normalize_axis(axis, x.ndim, "split")
    return Split.apply(x, sizes=split_sizes(x.shape[axis], sections, axis), axis=axis)


def chunk(x: Tensor, chunks: int, axis: int = 0) -> tuple[Tensor, ...]:
    """torch.chunk: pieces of ceil(size / chunks) along `axis` (possibly fewer than `chunks`)."""
    axis = normalize_axis(axis, x.ndim, "chunk")
    return Split.apply(x, sizes=chunk_sizes(x.shape[axis], chunks, axis), axis=axis)


def cat(xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Tensors joined along `axis`."""
    xs = tuple(xs)
    if not xs:
        raise ValueError("cat needs at least one tensor")
    return Cat.apply(*xs, axis=normalize_axis(axis, xs[0].ndim, "cat"))
