"""Each op against torch autograd: forward values and gradients (float64), over hypothesis-drawn shapes and values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from autograd_programs import assert_close
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import simdist.autograd as ag
from simdist.autograd import ShapeError

RTOL = 1e-10
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)


def values(shape: tuple[int, ...], low: float = -3.0, high: float = 3.0) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(
        np.float64, shape, elements=st.floats(low, high, allow_nan=False, allow_subnormal=False)
    )


def check(ours: Callable[..., Any], theirs: Callable[..., Any], *arrays: np.ndarray, seed: int = 0) -> None:
    """Forward values and the gradients of sum(out * random weights) for every input agree with torch."""
    xs = [ag.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out, t_out = ours(*xs), theirs(*ts)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    t_outs = t_out if isinstance(t_out, (tuple, list)) else (t_out,)
    rng = np.random.default_rng(seed)
    loss, t_loss = 0.0, 0.0
    for o, t in zip(outs, t_outs, strict=True):
        assert o.shape == tuple(t.shape)
        assert_close(o, t, RTOL, "forward")
        w = rng.uniform(-1, 1, size=o.shape)
        loss = loss + (o * ag.tensor(w)).sum()
        t_loss = t_loss + (t * torch.tensor(w)).sum()
    loss.backward()
    t_loss.backward()
    for k, (x, t) in enumerate(zip(xs, ts)):
        expected = torch.zeros_like(t) if t.grad is None else t.grad
        actual = np.zeros(x.shape) if x.grad is None else x.grad
        assert_close(actual, expected, RTOL, f"gradient of input {k}")


@st.composite
def broadcast_pair(draw: st.DrawFn, low: float = -3.0, high: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    shape_a, shape_b = draw(
        hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4)
    ).input_shapes
    return draw(values(shape_a, low, high)), draw(values(shape_b, low, high))


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@given(pair=broadcast_pair())
def test_broadcasting_arithmetic(op, pair):
    f = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}[op]
    check(f, f, *pair)


@given(pair=broadcast_pair(), sign=st.sampled_from([-1.0, 1.0]))
def test_div(pair, sign):
    a, b = pair
    b = sign * (np.abs(b) + 0.5)  # away from zero
    check(lambda x, y: x / y, lambda x, y: x / y, a, b)


@given(pair=broadcast_pair())
def test_pow_with_tensor_exponent(pair):
    a, b = pair
    check(lambda x, y: x**y, lambda x, y: x**y, np.abs(a) + 0.1, b)


def test_pow_at_zero_base_follows_torch_conventions():
    base = np.array([0.0, 0.0, 0.0, 2.0])
    exponent = np.array([0.0, 1.0, 2.5, 0.0])
    check(lambda x, y: x**y, lambda x, y: x**y, base, exponent)


@pytest.mark.parametrize("power", [0.0, 1.0, 2.0, 3.0, -1.0, 0.5, -2.5])
@given(x=shapes.flatmap(lambda s: values(s, 0.2, 3.0)))
def test_pow_with_scalar_exponent(power, x):
    check(lambda t: t**power, lambda t: t**power, x)


def test_pow_scalar_zero_exponent_at_zero_has_zero_gradient():
    check(lambda t: t**0, lambda t: t**0, np.array([0.0, 1.5]))


def test_reflected_scalar_operators():
    f = lambda t: (2.0 - t) * 3.0 / (1.0 + t * t) + 2.0**t - 1.0 / (t + 4.0)
    check(f, f, np.array([[0.3, -1.2], [2.0, 0.7]]))


@pytest.mark.parametrize("name", ["neg", "exp", "tanh", "sigmoid", "relu"])
@given(x=shapes.flatmap(values))
def test_unary(name, x):
    f = (lambda t: -t) if name == "neg" else (lambda t: getattr(t, name)())
    check(f, f, x)


@given(x=shapes.flatmap(lambda s: values(s, 0.05, 5.0)))
def test_log(x):
    check(lambda t: t.log(), lambda t: t.log(), x)


def test_relu_gradient_at_zero_is_zero():
    check(lambda t: t.relu(), lambda t: t.relu(), np.array([-1.0, 0.0, 2.0]))


def test_sigmoid_is_stable_for_large_inputs():
    check(lambda t: t.sigmoid(), lambda t: t.sigmoid(), np.array([-800.0, -30.0, 0.0, 30.0, 800.0]))


@st.composite
def reduction_case(draw: st.DrawFn) -> tuple[np.ndarray, Any, bool]:
    shape = draw(shapes)
    x = draw(values(shape))
    if not shape or draw(st.booleans()):
        return x, None, draw(st.booleans())
    axes = draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=len(shape)))
    axes = list({a % len(shape): a for a in axes}.values())  # each dimension once, in either sign
    return x, (axes[0] if len(axes) == 1 else tuple(axes)), draw(st.booleans())


@pytest.mark.parametrize("name", ["sum", "mean"])
@given(case=reduction_case())
def test_reductions(name, case):
    x, axis, keepdims = case

    def theirs(t):
        if axis is None:
            out = getattr(t, name)()
            return out.reshape((1,) * t.dim()) if keepdims else out

        return getattr(t, name)(dim=axis, keepdim=keepdims)

    check(lambda t: getattr(t, name)(axis=axis, keepdims=keepdims), theirs, x)


MATMUL_SHAPES = [
    ((3,), (3,)),
    ((3,), (3, 4)),
    ((2, 3), (3,)),
    ((2, 3), (3, 4)),
    ((5, 2, 3), (3, 4)),
    ((2, 3), (5, 3, 4)),
    ((5, 2, 3), (5, 3, 4)),
    ((5, 1, 2, 3), (4, 3, 2)),
    ((3,), (2, 3, 4)),
    ((2, 2, 3), (3,)),
    ((1, 2, 3), (4, 3, 1)),
]


@pytest.mark.parametrize("shape_a,shape_b", MATMUL_SHAPES)
def test_matmul_shapes(shape_a, shape_b):
    rng = np.random.default_rng(len(shape_a) * 10 + len(shape_b))
    a, b = rng.normal(size=shape_a), rng.normal(size=shape_b)
    check(lambda x, y: x @ y, lambda x, y: x @ y, a, b)


@given(x=hnp.array_shapes(min_dims=1, max_dims=4, max_side=3).flatmap(values), data=st.data())
def test_permute_transpose_and_T(x, data):
    axes = data.draw(st.permutations(range(x.ndim)))
    check(lambda t: t.permute(axes), lambda t: t.permute(axes), x)
    check(lambda t: t.T, lambda t: t.permute(*reversed(range(t.dim()))), x)
    if x.ndim >= 2:
        i, j = data.draw(st.integers(-x.ndim, x.ndim - 1)), data.draw(st.integers(-x.ndim, x.ndim - 1))
        check(lambda t: t.transpose(i, j), lambda t: t.transpose(i, j), x)
        check(lambda t: t.mT, lambda t: t.mT, x)


@given(x=shapes.flatmap(values), data=st.data())
def test_reshape_and_flatten(x, data):
    target = data.draw(st.permutations(list(x.shape) + [1]))
    shown = list(target)
    if shown and data.draw(st.booleans()):
        shown[data.draw(st.integers(0, len(shown) - 1))] = -1
    check(lambda t: t.reshape(shown), lambda t: t.reshape(shown), x)
    check(lambda t: t.flatten(), lambda t: t.flatten(), x)
    check(lambda t: t.unsqueeze(0).squeeze(0), lambda t: t.unsqueeze(0).squeeze(0), x)


@given(case=hnp.mutually_broadcastable_shapes(num_shapes=1, max_dims=3, max_side=4), data=st.data())
def test_expand_sums_back(case, data):
    x = data.draw(values(case.input_shapes[0]))
    target = case.result_shape
    check(lambda t: t.expand(target), lambda t: t.expand(target), x)
    check(lambda t: ag.sum_to(t * 1.0, x.shape[1:]) if x.ndim else t, lambda t: t.sum(0) if t.dim() else t, x)


@given(x=hnp.array_shapes(min_dims=1, max_dims=3, min_side=2, max_side=5).flatmap(values), data=st.data())
def test_split_and_chunk_including_unused_pieces(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    size = x.shape[axis]
    piece = data.draw(st.integers(1, size))
    used = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))

    def keep(pieces: Sequence[Any]) -> list[Any]:
        kept = [p for p, u in zip(pieces, used) if u]
        return kept or [pieces[0]]

    check(lambda t: keep(t.split(piece, axis)), lambda t: keep(torch.split(t, piece, dim=axis)), x)
    chunks = data.draw(st.integers(1, size))
    check(lambda t: keep(t.chunk(chunks, axis)), lambda t: keep(torch.chunk(t, chunks, dim=axis)), x)
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=3)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [size])]
    check(lambda t: keep(t.split(sizes, axis)), lambda t: keep(torch.split(t, sizes, dim=axis)), x)


@given(x=hnp.array_shapes(min_dims=1, max_dims=3, max_side=3).flatmap(values), data=st.data())
def test_cat_with_shared_operand(x, data):
    axis = data.draw(st.integers(0, x.ndim - 1))
    f = ag.cat
    check(lambda t: f([t, t * 2.0, t], axis), lambda t: torch.cat([t, t * 2.0, t], dim=axis), x)


@given(triple=hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), data=st.data())
def test_where(triple, data):
    c, a, b = (data.draw(values(s)) for s in triple.input_shapes)
    check(lambda m, x, y: ag.where(m > 0, x, y), lambda m, x, y: torch.where(m > 0, x, y), c, a, b)
    check(lambda m, x: ag.where(m > 0.5, x, 0.0), lambda m, x: torch.where(m > 0.5, x, 0.0), c, a)


def test_mixed_precision_gradients_come_back_in_the_input_dtype():
    x = ag.tensor(np.array([1.0, 2.0], dtype=np.float32), requires_grad=True)
    y = ag.tensor(np.array([3.0, 4.0]), requires_grad=True)
    out = x * y
    assert out.dtype == np.float64
    out.sum().backward()
    assert x.grad.dtype == np.float32 and y.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 4.0])
    z = x.astype(np.float64) * 2.0
    z.sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad.numpy(), [5.0, 6.0])


def test_python_scalars_keep_the_tensor_dtype():
    x = ag.tensor(np.ones(2, dtype=np.float32))
    assert (x * 2.5).dtype == np.float32
    assert (2**x).dtype == np.float32
    assert (ag.tensor([1, 2]) + 0.5).dtype == np.float64


@pytest.mark.parametrize(
    "make, fragments",
    [
        (
            lambda: ag.ones((2, 3)) + ag.ones((4,)),
            ["add", "(2, 3)", "(4,)", "dimension -1", "test_autograd_ops.py"],
        ),
        (lambda: ag.ones((2, 3)) @ ag.ones((2, 3)), ["matmul", "inner dimensions", "transpose"]),
        (lambda: ag.ones((2, 3)).reshape(4, -1), ["reshape", "infer -1", "(2, 3)"]),
        (lambda: ag.ones((2, 3)).sum(axis=2), ["sum", "axis 2", "out of range"]),
        (lambda: ag.ones((2, 3)).permute(0, 0), ["permute", "not a permutation"]),
        (lambda: ag.ones((2, 3)).expand(3, 3), ["expand", "(2, 3)", "(3, 3)"]),
        (lambda: ag.ones((2, 3)).split([1, 2], 0), ["split", "sum to 3", "axis 0 has size 2"]),
        (lambda: ag.cat([ag.ones((2, 3)), ag.ones((2, 4))], 0), ["cat", "input 1", "(2, 4)"]),
    ],
)
def test_forward_shape_errors_say_what_where_and_how(make, fragments):
    with pytest.raises(ShapeError) as info:
        make()
    for fragment in fragments:
        assert fragment in str(info.value)
