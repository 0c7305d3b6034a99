"""simdist.autograd against torch autograd on random expression programs (float64), and against central differences."""

from __future__ import annotations

import numpy as np
import torch
from autograd_programs import SMOOTH_OPS, OursLib, TorchLib, assert_close, loss_of, programs, run, to_numpy
from hypothesis import assume, given, settings

import simdist.autograd as ag

RTOL = 1e-10
# Random programs are the main oracle, so they get more examples than the profile's default (never fewer).
MANY = settings(max_examples=max(100, settings.default.max_examples))


def _finite(pool: list[torch.Tensor], bound: float = 1e6) -> bool:
    return all(bool(torch.all(torch.abs(v) < bound)) for v in pool)


@MANY
@given(programs())
def test_first_order_gradients_match_torch(program):
    t_leaves, t_pool = run(program, TorchLib)
    assume(_finite(t_pool))
    loss_of(program, TorchLib, t_pool).backward()
    leaves, pool = run(program, OursLib)
    loss = loss_of(program, OursLib, pool)
    loss.backward()
    for k, (ours, theirs) in enumerate(zip(pool, t_pool)):
        assert_close(ours, theirs, RTOL, f"forward value {k} ({program.steps})")
    for k, (ours, theirs) in enumerate(zip(leaves, t_leaves)):
        if theirs.grad is None:
            assert ours.grad is None, f"leaf {k}: torch has no gradient, we have one"
        else:
            assert ours.grad is not None, f"leaf {k}: torch has a gradient, we have none"
            assert_close(ours.grad, theirs.grad, RTOL, f"gradient of leaf {k} ({program.steps})")


@MANY
@given(programs())
def test_second_order_gradients_match_torch_create_graph(program):
    t_leaves, t_pool = run(program, TorchLib)
    assume(_finite(t_pool, 1e4))
    t_inputs = [t for t in t_leaves if t.requires_grad]
    t_loss = loss_of(program, TorchLib, t_pool)
    leaves, pool = run(program, OursLib)
    inputs = [t for t in leaves if t.requires_grad]
    loss = loss_of(program, OursLib, pool)

    rng = np.random.default_rng(program.seed + 2)
    directions = [rng.uniform(-1, 1, size=t.shape) for t in inputs]
    t_grads = torch.autograd.grad(t_loss, t_inputs, create_graph=True, allow_unused=True)
    grads = ag.GradientComputer().compute_gradients(loss, inputs, create_graph=True, allow_unused=True)
    for g, tg in zip(grads, t_grads):
        assert (g is None) == (tg is None)
        if g is not None:
            assert_close(g, tg, RTOL, "first derivative")

    # Differentiate <grad, direction> again: a Hessian-vector product. Which first derivatives still carry a
    # graph may differ (torch keeps one through relu's mask, whose derivative is zero), so a side without a
    # graph counts as a zero second derivative.
    t_terms = [
        (g * torch.tensor(d)).sum() for g, d in zip(t_grads, directions) if g is not None and g.requires_grad
    ]
    terms = [(g * ag.tensor(d)).sum() for g, d in zip(grads, directions) if g is not None and g.requires_grad]
    t_hvp = (
        torch.autograd.grad(sum(t_terms), t_inputs, allow_unused=True) if t_terms else [None] * len(inputs)
    )
    hvp = (
        ag.GradientComputer().compute_gradients(sum(terms[1:], terms[0]), inputs, allow_unused=True)
        if terms
        else [None] * len(inputs)
    )
    for k, (h, th) in enumerate(zip(hvp, t_hvp)):
        expected = np.zeros(inputs[k].shape) if th is None else to_numpy(th)
        actual = np.zeros(inputs[k].shape) if h is None else h.numpy()
        assert_close(actual, expected, RTOL, f"second derivative for input {k} ({program.steps})")


@MANY
@given(programs(ops=SMOOTH_OPS))
def test_gradients_match_central_differences(program):
    values = program.leaf_values()
    _, t_pool = run(program, TorchLib)
    assume(_finite(t_pool, 1e3))
    leaves, pool = run(program, OursLib)
    loss_of(program, OursLib, pool).backward()
    for k, leaf in enumerate(leaves):
        if not leaf.requires_grad or leaf.grad is None:
            continue

        def f(x, k=k):
            vals = list(values)
            vals[k] = x.numpy()
            return loss_of(program, OursLib, run(program, OursLib, vals)[1])

        numerical = ag.numerical_gradient(f, ag.tensor(values[k]), eps=1e-6)
        analytic = leaf.grad.numpy()
        scale = max(1.0, float(np.max(np.abs(analytic))))
        assert np.max(np.abs(numerical - analytic)) <= 1e-6 * scale, (program.steps, numerical, analytic)
