"""Training loops step for step against torch: linear regression and a 12-layer MLP (float64, plain SGD)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from autograd_programs import assert_close

import simdist.autograd as ag

RTOL = 1e-10


def _sgd(params, lr):
    """One SGD step. Tensors are immutable, so the updated parameters are new leaves."""
    with ag.no_grad():
        return [(p - lr * p.grad).requires_grad_() for p in params]


def test_linear_regression_trains_like_torch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3))
    y = x @ np.array([[1.5], [-2.0], [0.5]]) + 0.3 + 0.01 * rng.normal(size=(32, 1))
    w0, b0 = rng.normal(size=(3, 1)), np.zeros(1)

    w, b = ag.tensor(w0, requires_grad=True), ag.tensor(b0, requires_grad=True)
    tw, tb = torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    X, Y, tX, tY = ag.tensor(x), ag.tensor(y), torch.tensor(x), torch.tensor(y)
    losses = []
    for step in range(8):
        loss = ((X @ w + b - Y) ** 2).mean()
        t_loss = ((tX @ tw + tb - tY) ** 2).mean()
        loss.backward()
        t_loss.backward()
        assert_close(loss, t_loss, RTOL, f"loss at step {step}")
        assert_close(w.grad, tw.grad, RTOL, f"dw at step {step}")
        assert_close(b.grad, tb.grad, RTOL, f"db at step {step}")
        w, b = _sgd([w, b], 0.1)
        with torch.no_grad():
            tw -= 0.1 * tw.grad
            tb -= 0.1 * tb.grad
            tw.grad, tb.grad = None, None
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]  # it does learn


def test_twelve_layer_mlp_trains_like_torch():
    rng = np.random.default_rng(1)
    widths = [6] + [16] * 11 + [1]
    activations = ["tanh", "relu", "sigmoid"]
    init = [
        (rng.normal(scale=1.0 / np.sqrt(i), size=(i, o)), rng.normal(scale=0.1, size=(o,)))
        for i, o in itertools.pairwise(widths)
    ]
    x = rng.normal(size=(20, 6))
    y = np.sin(x.sum(axis=1, keepdims=True))

    params = [ag.tensor(a, requires_grad=True) for layer in init for a in layer]
    t_params = [torch.tensor(a, requires_grad=True) for layer in init for a in layer]

    def forward(ps, inputs):
        h = inputs
        for layer in range(len(init)):
            h = h @ ps[2 * layer] + ps[2 * layer + 1]
            if layer < len(init) - 1:
                h = getattr(h, activations[layer % 3])()
        return h

    X, Y, tX, tY = ag.tensor(x), ag.tensor(y), torch.tensor(x), torch.tensor(y)
    for step in range(4):
        loss = ((forward(params, X) - Y) ** 2).mean()
        t_loss = ((forward(t_params, tX) - tY) ** 2).mean()
        loss.backward()
        t_loss.backward()
        assert_close(loss, t_loss, RTOL, f"loss at step {step}")
        for k, (p, tp) in enumerate(zip(params, t_params)):
            assert_close(p.grad, tp.grad, RTOL, f"gradient of parameter {k} at step {step}")
        params = _sgd(params, 0.05)
        with torch.no_grad():
            for tp in t_params:
                tp -= 0.05 * tp.grad
                tp.grad = None
    for k, (p, tp) in enumerate(zip(params, t_params)):
        assert_close(p, tp, RTOL, f"parameter {k} after training")
