"""BackwardPass semantics: seeds, traversal, accumulation, retain_graph, freeing, create_graph, run_from_node."""

from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest
import torch
from autograd_programs import assert_close

import simdist.autograd as ag
from simdist.autograd import BackwardError, BackwardPass, GraphReleasedError, ShapeError


def test_scalar_loss_starts_from_gradient_one():
    x = ag.tensor([1.0, -2.0, 3.0], requires_grad=True)
    BackwardPass().run((x * x).sum())
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, -4.0, 6.0])


def test_one_element_loss_of_any_shape_needs_no_gradient():
    x = ag.tensor([[2.0]], requires_grad=True)
    (x * x).backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[4.0]])


def test_non_scalar_loss_without_gradient_is_refused():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = x * 3.0
    with pytest.raises(BackwardError) as info:
        BackwardPass().run(y)
    message = str(info.value)
    assert "shape (2,)" in message and "mul#" in message and "loss.sum()" in message
    assert x.grad is None


def test_non_scalar_loss_with_gradient_weights_it():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    (x * 3.0).backward(ag.tensor([10.0, 100.0]))
    np.testing.assert_array_equal(x.grad.numpy(), [30.0, 300.0])
    x.grad = None
    (x * 3.0).backward(np.array([1.0, 2.0]))  # array-likes are accepted too
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 6.0])


def test_gradient_of_the_wrong_shape_is_refused():
    x = ag.tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ShapeError) as info:
        BackwardPass().run(x * 2.0, ag.ones((3,)))
    message = str(info.value)
    assert "(3,)" in message and "expected (2, 3)" in message and "mul#" in message


def test_loss_that_does_not_require_grad_is_refused():
    x = ag.tensor([1.0], requires_grad=True)
    with ag.no_grad():
        y = (x * 2.0).sum()
    with pytest.raises(BackwardError, match="does not require grad"):
        y.backward()


def test_chain_of_100000_ops_runs_without_recursion():
    x = ag.tensor([0.5, -1.0, 2.0], requires_grad=True)
    w = ag.tensor(np.full(3, 1.0 + 1e-6), requires_grad=True)
    n = 100_000
    y = x
    for _ in range(n):
        y = y * w
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # far below the depth: any recursion over the chain would fail
    try:
        y.sum().backward()
    finally:
        sys.setrecursionlimit(limit)
    w_value = 1.0 + 1e-6
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, w_value**n), rtol=1e-12)
    np.testing.assert_allclose(w.grad.numpy(), n * w_value ** (n - 1) * x.numpy(), rtol=1e-9)


def test_gradients_add_up_where_paths_converge():
    def f(lib_x):
        y = lib_x * lib_x
        z = y.tanh()
        return (y + z + y * z + y).sum()

    x = ag.tensor([0.3, -0.7], requires_grad=True)
    t = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    f(x).backward()
    f(t).backward()
    assert_close(x.grad, t.grad, 1e-12, "diamond")


def test_leaf_gradients_accumulate_across_calls():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0 + 3.0, 4.0 + 3.0])


class Spy(ag.Function):
    """Identity that counts how often its backward runs."""

    op = "spy"
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        Spy.calls += 1
        return grad


def test_detached_branches_are_not_visited():
    Spy.calls = 0
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    branch = Spy.apply(x)
    (branch.detach() * 5.0 + x).sum().backward()
    assert Spy.calls == 0
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 1.0])
    (branch * 5.0).sum().backward()
    assert Spy.calls == 1


def _loss_with_hidden_intermediate(x):
    h = x * 2.0  # referenced only by the graph: the mul below saves it for backward
    return (h * h).sum(), weakref.ref(h)


def test_backward_frees_saved_tensors_and_refuses_a_second_pass():
    gc.disable()  # the graph must free by reference counting alone: no cycles between nodes and tensors
    try:
        x = ag.tensor([1.0, 2.0], requires_grad=True)
        loss, hidden = _loss_with_hidden_intermediate(x)
        assert hidden() is not None
        loss.backward()
        assert hidden() is None
    finally:
        gc.enable()
    with pytest.raises(GraphReleasedError) as info:
        loss.backward()
    message = str(info.value)
    assert "retain_graph=True" in message and "sum#" in message
    np.testing.assert_array_equal(x.grad.numpy(), [8.0, 16.0])  # untouched by the refused pass


def test_saved_tensors_of_a_released_node_raise_on_access():
    x = ag.tensor([1.0], requires_grad=True)
    y = x.exp()
    y.sum().backward()
    with pytest.raises(GraphReleasedError, match=r"exp#\d+"):
        y.grad_fn.saved_tensors  # noqa: B018


def test_retain_graph_keeps_saved_tensors_for_another_pass():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    loss, hidden = _loss_with_hidden_intermediate(x)
    loss.backward(retain_graph=True)
    assert hidden() is not None
    loss.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [16.0, 32.0])
    assert hidden() is None


def test_dropping_the_loss_frees_the_whole_graph():
    gc.disable()
    try:
        x = ag.tensor([1.0, 2.0], requires_grad=True)
        loss, hidden = _loss_with_hidden_intermediate(x)
        node = weakref.ref(loss.grad_fn)
        del loss
        assert hidden() is None and node() is None
    finally:
        gc.enable()


def test_create_graph_gives_second_derivatives():
    x = ag.tensor([0.5, -1.5], requires_grad=True)
    t = torch.tensor([0.5, -1.5], dtype=torch.float64, requires_grad=True)
    for lib_x in (x, t):
        y = (lib_x**3 * lib_x.tanh()).sum()
        (g,) = (
            torch.autograd.grad(y, lib_x, create_graph=True)
            if isinstance(lib_x, torch.Tensor)
            else ag.GradientComputer().compute_gradients(y, lib_x, create_graph=True)
        )
        g.sum().backward()
    assert_close(x.grad, t.grad, 1e-12, "second derivative")


def test_backward_with_create_graph_records_differentiable_grads():
    x = ag.tensor([2.0], requires_grad=True)
    (x**3).sum().backward(create_graph=True)
    first = x.grad
    assert first.requires_grad and first.grad_fn is not None
    np.testing.assert_array_equal(first.numpy(), [12.0])
    x.grad = None
    first.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [12.0])  # d(3x^2)/dx = 6x


def test_third_derivative():
    x = ag.tensor(1.5, requires_grad=True)
    computer = ag.GradientComputer()
    (d1,) = computer.compute_gradients(x**4, x, create_graph=True)
    (d2,) = computer.compute_gradients(d1, x, create_graph=True)
    (d3,) = computer.compute_gradients(d2, x)
    assert d3.item() == pytest.approx(24 * 1.5)


def test_run_from_node_matches_run():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    loss = (x.exp() * x).sum()
    BackwardPass().run_from_node(loss.grad_fn)
    expected = np.exp([1.0, 2.0]) * (1 + np.array([1.0, 2.0]))
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-15)


def test_run_from_node_of_a_multi_output_op():
    x = ag.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    first, _ = (x * 2.0).split(2)
    BackwardPass().run_from_node(first.grad_fn, [ag.tensor([1.0, 10.0]), None])
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 20.0, 0.0, 0.0])
    with pytest.raises(BackwardError, match="one gradient per output"):
        BackwardPass().run_from_node(first.grad_fn)
    with pytest.raises(ShapeError, match=r"split#\d+ output 1"):
        BackwardPass().run_from_node(first.grad_fn, [None, ag.ones(3)])


def test_a_pass_accepts_only_nodes_of_its_graph():
    x = ag.tensor([1.0], requires_grad=True)
    with ag.Graph("worker") as graph:
        y = x * 2.0
    loss = y.sum()  # recorded in the default graph, on top of a node of "worker"
    with pytest.raises(BackwardError) as info:
        BackwardPass(ag.default_graph()).run(loss)
    assert "'worker'" in str(info.value) and "'default'" in str(info.value)
    with graph:
        loss = (y * 3.0).sum()
    BackwardPass(graph).run(loss)
    np.testing.assert_array_equal(x.grad.numpy(), [6.0])


def test_create_graph_records_into_the_graph_of_the_pass():
    x = ag.tensor([1.5], requires_grad=True)
    with ag.Graph("worker") as graph:
        y = (x**3).sum()
    (grad,) = ag.GradientComputer(graph).compute_gradients(y, x, create_graph=True)  # outside the block
    assert grad.grad_fn.graph is graph
    with graph:
        total = grad.sum()
    (second,) = ag.GradientComputer(graph).compute_gradients(total, x)
    assert second.item() == pytest.approx(6 * 1.5)


def test_leaf_loss_accumulates_ones_into_itself():
    x = ag.tensor(3.0, requires_grad=True)
    x.backward()
    assert x.grad.item() == 1.0


def test_gradients_capture_intermediate_tensors_without_touching_grad():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    t = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    results = []
    for lib_x in (x, t):
        h = lib_x.tanh()
        y = (h * h * lib_x).sum()
        if isinstance(lib_x, torch.Tensor):
            results.append(torch.autograd.grad(y, [h, lib_x]))
        else:
            results.append(ag.GradientComputer().compute_gradients(y, [h, lib_x]))
    for ours, theirs in zip(*results):
        assert_close(ours, theirs, 1e-14, "captured gradient")
    assert x.grad is None


def test_unused_input_needs_allow_unused():
    x = ag.tensor([1.0], requires_grad=True)
    unused = ag.tensor([1.0], requires_grad=True)
    y = (x * 2.0).sum()
    with pytest.raises(BackwardError, match="allow_unused=True"):
        ag.GradientComputer().compute_gradients(y, [x, unused], retain_graph=True)
    grad_x, grad_unused = ag.GradientComputer().compute_gradients(y, [x, unused], allow_unused=True)
    assert grad_unused is None and grad_x.tolist() == [2.0]
