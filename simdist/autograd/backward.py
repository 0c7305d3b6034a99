"""The backward pass: gradients flow from the roots to the leaves over the explicit graph, node by node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from simdist.autograd.dispatch import emit
from simdist.autograd.errors import (
    BackwardError,
    GraphReleasedError,
    NonDifferentiableError,
    ShapeError,
)
from simdist.autograd.executor import TensorMeta
from simdist.autograd.grad_mode import MODE
from simdist.autograd.graph import _CURRENT, Edge, Graph, Node, current_graph, edge_of, topological_order
from simdist.autograd.tensor import Tensor


def _filled(meta: TensorMeta, value: float, node: Node) -> Tensor:
    """A constant of `meta` made by the executor (seed ones, zeros for outputs that got no gradient)."""
    return emit("full", (), (meta,), {"value": value}, node.executor)[0]


class BackwardPass:
    """Reverse-mode differentiation over the nodes of `graph`, run through the tensors' executors.

    graph: the graph every traversed op node must belong to; None takes the graph of the first root's node.
    retain_graph: keep saved tensors so the graph can be traversed again (default: the value of create_graph).
    create_graph: record the backward computation itself, so gradients can be differentiated again.
    Both can be overridden per call.
    """

    def __init__(
        self, graph: Graph | None = None, *, retain_graph: bool | None = None, create_graph: bool = False
    ) -> None:
        self.graph = graph
        self.retain_graph = retain_graph
        self.create_graph = create_graph

    # --- entry points ---------------------------------------------------------------------------------------

    def run(
        self,
        loss: Tensor,
        gradient: Any = None,
        *,
        retain_graph: bool | None = None,
        create_graph: bool | None = None,
    ) -> None:
        """Accumulate d(loss)/d(leaf), weighted by `gradient` (ones for a one-element loss), into each leaf's .grad."""
        root, seed = self._seed(loss, gradient, "loss")
        self._execute([root], [seed], retain_graph, create_graph, None, False)

    def run_from_node(
        self,
        node: Node,
        gradient: Any = None,
        *,
        retain_graph: bool | None = None,
        create_graph: bool | None = None,
    ) -> None:
        """Start at `node` with `gradient` for its outputs (a tensor, or one per output: a tensor or None)."""
        metas = node.output_metas
        if gradient is None:
            if len(metas) != 1 or any(s != 1 for s in metas[0].shape):
                raise BackwardError(
                    f"run_from_node({node.describe()}) without a gradient: expected a node with one one-element "
                    f"output, found outputs of shapes {[m.shape for m in metas]}. Pass one gradient per output"
                )
            gradients: Sequence[Any] = [None]
        elif isinstance(gradient, (list, tuple)):
            gradients = gradient
        else:
            gradients = [gradient]
        if len(gradients) != len(metas):
            raise BackwardError(
                f"run_from_node({node.describe()}): got {len(gradients)} gradients, expected {len(metas)} (one per "
                "output, None for an output without gradient)"
            )
        roots: list[Edge] = []
        seeds: list[Tensor] = []
        for i, (g, meta) in enumerate(zip(gradients, metas)):
            if g is None and gradient is not None:
                continue
            seeds.append(self._check_gradient(g, meta, node.executor, f"{node.name} output {i}"))
            roots.append((node, i))
        if not roots:
            raise BackwardError(
                f"run_from_node({node.describe()}): every gradient is None, so nothing would flow; pass a "
                "gradient for at least one output"
            )
        self._execute(roots, seeds, retain_graph, create_graph, None, False)

    def gradients(
        self,
        outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
        grad_outputs: Sequence[Any] | None = None,
        *,
        retain_graph: bool | None = None,
        create_graph: bool | None = None,
        allow_unused: bool = False,
    ) -> tuple[Tensor | None, ...]:
        """d(sum of outputs * grad_outputs)/d(input) for each input, returned rather than accumulated into .grad."""
        if grad_outputs is None:
            grad_outputs = [None] * len(outputs)
        if len(grad_outputs) != len(outputs):
            raise BackwardError(
                f"got {len(grad_outputs)} grad_outputs for {len(outputs)} outputs; expected one per output"
            )
        roots, seeds = [], []
        for k, (out, g) in enumerate(zip(outputs, grad_outputs)):
            root, seed = self._seed(out, g, f"output {k}")
            roots.append(root)
            seeds.append(seed)
        captures = []
        for k, x in enumerate(inputs):
            if not isinstance(x, Tensor) or not x.requires_grad:
                raise BackwardError(
                    f"input {k} does not require grad, so it has no gradient; expected tensors with "
                    "requires_grad=True (or results computed from them). Mark it with requires_grad_()"
                )
            captures.append(edge_of(x))
        result = self._execute(roots, seeds, retain_graph, create_graph, captures, allow_unused)
        assert result is not None
        return result

    # --- seeds ----------------------------------------------------------------------------------------------

    def _seed(self, loss: Tensor, gradient: Any, what: str) -> tuple[Edge, Tensor]:
        if not isinstance(loss, Tensor):
            raise BackwardError(f"the {what} is a {type(loss).__name__}, expected a Tensor")
        if not loss.requires_grad:
            raise BackwardError(
                f"the {what} (shape {loss.shape}) does not require grad, so there is no graph to run backward "
                "through; expected a result of ops on tensors with requires_grad=True. Mark the inputs with "
                "requires_grad=True and do not compute the loss under no_grad() or from detached tensors"
            )
        edge = edge_of(loss)
        where = f"the {what} (produced by {edge[0].name})"
        if gradient is None:
            if loss.size != 1:
                raise BackwardError(
                    f"{where} has shape {loss.shape} and no gradient was given; a gradient of 1 is implied "
                    f"only for a one-element loss. Reduce it first (e.g. loss.sum()) or pass a gradient of shape "
                    f"{loss.shape}"
                )
            return edge, _filled(TensorMeta(loss.shape, loss.dtype), 1, edge[0])
        return edge, self._check_gradient(gradient, TensorMeta(loss.shape, loss.dtype), loss.executor, where)

    @staticmethod
    def _check_gradient(gradient: Any, meta: TensorMeta, executor: Any, where: str) -> Tensor:
        if gradient is None:
            return emit("full", (), (meta,), {"value": 1}, executor)[0]
        if not isinstance(gradient, Tensor):
            gradient = Tensor(gradient, executor=executor)
        if gradient.shape != meta.shape:
            raise ShapeError(
                f"gradient for {where} has shape {gradient.shape}, expected {meta.shape} (the shape of what it "
                f"is the gradient of). Pass a gradient of shape {meta.shape}"
            )
        return gradient if gradient.dtype == meta.dtype else gradient.astype(meta.dtype)

    # --- the pass -------------------------------------------------------------------------------------------

    def _execute(
        self,
        roots: list[Edge],
        seeds: list[Tensor],
        retain_graph: bool | None,
        create_graph: bool | None,
        captures: list[Edge] | None,
        allow_unused: bool,
    ) -> tuple[Tensor | None, ...] | None:
        create = self.create_graph if create_graph is None else create_graph
        retain = retain_graph if retain_graph is not None else self.retain_graph
        retain = create if retain is None else retain

        order = topological_order(dict.fromkeys(node for node, _ in roots))
        capture_at: dict[Node, list[tuple[int, int]]] = {}
        run: set[Node] | None = None
        if captures is not None:
            for k, (node, index) in enumerate(captures):
                capture_at.setdefault(node, []).append((index, k))
            run = _nodes_leading_to(order, capture_at)
        graph = self._validate(order, run)

        buffers: dict[Node, list[Tensor | None]] = {}
        for (node, index), seed in zip(roots, seeds):
            buf = buffers.setdefault(node, [None] * len(node.output_metas))
            buf[index] = seed if buf[index] is None else buf[index] + seed
        captured: list[Tensor | None] = [None] * len(captures or ())

        previous = MODE.enabled
        MODE.enabled = create
        MODE.backward_depth += 1
        # With create_graph, the backward's own ops are recorded into the graph of the nodes they differentiate,
        # so a later pass over that graph accepts them.
        graphs = _CURRENT.stack
        graphs.append(graph if graph is not None else current_graph())
        try:
            for node in order:
                buf = buffers.pop(node, None)
                if buf is None:
                    continue  # no gradient reached it (every consumer returned None for it)
                if run is not None:
                    for index, k in capture_at.get(node, ()):
                        captured[k] = buf[index]
                    if node not in run:
                        continue
                if None in buf:
                    buf = [_filled(m, 0, node) if g is None else g for g, m in zip(buf, node.output_metas)]
                grads = node.fn.backward(node, *buf)
                edges = node.next_edges
                if type(grads) is not tuple:
                    grads = (grads,)
                if len(grads) != len(edges):
                    raise BackwardError(
                        f"{node.describe()}: {node.fn.__name__}.backward returned {len(grads)} gradients, expected "
                        f"{len(edges)} (one per input, None where an input gets none). Fix that backward"
                    )
                for i, grad in enumerate(grads):
                    edge = edges[i]
                    if edge is None or grad is None:
                        continue
                    meta = node.input_metas[i]
                    if type(grad) is not Tensor:
                        raise BackwardError(
                            f"{node.describe()}: {node.fn.__name__}.backward returned a {type(grad).__name__} "
                            f"for input {i}, expected a Tensor or None. Fix that backward"
                        )
                    if grad.shape != meta.shape:
                        raise ShapeError(
                            f"{node.describe()}: {node.fn.__name__}.backward returned a gradient of shape "
                            f"{grad.shape} for input {i}, expected {meta.shape} (that input's shape). Fix that "
                            "backward; a broadcast input needs its gradient summed back (sum_to)"
                        )
                    if grad.dtype != meta.dtype:
                        grad = grad.astype(meta.dtype)
                    child, index = edge
                    child_buf = buffers.get(child)
                    if child_buf is None:
                        child_buf = buffers[child] = [None] * len(child.output_metas)
                    previous_grad = child_buf[index]
                    # Paths converge here: their contributions add up.
                    child_buf[index] = grad if previous_grad is None else previous_grad + grad
                if not retain and node.graph is not None:
                    node.release()
        finally:
            MODE.enabled = previous
            MODE.backward_depth -= 1
            graphs.pop()

        if captures is None:
            return None
        for k, grad in enumerate(captured):
            if grad is None and not allow_unused:
                raise BackwardError(
                    f"input {k} was not used to compute the outputs (no gradient reached it); expected every input "
                    "to be part of the graph. Pass allow_unused=True to get None for it"
                )
        return tuple(captured)

    def _validate(self, order: list[Node], run: set[Node] | None) -> Graph | None:
        """Refuse before any gradient is computed, so a failing pass leaves every .grad untouched; return the
        graph the pass runs over."""
        graph = self.graph
        if graph is None:  # the graph of the first op node (leaf accumulators belong to none)
            graph = next((node.graph for node in order if node.graph is not None), None)
        for node in order:
            if run is not None and node not in run:
                continue
            if node.graph is not None and node.graph is not graph:
                raise BackwardError(
                    f"backward reached {node.describe()} of graph {node.graph.name!r}, expected only nodes of graph "
                    f"{graph.name!r} (the graph this BackwardPass runs over). Run the pass over that node's graph "
                    "or build the whole computation inside one `with graph:` block"
                )
            if node.released:
                raise GraphReleasedError(
                    f"backward reached {node.describe()}, whose saved tensors an earlier backward pass freed; "
                    "expected a graph not yet traversed. Pass retain_graph=True to the earlier backward (or run "
                    "the forward again)"
                )
            if node.fn.backward is None:
                raise NonDifferentiableError(
                    f"{node.describe()}: op {node.op!r} has no derivative, but the gradient must flow through it "
                    "to tensors that require grad; expected only differentiable ops on that path. detach() the "
                    f"op's input (or output) if no gradient should flow there, or give {node.fn.__name__} a backward"
                )
        return graph


def _nodes_leading_to(order: list[Node], targets: dict[Node, Any]) -> set[Node]:
    """Nodes that must run so gradient reaches `targets`: those with an edge into a target or such a node."""
    needed: set[Node] = set()
    for node in reversed(order):
        for edge in node.next_edges:
            if edge is not None and (edge[0] in needed or edge[0] in targets):
                needed.add(node)
                break
    return needed
