"""Cases a review of the engine found wrong once; torch is the oracle where it has an answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import simdist.autograd as ag
from simdist.autograd.errors import BackwardError, GradcheckError, ShapeError


@pytest.mark.parametrize("dt", [np.uint8, np.int8, np.int16, np.bool_])
@pytest.mark.parametrize("op", ["exp", "log", "tanh", "sigmoid"])
def test_floating_unary_ops_on_small_integer_and_bool_tensors(dt, op):
    a = np.array([1, 2], dtype=dt)
    got = getattr(ag.tensor(a), op)()
    assert got.numpy().dtype == got.dtype == np.float64
    want = getattr(torch.tensor(a.astype(np.float64)), op)().numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


def test_numerical_gradient_uses_the_step_that_survives_rounding():
    x = ag.tensor(np.array([1.0, 2.0], dtype=np.float32))
    np.testing.assert_allclose(ag.numerical_gradient(lambda t: (t * 3.0).sum(), x, eps=1e-3), [3.0, 3.0], rtol=1e-3)
    with pytest.raises(GradcheckError, match="vanishes"):
        ag.numerical_gradient(lambda t: t.sum(), ag.tensor(np.array([1000.0], dtype=np.float32)), eps=1e-6)
    with pytest.raises(GradcheckError, match="floating-point"):
        ag.numerical_gradient(lambda t: (t * t).sum(), ag.tensor(np.array([1, 2, 3])))


def test_half_precision_mean_gradient_over_more_elements_than_float16_can_count():
    a = np.ones(70000, np.float16)
    x = ag.tensor(a, requires_grad=True)
    x.mean().backward()
    t = torch.tensor(a, requires_grad=True)
    t.mean().backward()
    np.testing.assert_allclose(x.grad.numpy().astype(np.float64), t.grad.numpy().astype(np.float64), rtol=1e-3)


def test_chunk_and_split_of_an_empty_axis():
    x = ag.tensor(np.zeros((0, 2)), requires_grad=True)
    assert [p.shape for p in x.chunk(3)] == [tuple(p.shape) for p in torch.zeros(0, 2).chunk(3)]
    with pytest.raises(ShapeError, match="no sizes"):
        x.split([])


class _PassFirst(ag.Function):
    op = "passfirst"

    @staticmethod
    def forward(ctx, u, v):
        return u

    @staticmethod
    def backward(ctx, g):
        return None, None


def test_a_function_returning_its_input_is_refused_and_the_input_untouched():
    c = ag.tensor([5.0, 6.0])
    with pytest.raises(BackwardError, match="returned one of its inputs"):
        _PassFirst.apply(c, ag.tensor([1.0, 2.0], requires_grad=True))
    assert not c.requires_grad and c.grad_fn is None


class _Ident(ag.Function):
    op = "identity"

    @staticmethod
    def backward(ctx, g):
        return g


def test_hand_built_graph_edge_cases_are_errors():
    g = ag.Graph("k")
    meta = ((2,), np.float64)
    node = g.add_node(_Ident, [meta], [meta])
    with pytest.raises(BackwardError, match="does not require grad"):
        g.connect(node, 0, ag.tensor([1.0, 2.0]))
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(BackwardError, match="every gradient is None"):
        ag.BackwardPass().run_from_node((x * 2).grad_fn, [None])
