"""The explicit graph: Nodes (one per recorded op, holding its saved context) and the Graph that owns them."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, final

from simdist.autograd.errors import BackwardError, GraphCycleError, GraphReleasedError, ShapeError
from simdist.autograd.executor import Array, Executor, TensorMeta, current_executor
from simdist.autograd.grad_mode import MODE
from simdist.autograd.sites import call_site
from simdist.autograd.tensor import Tensor

if TYPE_CHECKING:
    from simdist.autograd.function import Function

# An edge from a node's input to the node that produced it: (producer, which of its outputs); None where the
# input needs no gradient.
Edge = tuple["Node", int]


class _SavedOutput:
    """A node's own output saved for backward, kept as its handle only so node and output form no cycle."""

    __slots__ = ("data", "index")

    def __init__(self, index: int, data: Array) -> None:
        self.index = index
        self.data = data


class Node:
    """One recorded op application: its Function (forward and backward), saved context, and input edges.

    The node is also the `ctx` a Function's forward and backward receive: forward stores what backward needs with
    save_for_backward() or as attributes; the engine fills in the edges and metadata after forward returns.
    """

    __slots__ = (
        "__dict__",
        "__weakref__",
        "_saved",
        "executor",
        "fn",
        "graph",
        "id",
        "input_metas",
        "needs_input_grad",
        "next_edges",
        "output_metas",
        "released",
        "site",
    )

    def __init__(self, fn: type[Function]) -> None:
        # Every op makes a Node as its ctx, recorded or not, so only what forward may touch is set here; the
        # rest is filled in when the node joins a graph (Graph.register).
        self.fn = fn
        self._saved: tuple[Any, ...] = ()
        self.released = False

    @property
    def op(self) -> str:
        """The op name of the node's Function (e.g. "mul")."""
        return self.fn.op

    @property
    def name(self) -> str:
        """Op name and id, e.g. "mul#17": how errors refer to the node."""
        return f"{self.fn.op}#{getattr(self, 'id', '?')}"

    def describe(self) -> str:
        """Name plus input and output shapes (and creation site when the graph records sites)."""
        ins = ", ".join("-" if m is None else str(m.shape) for m in getattr(self, "input_metas", ()))
        outs = ", ".join(str(m.shape) for m in getattr(self, "output_metas", ()))
        site = getattr(self, "site", None)
        where = f", created at {site}" if site else ""
        return f"{self.name} (inputs {ins or '()'} -> outputs {outs or '()'}{where})"

    def __repr__(self) -> str:
        return f"<Node {self.describe()}>"

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        """Keep `tensors` for backward; they are freed when a backward pass without retain_graph finishes."""
        self._saved = tensors

    @property
    def saved_tensors(self) -> tuple[Tensor | None, ...]:
        """The tensors given to save_for_backward(); the node's own outputs come back attached to this node."""
        if self.released:
            raise GraphReleasedError(
                f"{self.describe()}: its saved tensors were freed by an earlier backward pass; expected them to "
                "be kept. Pass retain_graph=True to the first backward to run backward through this graph again"
            )
        out = []
        for s in self._saved:
            if type(s) is _SavedOutput:
                t = Tensor._wrap(s.data, self.output_metas[s.index], self.executor)
                t.requires_grad = True
                t.grad_fn = self
                t.output_index = s.index
                s = t
            out.append(s)
        return tuple(out)

    def release(self) -> None:
        """Free the saved tensors; a later backward through this node raises GraphReleasedError."""
        self._saved = ()
        self.released = True


class _CurrentGraph(threading.local):
    def __init__(self) -> None:
        self.stack: list[Graph] = []


_CURRENT = _CurrentGraph()


@final
class Graph:
    """The scope nodes are recorded in: it numbers them and the backward passes over it accept only them.

    Ops record into current_graph() (the default graph unless a `with graph:` block says otherwise); nodes can
    also be added and wired by hand with add_node() and connect(). A node lives as long as a tensor or another
    node refers to it; the graph itself holds none, so dropping a loss frees its whole graph.
    """

    def __init__(self, name: str = "graph", *, record_sites: bool = False) -> None:
        # record_sites: remember the user's source line for every node so errors can point at it (slower).
        self.name = name
        self.record_sites = record_sites
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"<Graph {self.name!r}>"

    def __enter__(self) -> Graph:
        _CURRENT.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.stack.pop()

    def register(self, node: Node) -> None:
        """Give `node` the next id of this graph and make it a member."""
        node.id = next(self._ids)
        node.graph = self
        node.site = call_site() if self.record_sites else None

    def add_node(
        self,
        fn: type[Function],
        inputs: Sequence[TensorMeta],
        outputs: Sequence[TensorMeta],
        executor: Executor | None = None,
    ) -> Node:
        """Add an unconnected node running `fn`'s backward, for hand-built graphs; wire it with connect()."""
        node = Node(fn)
        self.register(node)
        node.executor = executor if executor is not None else current_executor()
        node.input_metas = tuple(TensorMeta(tuple(m[0]), m[1]) for m in inputs)
        node.output_metas = tuple(TensorMeta(tuple(m[0]), m[1]) for m in outputs)
        node.next_edges = (None,) * len(node.input_metas)
        node.needs_input_grad = (False,) * len(node.input_metas)
        return node

    def connect(self, node: Node, input_index: int, source: Node | Tensor, output_index: int = 0) -> None:
        """Make input `input_index` of `node` come from `source` (a node's output, or a tensor)."""
        if not 0 <= input_index < len(node.input_metas):
            raise IndexError(f"{node.describe()} has {len(node.input_metas)} inputs, not input {input_index}")
        if isinstance(source, Tensor):
            if not source.requires_grad:
                raise BackwardError(
                    f"connect: input {input_index} of {node.describe()} would come from a tensor that does not "
                    "require grad, so no gradient could reach it. Set requires_grad=True on it, or leave the input "
                    "unconnected"
                )
            edge = edge_of(source)
        else:
            if not 0 <= output_index < len(source.output_metas):
                raise IndexError(
                    f"{source.describe()} has {len(source.output_metas)} outputs, not {output_index}"
                )
            edge = (source, output_index)
        produced = edge[0].output_metas[edge[1]].shape
        expected = node.input_metas[input_index].shape
        if produced != expected:
            raise ShapeError(
                f"connecting {edge[0].name} output {edge[1]} to {node.name} input {input_index}: the input "
                f"expects shape {expected}, the source produces {produced}. Connect a source of that shape"
            )
        node.next_edges = node.next_edges[:input_index] + (edge,) + node.next_edges[input_index + 1 :]
        node.needs_input_grad = tuple(e is not None for e in node.next_edges)

    def topological_order(self, roots: Iterable[Node]) -> list[Node]:
        """Nodes reachable from `roots`, each before every node it sends gradient to (see topological_order)."""
        return topological_order(roots)


def topological_order(roots: Iterable[Node]) -> list[Node]:
    """Nodes reachable from `roots`, each before every node it sends gradient to; iterative, so any depth works.

    Kahn's algorithm over dependency counts: it allocates no per-node objects (only list and dict entries), which
    keeps Python's cyclic garbage collector from repeatedly scanning a large live graph during the traversal.
    A GraphCycleError names the nodes of a cycle when there is one.
    """
    roots = list(dict.fromkeys(roots))
    pending: dict[Node, int] = dict.fromkeys(roots, 0)  # node -> consumers not yet ordered
    stack = list(roots)
    while stack:
        for edge in stack.pop().next_edges:
            if edge is not None:
                child = edge[0]
                count = pending.get(child)
                if count is None:
                    pending[child] = 1
                    stack.append(child)
                else:
                    pending[child] = count + 1
    order: list[Node] = []
    ready = [root for root in roots if pending[root] == 0]
    while ready:
        node = ready.pop()
        order.append(node)
        for edge in node.next_edges:
            if edge is not None:
                child = edge[0]
                count = pending[child] - 1
                pending[child] = count
                if count == 0:
                    ready.append(child)
    if len(order) != len(pending):
        raise _find_cycle([node for node, count in pending.items() if count > 0])
    return order


def _find_cycle(stuck: list[Node]) -> GraphCycleError:
    """The error for a graph whose `stuck` nodes never became ready; it names one cycle among them."""
    # A stuck node has a consumer that never got ordered, itself stuck; walking consumers must therefore loop.
    consumers: dict[Node, list[Node]] = {node: [] for node in stuck}
    for node in stuck:
        for edge in node.next_edges:
            if edge is not None and edge[0] in consumers:
                consumers[edge[0]].append(node)
    path: list[Node] = []
    position: dict[Node, int] = {}
    node = stuck[0]
    while node not in position:
        position[node] = len(path)
        path.append(node)
        node = consumers[node][0]
    cycle = path[position[node] :][::-1]  # now in edge direction: each node's input comes from the next
    first = min(range(len(cycle)), key=lambda i: cycle[i].id)
    cycle = cycle[first:] + cycle[:first]
    return _cycle_error(cycle, cycle[0])


def _cycle_error(path: list[Node], back_to: Node) -> GraphCycleError:
    cycle = path[path.index(back_to) :] + [back_to]
    last = cycle[-2]
    index = next(i for i, e in enumerate(last.next_edges) if e is not None and e[0] is back_to)
    return GraphCycleError(
        "the graph has a cycle, expected a DAG: "
        + " -> ".join(n.name for n in cycle)
        + f" (arrows point from a node to the producer of its input). Backward needs an acyclic graph: remove "
        f"the edge from {last.name} input {index} to {back_to.name} (re-run Graph.connect on that input)"
    )


def default_graph() -> Graph:
    """The process-wide graph ops record into when no `with graph:` block is active."""
    return _DEFAULT


def current_graph() -> Graph:
    """The graph new nodes are recorded into: the innermost `with graph:` block, else default_graph()."""
    stack = _CURRENT.stack
    return stack[-1] if stack else _DEFAULT


_DEFAULT = Graph("default")


# --- leaves: the sink node that accumulates gradients into `.grad`, and the edge an input contributes ---

_LEAF_IDS = itertools.count(1)


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
        node.id = next(_LEAF_IDS)
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
