"""The small program the runtime tests run remotely: a two-layer MLP trained with SGD on the current executor."""

from __future__ import annotations

import numpy as np

import simdist.autograd as ag


def train(steps: int = 3, width: int = 4, seed: int = 0):
    """Train the MLP ``steps`` times; its final weights and its losses."""
    rng = np.random.default_rng(seed)
    w1 = ag.tensor(rng.standard_normal((4, width)), requires_grad=True)
    w2 = ag.tensor(rng.standard_normal((width, 1)), requires_grad=True)
    x, y = ag.tensor(rng.standard_normal((8, 4))), ag.tensor(rng.standard_normal((8, 1)))
    losses = []
    for _ in range(steps):
        loss = (((x @ w1).tanh() @ w2 - y) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        with ag.no_grad():
            w1 = (w1 - 0.1 * w1.grad).detach().requires_grad_()
            w2 = (w2 - 0.1 * w2.grad).detach().requires_grad_()
    return w1.numpy(), w2.numpy(), losses
