"""Leaf tensors: the sink node that accumulates gradients into `.grad`, and the edge an input contributes."""

from __future__ import annotations

import itertools
import weakref

from simdist.autograd.executor import TensorMeta
from simdist.autograd.grad_mode import MODE
from simdist.autograd.graph import Node
from simdist.autograd.tensor import Tensor

_IDS = itertools.count(1)


class AccumulateGrad:
    """The backward of a leaf: adds the incoming gradient to `leaf.grad` (a new tensor; nothing is in place)."""

    op = "accumulate_grad"

    @staticmethod
    def backward(ctx: Node, grad: Tensor) -> tuple[()]:
        """Accumulate; with create_graph off, the stored gradient carries no graph."""
        leaf = ctx.leaf
        if grad.requires_grad and not MODE.enabled:
            grad = grad.detach()
        leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        return ()


def accumulator(t: Tensor) -> Node:
    """The AccumulateGrad node of leaf `t`, shared by every graph that uses `t` while any of them lives."""
    ref = t._accumulator
    node = ref() if ref is not None else None
    if node is None:
        node = Node(AccumulateGrad)  # type: ignore[arg-type]
        node.id = next(_IDS)
        node.graph = None  # shared by every graph the leaf is used in
        node.released = False  # never released: a leaf keeps accumulating across passes
        node.site = None
        node.leaf = t
        node.executor = t.executor
        node.next_edges = ()
        node.input_metas = ()
        node.needs_input_grad = ()
        node.output_metas = (TensorMeta(t.shape, t.dtype),)
        # The tensor points at its accumulator weakly: the graph's edges keep it alive, not the leaf.
        t._accumulator = weakref.ref(node)
    return node


def edge_of(t: Tensor) -> tuple[Node, int]:
    """Where gradient for `t` (which requires grad) goes: its producing node's output, or its accumulator."""
    if t.grad_fn is not None:
        return (t.grad_fn, t.output_index)
    return (accumulator(t), 0)
