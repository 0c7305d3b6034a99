"""Tensor basics: metadata, leaves, detach, grad modes, graph recording."""

from __future__ import annotations

import numpy as np
import pytest

import simdist.autograd as ag


def test_metadata_is_tracked_without_reading_values():
    x = ag.tensor(np.zeros((2, 3, 4)))
    y = (x.permute(2, 0, 1) @ ag.ones((3, 5))).sum(axis=1, keepdims=True)
    assert y.shape == (4, 1, 5) and y.dtype == np.float64 and y.ndim == 3 and y.size == 20
    assert y.numpy().shape == (4, 1, 5)


def test_leaf_and_non_leaf():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2.0
    assert x.is_leaf and x.grad_fn is None
    assert not y.is_leaf and y.requires_grad and y.grad_fn.op == "mul"
    assert "grad_fn=mul#" in repr(y) and "requires_grad=True" in repr(x)


def test_detach_shares_values_and_cuts_the_graph():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    d = (x * 2.0).detach()
    assert d.is_leaf and not d.requires_grad
    np.testing.assert_array_equal(d.numpy(), [2.0, 4.0])
    assert not (d * x.detach()).requires_grad


def test_constants_do_not_record():
    a = ag.tensor([1.0])
    assert (a * 2.0).grad_fn is None


def test_no_grad_and_enable_grad():
    x = ag.tensor([1.0], requires_grad=True)
    with ag.no_grad():
        assert not ag.is_grad_enabled()
        y = x * 2.0
        with ag.enable_grad():
            z = x * 2.0
    assert ag.is_grad_enabled()
    assert y.grad_fn is None and not y.requires_grad
    assert z.grad_fn is not None

    @ag.no_grad()
    def f(t):
        return t * 3.0

    assert f(x).grad_fn is None
    with ag.set_grad_enabled(False):
        assert (x * 1.0).grad_fn is None
    assert ag.is_grad_enabled()


def test_comparisons_are_constants():
    x = ag.tensor([1.0, -1.0], requires_grad=True)
    mask = x > 0
    assert mask.dtype == np.bool_ and not mask.requires_grad
    assert (x >= 1.0).tolist() == [True, False] and (x < 0).tolist() == [False, True]
    assert (x <= -1.0).tolist() == [False, True] and x.eq(1.0).tolist() == [True, False]
    assert ((x > 0) & (x < 2)).tolist() == [True, False]


def test_nodes_hold_their_context_and_edges():
    a = ag.tensor([1.0, 2.0], requires_grad=True)
    b = ag.tensor([3.0, 4.0])
    y = a * b
    node = y.grad_fn
    assert node.needs_input_grad == (True, False)
    assert node.next_edges[1] is None and node.next_edges[0][0].op == "accumulate_grad"
    saved_a, saved_b = node.saved_tensors
    assert saved_a is a and saved_b is b
    assert node.input_metas == (a.meta, b.meta) and node.output_metas == (y.meta,)
    assert "mul#" in node.describe() and "(2,)" in node.describe()


def test_saved_outputs_come_back_attached_to_their_node():
    x = ag.tensor([0.5], requires_grad=True)
    y = x.exp()
    (out,) = y.grad_fn.saved_tensors
    assert out is not y and out.grad_fn is y.grad_fn and out.numpy().tolist() == y.numpy().tolist()


def test_item_tolist_len_and_factories():
    x = ag.full((2, 2), 3.5)
    assert x.tolist() == [[3.5, 3.5], [3.5, 3.5]] and len(x) == 2
    assert ag.tensor([[7.0]]).item() == 7.0
    assert ag.zeros_like(x).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert ag.ones_like(x).dtype == x.dtype and ag.zeros(3).shape == (3,)
    assert ag.ones(2, requires_grad=True).requires_grad
    with pytest.raises(ValueError, match="one element"):
        x.item()
    assert np.asarray(x).shape == (2, 2)


def test_numpy_operands_and_truth_values():
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    y = np.array([3.0, 4.0]) * x + np.ones(2)  # NumPy defers to the tensor's reflected operators
    assert isinstance(y, ag.Tensor) and y.requires_grad and y.tolist() == [4.0, 9.0]
    assert bool(ag.tensor(1.0) > 0) and not bool(ag.tensor([0.0]))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x > 0)


def test_tensor_copies_host_data():
    host = np.array([1.0, 2.0])
    x = ag.tensor(host)
    host[0] = 99.0
    assert x.tolist() == [1.0, 2.0]


def test_graph_numbers_nodes_and_scopes_recording():
    x = ag.tensor([1.0], requires_grad=True)
    with ag.Graph("scoped") as graph:
        assert ag.current_graph() is graph
        first = x * 2.0
        second = first * 2.0
    assert ag.current_graph() is ag.default_graph()
    assert first.grad_fn.graph is graph and second.grad_fn.id == first.grad_fn.id + 1
    assert "scoped" in repr(graph)
