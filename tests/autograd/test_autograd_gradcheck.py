"""GradientComputer, numerical_gradient and gradcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from autograd_programs import assert_close
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import simdist.autograd as ag
from simdist.autograd import GradcheckError, GradientComputer


def test_numerical_gradient_of_a_quadratic():
    x = np.array([0.5, -1.25, 2.0])
    numerical = ag.numerical_gradient(lambda t: (t * t).sum(), ag.tensor(x), eps=1e-6)
    np.testing.assert_allclose(numerical, 2 * x, rtol=0, atol=1e-8)


def test_numerical_gradient_weights_a_non_scalar_output():
    x = np.array([0.5, 2.0])
    weights = np.array([3.0, -1.0])
    numerical = GradientComputer.numerical_gradient(lambda t: t.exp(), ag.tensor(x), 1e-6, weights)
    np.testing.assert_allclose(numerical, weights * np.exp(x), rtol=1e-8)


@given(x=hnp.arrays(np.float64, st.integers(1, 5), elements=st.floats(-2, 2)))
def test_compute_gradient_matches_torch_and_leaves_grad_alone(x):
    def f(t):
        return (t.sigmoid() * t.tanh() + (t * t + 1.0).log()).sum()

    tx = ag.tensor(x, requires_grad=True)
    grad = GradientComputer().compute_gradient(f(tx), tx)
    tt = torch.tensor(x, requires_grad=True)
    (expected,) = torch.autograd.grad(f(tt), tt)
    assert_close(grad, expected, 1e-12, "compute_gradient")
    assert tx.grad is None
    numerical = ag.numerical_gradient(f, ag.tensor(x))
    assert np.max(np.abs(numerical - grad.numpy())) <= 1e-6


def test_gradcheck_passes_for_correct_backward_with_several_outputs():
    a = ag.tensor(np.array([[0.3, -0.8], [1.1, 0.2]]), requires_grad=True)
    b = ag.tensor(np.array([0.7, -0.4]), requires_grad=True)
    c = ag.tensor(np.array([1.0, 2.0]))  # no requires_grad: not checked

    def f(x, y, z):
        h = (x @ y).tanh() * z
        left, right = (x * y).split(1, axis=1)
        return h, (left.exp() + right).sum()

    assert ag.gradcheck(f, [a, b, c])
    assert GradientComputer().gradcheck(f, [a, b, c])


class BadSquare(ag.Function):
    """x**2 with a backward that is off by a factor of 2."""

    op = "bad_square"

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x


def test_gradcheck_reports_a_wrong_backward():
    x = ag.tensor(np.array([0.5, 1.5]), requires_grad=True)
    with pytest.raises(GradcheckError) as info:
        ag.gradcheck(lambda t: BadSquare.apply(t), [x])
    message = str(info.value)
    assert "d(output 0 at (0,)) / d(input 0 at (0,)) is 0.5 from backward but 1 from central" in message
    assert ag.gradcheck(lambda t: BadSquare.apply(t), [x], raise_exception=False) is False
