"""Errors name what was expected, what was found, the node or op, and what to do."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import simdist.autograd as ag
from simdist.autograd import (
    BackwardError,
    BackwardPass,
    ExecutorError,
    GraphCycleError,
    NonDifferentiableError,
    NumpyExecutor,
    ShapeError,
    TensorMeta,
)
from simdist.errors import SimdistError

F64 = np.dtype(np.float64)


class Identity(ag.Function):
    """Passes the gradient through unchanged: the building block of hand-built graphs."""

    op = "identity"

    @staticmethod
    def backward(ctx, grad):
        return grad


def _hand_built_chain(graph: ag.Graph, n: int) -> list[ag.Node]:
    meta = TensorMeta((2,), F64)
    nodes = [graph.add_node(Identity, [meta], [meta]) for _ in range(n)]
    for upstream, downstream in itertools.pairwise(nodes):
        graph.connect(upstream, 0, downstream)
    return nodes


def test_hand_built_graph_runs():
    graph = ag.Graph("hand")
    nodes = _hand_built_chain(graph, 3)
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    graph.connect(nodes[-1], 0, x)
    BackwardPass(graph).run_from_node(nodes[0], ag.tensor([5.0, 7.0]))
    np.testing.assert_array_equal(x.grad.numpy(), [5.0, 7.0])


def test_cycle_in_a_hand_built_graph_names_its_nodes():
    graph = ag.Graph("hand")
    a, b, c = _hand_built_chain(graph, 3)
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    graph.connect(c, 0, a)  # c's input comes from a, which (through b) consumes c: a cycle
    with pytest.raises(GraphCycleError) as info:
        BackwardPass(graph).run_from_node(a, ag.ones(2))
    message = str(info.value)
    assert f"{a.name} -> {b.name} -> {c.name} -> {a.name}" in message
    assert f"remove the edge from {c.name} input 0" in message
    assert x.grad is None
    assert isinstance(info.value, SimdistError)


class Fork(ag.Function):
    """Two inputs, each getting the whole gradient."""

    op = "fork"

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def test_cycle_below_the_start_with_a_tail_beyond_it():
    graph = ag.Graph("hand")
    start, a, b = _hand_built_chain(graph, 3)  # start -> a -> b
    meta = TensorMeta((2,), F64)
    c = graph.add_node(Fork, [meta, meta], [meta])
    (tail,) = _hand_built_chain(graph, 1)
    graph.connect(b, 0, c)
    graph.connect(c, 0, a)  # a -> b -> c -> a
    graph.connect(c, 1, tail)  # and c -> tail, which can never run either
    graph.connect(tail, 0, ag.tensor([1.0, 2.0], requires_grad=True))
    with pytest.raises(GraphCycleError) as info:
        BackwardPass(graph).run_from_node(start, ag.ones(2))
    message = str(info.value)
    assert f"{a.name} -> {b.name} -> {c.name} -> {a.name}" in message
    assert start.name not in message and tail.name not in message


def test_connect_checks_shapes():
    graph = ag.Graph("hand")
    (node,) = _hand_built_chain(graph, 1)
    with pytest.raises(ShapeError) as info:
        graph.connect(node, 0, ag.tensor([1.0, 2.0, 3.0], requires_grad=True))
    assert "expects shape (2,)" in str(info.value) and "produces (3,)" in str(info.value)


class Round(ag.Function):
    """Rounds to integers: a forward with no derivative."""

    op = "round"

    @staticmethod
    def forward(ctx, x):
        return ag.tensor(np.round(x.numpy()))


def test_non_differentiable_op_on_a_needed_path():
    x = ag.tensor([0.4, 1.6], requires_grad=True)
    y = (Round.apply(x * 2.0) * 3.0).sum()
    with pytest.raises(NonDifferentiableError) as info:
        y.backward()
    message = str(info.value)
    assert "op 'round' has no derivative" in message and "round#" in message and "detach()" in message
    assert x.grad is None  # refused before any gradient was computed


def test_non_differentiable_op_off_the_needed_path_is_fine():
    x = ag.tensor([0.4, 1.6], requires_grad=True)
    w = ag.tensor([2.0, 3.0], requires_grad=True)
    (Round.apply(x.detach()) * w).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [0.0, 2.0])
    y = (Round.apply(x) + w).sum()
    (grad_w,) = ag.GradientComputer().compute_gradients(y, [w])  # x's path is not needed for w
    np.testing.assert_array_equal(grad_w.numpy(), [1.0, 1.0])


class WrongShape(ag.Function):
    op = "wrong_shape"

    @staticmethod
    def forward(ctx, x):
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        return grad  # should have been expanded back to the input's shape


class WrongCount(ag.Function):
    op = "wrong_count"

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def test_backward_returning_the_wrong_shape():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(ShapeError) as info:
        WrongShape.apply(x).backward()
    message = str(info.value)
    assert "wrong_shape#" in message and "input 0" in message and "shape ()" in message
    assert "expected (2,)" in message and "WrongShape.backward" in message


def test_backward_returning_the_wrong_count():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(BackwardError, match=r"returned 2 gradients, expected 1"):
        WrongCount.apply(x).sum().backward()


def test_forward_returning_its_input_is_refused():
    class Passthrough(ag.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    with pytest.raises(BackwardError, match="detach"):
        Passthrough.apply(ag.tensor([1.0], requires_grad=True))


def test_tensors_on_different_executors_do_not_mix():
    a = ag.tensor([1.0], executor=NumpyExecutor())
    b = ag.tensor([1.0], executor=NumpyExecutor())
    with pytest.raises(ExecutorError, match="different executors"):
        a + b


def test_executor_checks_results_against_the_shape_rules():
    ex = NumpyExecutor()
    with pytest.raises(ExecutorError, match=r"shape rule says \(3,\)"):
        ex.execute("add", (np.ones(2), np.ones(2)), {}, (TensorMeta((3,), F64),))
    with pytest.raises(ExecutorError, match="no kernel for op 'conv'"):
        ex.execute("conv", (), {}, ())


def test_requires_grad_only_for_floating_leaves():
    with pytest.raises(BackwardError, match="floating dtype"):
        ag.tensor([1, 2], requires_grad=True)
    y = ag.tensor([1.0], requires_grad=True) * 2.0
    with pytest.raises(BackwardError, match="non-leaf"):
        y.requires_grad_()


def test_record_sites_points_errors_at_the_user_line():
    with ag.Graph("traced", record_sites=True) as graph:
        x = ag.tensor([0.4], requires_grad=True)
        y = Round.apply(x)
        loss = (y * 1.0).sum()
    with pytest.raises(NonDifferentiableError, match=r"created at .*test_autograd_errors.py:\d+"):
        BackwardPass(graph).run(loss)
