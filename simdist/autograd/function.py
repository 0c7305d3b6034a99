"""Function: an op's forward and its backward side by side, and the recording of a graph node when it runs."""

from __future__ import annotations

from typing import Any, ClassVar

from simdist.autograd.errors import BackwardError
from simdist.autograd.executor import TensorMeta
from simdist.autograd.grad_mode import MODE
from simdist.autograd.graph import _CURRENT, _DEFAULT, Edge, Node, _SavedOutput, accumulator
from simdist.autograd.sites import call_site
from simdist.autograd.tensor import Tensor


class Function:
    """Base of every op. Subclass with:

    - ``forward(ctx, *inputs, **attrs)``: compute the outputs (Tensor or tuple of Tensors) from input Tensors by
      emitting executor commands or composing other ops; it runs without recording.
    - ``backward(ctx, *grads)``: one gradient per output in (zeros where an output got none), one gradient (or
      None) per positional input out, each with its input's shape. Written with Tensor ops, so the same formula
      records a graph when the backward pass runs with create_graph=True. Leave it None for an op that has no
      derivative: backward through it then raises NonDifferentiableError.

    Call ``Fn.apply(*inputs, **attrs)``; `ctx` is the op's graph Node.
    """

    op: ClassVar[str] = "function"
    backward: Any = None

    @staticmethod
    def forward(ctx: Node, *inputs: Any, **attrs: Any) -> Tensor | tuple[Tensor, ...]:
        """Compute the outputs; see the class docstring."""
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs: Any, **attrs: Any) -> Any:
        """Run forward; when grad mode is on and an input requires grad, record a node for the outputs."""
        mode = MODE
        if mode.enabled:
            for t in inputs:
                if type(t) is Tensor and t.requires_grad:
                    ctx = Node(cls)
                    mode.enabled = False
                    try:
                        out = cls.forward(ctx, *inputs, **attrs)
                    finally:
                        mode.enabled = True
                    _record(ctx, inputs, out)
                    return out
        # Nothing to record: forward gets the per-thread scratch ctx instead of a new Node.
        return cls.forward(mode.scratch, *inputs, **attrs)


def _record(ctx: Node, inputs: tuple[Any, ...], out: Tensor | tuple[Tensor, ...]) -> None:
    """Turn `ctx` into a graph node: input edges and metadata, outputs pointing at it, saved outputs unlinked."""
    # This runs once per recorded op, so it is written for speed: no helper calls on the common path.
    outputs = out if type(out) is tuple else (out,)
    stack = _CURRENT.stack
    graph = stack[-1] if stack else _DEFAULT
    ctx.id = next(graph._ids)
    ctx.graph = graph
    ctx.site = call_site() if graph.record_sites else None
    edges: list[Edge | None] = []
    metas: list[TensorMeta | None] = []
    needs: list[bool] = []
    executor = None
    for t in inputs:
        if type(t) is Tensor:
            metas.append(t.meta)
            executor = t.executor
            if t.requires_grad:
                producer = t.grad_fn
                edges.append((producer, t.output_index) if producer is not None else (accumulator(t), 0))
                needs.append(True)
                continue
        else:
            metas.append(None)
        edges.append(None)
        needs.append(False)
    ctx.executor = executor
    ctx.next_edges = tuple(edges)
    ctx.input_metas = tuple(metas)
    ctx.needs_input_grad = tuple(needs)
    output_metas = []
    for i, t in enumerate(outputs):
        if type(t) is not Tensor or t.requires_grad or any(t is x for x in inputs):
            found = (
                type(t).__name__
                if type(t) is not Tensor
                else "one of its inputs"
                if any(t is x for x in inputs)
                else "a tensor that already requires grad (an input?)"
            )
            raise BackwardError(
                f"{ctx.fn.__name__}.forward at {call_site()} returned {found} as output {i}; expected new "
                "Tensors. Return fresh tensors (e.g. x.detach() for an input)"
            )
        output_metas.append(t.meta)
        if t.dtype.kind in "fc":
            t.requires_grad = True
            t.grad_fn = ctx
            t.output_index = i
    ctx.output_metas = tuple(output_metas)
    if ctx._saved:
        ctx._saved = tuple([_unlink(s, outputs) for s in ctx._saved])


def _unlink(saved: Any, outputs: tuple[Tensor, ...]) -> Any:
    for i, t in enumerate(outputs):
        if saved is t:
            return _SavedOutput(i, t.data)
    return saved
