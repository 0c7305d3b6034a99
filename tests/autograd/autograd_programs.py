"""Random expression programs for oracle tests: drawn by hypothesis, run by simdist.autograd and by torch alike.

A program is a list of steps over a pool of values; each step reads earlier values (so shared subexpressions
occur whenever a value is picked twice) and appends its outputs (several for split/chunk). Leaves are steps too,
created whenever an op needs an operand of a shape the pool lacks, so broadcasting and matmul shapes are drawn.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import simdist.autograd as ag
from simdist.autograd import shapes

UNARY = ("tanh", "sum", "exp", "permute", "log", "mean", "sigmoid", "reshape", "relu", "pow_scalar", "neg")
BINARY = ("matmul", "mul", "add", "where", "div", "sub", "pow")
MULTI = ("split", "cat", "chunk")
# Interleaved so that no kind of op is favoured by hypothesis' preference for early choices.
ALL_OPS = tuple(op for group in itertools.zip_longest(BINARY, UNARY, MULTI) for op in group if op)
SMOOTH_OPS = tuple(op for op in ALL_OPS if op not in ("relu", "where"))

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """One op: `args` index the value pool; its outputs are appended to the pool in order."""

    op: str
    args: tuple[int, ...]
    params: tuple[Any, ...] = ()


@dataclass
class Program:
    """Leaf shapes (and which require grad), steps, and a seed for leaf values and loss weights."""

    leaves: list[tuple[Shape, bool]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    shapes: list[Shape] = field(default_factory=list)
    in_loss: list[bool] = field(default_factory=list)
    seed: int = 0

    def leaf_values(self) -> list[np.ndarray]:
        """Float64 values in [-1.5, 1.5] for every leaf."""
        rng = np.random.default_rng(self.seed)
        return [rng.uniform(-1.5, 1.5, size=shape) for shape, _ in self.leaves]

    def loss_weights(self) -> list[np.ndarray]:
        """A fixed weight array per pool value; the loss is sum(value * weight) over the values in the loss."""
        rng = np.random.default_rng(self.seed + 1)
        return [rng.uniform(-1.0, 1.0, size=shape) for shape in self.shapes]


def _broadcastable(a: Shape, b: Shape) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _factorizations(n: int, max_ndim: int = 3) -> list[Shape]:
    out: list[Shape] = [()] if n == 1 else []
    for ndim in range(1, max_ndim + 1):
        for dims in itertools.product(range(1, n + 1), repeat=ndim):
            if math.prod(dims) == n:
                out.append(dims)
    return out


@st.composite
def programs(draw: st.DrawFn, ops: tuple[str, ...] = ALL_OPS, max_steps: int = 10) -> Program:
    """A random program ending in a value that depends on the leaves through the drawn ops."""
    p = Program(seed=draw(st.integers(0, 2**31 - 1)))
    dims = st.integers(1, 4)
    shape_st = st.lists(dims, min_size=0, max_size=3).map(tuple)

    def leaf(shape: Shape) -> int:
        requires_grad = draw(st.sampled_from([True, True, True, False])) if p.leaves else True
        p.steps.append(Step("leaf", (), (len(p.leaves),)))
        p.leaves.append((tuple(shape), requires_grad))
        p.shapes.append(tuple(shape))
        return len(p.shapes) - 1

    def pick(candidates: list[int]) -> int | None:
        if candidates and draw(st.integers(0, 3)) > 0:
            return draw(st.sampled_from(candidates))
        return None

    def broadcast_partner(shape: Shape) -> Shape:
        # Drop some leading axes, then set some of the rest to 1: always broadcasts against `shape`.
        drop = draw(st.integers(0, len(shape)))
        rest = shape[drop:]
        return tuple(1 if draw(st.booleans()) else s for s in rest)

    def push(step: Step, shapes: list[Shape]) -> None:
        p.steps.append(step)
        p.shapes.extend(shapes)

    leaf(draw(shape_st))
    for _ in range(draw(st.integers(3, max_steps))):
        op = draw(st.sampled_from(ops))
        n = len(p.shapes)
        a = draw(st.integers(0, n - 1))
        sa = p.shapes[a]
        if op in ("neg", "exp", "log", "tanh", "sigmoid", "relu"):
            push(Step(op, (a,)), [sa])
        elif op == "pow_scalar":
            push(Step(op, (a,), (draw(st.sampled_from([0.0, 1.0, 2.0, 3.0, -1.0, 0.5, 1.5, -0.5])),)), [sa])
        elif op in ("sum", "mean"):
            keepdims = draw(st.booleans())
            if not sa or draw(st.integers(0, 3)) == 0:
                axis: Any = None
            else:
                axes = draw(st.lists(st.integers(0, len(sa) - 1), min_size=1, max_size=len(sa), unique=True))
                signed = tuple(x - len(sa) if draw(st.booleans()) else x for x in axes)
                axis = signed[0] if len(signed) == 1 and draw(st.booleans()) else signed
            reduced = shapes.reduced_shape(sa, shapes.normalize_axes(axis, len(sa), op), keepdims)
            push(Step(op, (a,), (axis, keepdims)), [reduced])
        elif op == "permute":
            axes = tuple(draw(st.permutations(range(len(sa)))))
            push(Step(op, (a,), (axes,)), [tuple(sa[i] for i in axes)])
        elif op == "reshape":
            target = draw(st.sampled_from(_factorizations(math.prod(sa))))
            shown = target
            if target and draw(st.booleans()):
                i = draw(st.integers(0, len(target) - 1))
                shown = target[:i] + (-1,) + target[i + 1 :]
            push(Step(op, (a,), (shown,)), [target])
        elif op in ("add", "sub", "mul", "div", "pow"):
            b = pick([i for i in range(n) if _broadcastable(sa, p.shapes[i])])
            if b is None:
                b = leaf(broadcast_partner(sa))
            if draw(st.booleans()):
                a, b = b, a
            push(Step(op, (a, b)), [np.broadcast_shapes(p.shapes[a], p.shapes[b])])
        elif op == "where":
            b = pick([i for i in range(n) if _broadcastable(sa, p.shapes[i])])
            if b is None:
                b = leaf(broadcast_partner(sa))
            out = np.broadcast_shapes(p.shapes[a], p.shapes[b])
            c = draw(st.sampled_from([i for i in range(len(p.shapes)) if _broadcastable(out, p.shapes[i])]))
            push(Step(op, (c, a, b)), [np.broadcast_shapes(out, p.shapes[c])])
        elif op == "matmul":
            if not sa:
                a = leaf(draw(st.lists(dims, min_size=1, max_size=3).map(tuple)))
                sa = p.shapes[a]
            k, batch = sa[-1], sa[:-2]

            def fits(s: Shape, k: int = k, batch: Shape = batch) -> bool:
                if len(s) == 1:
                    return s[0] == k
                return len(s) >= 2 and s[-2] == k and _broadcastable(batch, s[:-2])

            b = pick([i for i in range(len(p.shapes)) if fits(p.shapes[i])])
            if b is None:
                ndim = draw(st.integers(1, 3))
                m = draw(dims)
                new = {1: (k,), 2: (k, m), 3: (draw(st.sampled_from([1, batch[0] if batch else 2])), k, m)}[
                    ndim
                ]
                b = leaf(new)
            push(Step(op, (a, b)), [shapes.matmul_shape(sa, p.shapes[b])])
        elif op in ("split", "chunk"):
            axes = [i for i, s in enumerate(sa) if s >= 2]
            if not axes:
                push(Step("tanh", (a,)), [sa])
                continue
            axis = draw(st.sampled_from(axes))
            size = sa[axis]
            if op == "chunk":
                chunks = draw(st.integers(2, size))
                sizes = shapes.chunk_sizes(size, chunks, axis)
                params: tuple[Any, ...] = (chunks, axis)
            elif draw(st.booleans()):
                piece = draw(st.integers(1, size - 1))
                sizes = shapes.split_sizes(size, piece, axis)
                params = (piece, axis)
            else:
                cuts = sorted(
                    draw(st.lists(st.integers(1, size - 1), min_size=1, max_size=size - 1, unique=True))
                )
                sizes = tuple(b - a for a, b in zip([0] + cuts, cuts + [size]))
                params = (list(sizes), axis)
            push(Step(op, (a,), params), [sa[:axis] + (s,) + sa[axis + 1 :] for s in sizes])
        elif op == "cat":
            if not sa:
                push(Step("neg", (a,)), [sa])
                continue
            axis = draw(st.integers(0, len(sa) - 1))

            def joins(s: Shape, sa: Shape = sa, axis: int = axis) -> bool:
                return len(s) == len(sa) and all(x == y for i, (x, y) in enumerate(zip(s, sa)) if i != axis)

            others = [i for i in range(n) if joins(p.shapes[i])]  # includes `a` itself: a shared operand
            b = draw(st.sampled_from(others))
            out = sa[:axis] + (sa[axis] + p.shapes[b][axis],) + sa[axis + 1 :]
            push(Step(op, (a, b), (axis,)), [out])
        else:  # pragma: no cover - every drawn op is handled above
            raise AssertionError(op)
    # Some values stay out of the loss (unused split pieces among them). The first leaf (which requires grad)
    # and the last value are always in, so the loss has a graph and the last op is exercised.
    p.in_loss = [True] + [draw(st.booleans()) for _ in p.shapes[1:-1]] + [True] * (len(p.shapes) > 1)
    return p


class OursLib:
    """Runs a program with simdist.autograd."""

    @staticmethod
    def leaf(value: np.ndarray, requires_grad: bool) -> ag.Tensor:
        return ag.tensor(value, requires_grad=requires_grad)

    @staticmethod
    def const(value: np.ndarray) -> ag.Tensor:
        return ag.tensor(value)

    @staticmethod
    def where(c: ag.Tensor, a: ag.Tensor, b: ag.Tensor) -> ag.Tensor:
        return ag.where(c > 0, a, b)

    @staticmethod
    def split(x: ag.Tensor, sections: Any, axis: int) -> tuple[ag.Tensor, ...]:
        return x.split(sections, axis)

    @staticmethod
    def chunk(x: ag.Tensor, chunks: int, axis: int) -> tuple[ag.Tensor, ...]:
        return x.chunk(chunks, axis)

    @staticmethod
    def cat(xs: list[ag.Tensor], axis: int) -> ag.Tensor:
        return ag.cat(xs, axis)

    @staticmethod
    def reduce(op: str, x: ag.Tensor, axis: Any, keepdims: bool) -> ag.Tensor:
        return getattr(x, op)(axis=axis, keepdims=keepdims)


class TorchLib:
    """Runs a program with torch (float64), the oracle."""

    @staticmethod
    def leaf(value: np.ndarray, requires_grad: bool) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float64, requires_grad=requires_grad)

    @staticmethod
    def const(value: np.ndarray) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float64)

    @staticmethod
    def where(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(c > 0, a, b)

    @staticmethod
    def split(x: torch.Tensor, sections: Any, axis: int) -> tuple[torch.Tensor, ...]:
        return torch.split(x, sections, dim=axis)

    @staticmethod
    def chunk(x: torch.Tensor, chunks: int, axis: int) -> tuple[torch.Tensor, ...]:
        return torch.chunk(x, chunks, dim=axis)

    @staticmethod
    def cat(xs: list[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(xs, dim=axis)

    @staticmethod
    def reduce(op: str, x: torch.Tensor, axis: Any, keepdims: bool) -> torch.Tensor:
        if axis is None:
            out = getattr(x, op)()
            if keepdims:
                out = out.reshape((1,) * x.dim())
            return out
        return getattr(x, op)(dim=axis, keepdim=keepdims)


def run(
    program: Program, lib: Any, leaf_values: list[np.ndarray] | None = None
) -> tuple[list[Any], list[Any]]:
    """Evaluate the program; returns (leaves, pool of values) in the lib's tensor type."""
    values = program.leaf_values() if leaf_values is None else leaf_values
    leaves = []
    pool: list[Any] = []
    for step in program.steps:
        args = [pool[i] for i in step.args]
        op = step.op
        if op == "leaf":
            (i,) = step.params
            t = lib.leaf(values[i], program.leaves[i][1])
            leaves.append(t)
            pool.append(t)
        elif op in ("neg",):
            pool.append(-args[0])
        elif op in ("tanh", "sigmoid", "relu"):
            pool.append(getattr(args[0], op)())
        elif op == "exp":
            pool.append(args[0].tanh().exp())  # tanh first keeps exp finite however large its input
        elif op == "log":
            pool.append((args[0] * args[0] + 1.0).log())
        elif op == "pow_scalar":
            (power,) = step.params
            base = args[0] if power >= 0 and power == int(power) else args[0] * args[0] + 1.0
            pool.append(base**power)
        elif op in ("sum", "mean"):
            axis, keepdims = step.params
            pool.append(lib.reduce(op, args[0], axis, keepdims))
        elif op == "permute":
            pool.append(args[0].permute(step.params[0]))
        elif op == "reshape":
            pool.append(args[0].reshape(step.params[0]))
        elif op == "add":
            pool.append(args[0] + args[1])
        elif op == "sub":
            pool.append(args[0] - args[1])
        elif op == "mul":
            pool.append(args[0] * args[1])
        elif op == "div":
            pool.append(args[0] / (args[1] * args[1] + 0.5))
        elif op == "pow":
            pool.append((args[0] * args[0] + 0.5) ** args[1])
        elif op == "matmul":
            pool.append(args[0] @ args[1])
        elif op == "where":
            pool.append(lib.where(*args))
        elif op == "split":
            pool.extend(lib.split(args[0], *step.params))
        elif op == "chunk":
            pool.extend(lib.chunk(args[0], *step.params))
        elif op == "cat":
            pool.append(lib.cat(args, step.params[0]))
        else:  # pragma: no cover
            raise AssertionError(op)
    return leaves, pool


def loss_of(program: Program, lib: Any, pool: list[Any]) -> Any:
    """sum(value * weight) over the values in the loss: a scalar that depends on them all with distinct weights."""
    total = None
    for value, weight, used in zip(pool, program.loss_weights(), program.in_loss):
        if used:
            term = (value * lib.const(weight)).sum()
            total = term if total is None else total + term
    return total


def to_numpy(x: Any) -> np.ndarray:
    """Values of a torch or simdist tensor (or an array, passed through)."""
    if isinstance(x, torch.Tensor):
        return x.detach().numpy()
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x.numpy())


def assert_close(actual: Any, expected: Any, rtol: float, what: str) -> None:
    """Elementwise |actual - expected| <= rtol * (|expected| + max|expected|): relative, with slack for entries
    that cancelled to near zero (summation order differs between the two engines)."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=what)
