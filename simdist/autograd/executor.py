"""The interface between the engine and the arrays: every array computation is one command to an Executor.

The engine only ever holds opaque array handles and the shape/dtype metadata its shape rules derive, so an
executor may compute locally (NumpyExecutor) or emit "op, input handles, output metadata, attributes" commands to
a remote worker and return handles for results it has not computed yet.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

# An executor-owned array or handle; the engine never looks inside it.
Array = Any


class TensorMeta(NamedTuple):
    """What is known about an array without its values: shape (a tuple of ints) and NumPy dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


# The command set. Each op takes its inputs in order, attributes by name, and produces arrays whose metadata the
# engine passes along (`outputs`); elementwise binary ops broadcast like NumPy.
INSTRUCTIONS: dict[str, str] = {
    "full": "() -> out; attrs value: an array of outputs[0].shape filled with value",
    "add": "(a, b) -> a + b",
    "sub": "(a, b) -> a - b",
    "mul": "(a, b) -> a * b",
    "div": "(a, b) -> a / b (true division)",
    "pow": "(a, b) -> a ** b",
    "pow_scalar": "(a) -> a ** exponent; attrs exponent: float",
    "neg": "(a) -> -a",
    "exp": "(a) -> e ** a",
    "log": "(a) -> natural log of a",
    "tanh": "(a) -> tanh(a)",
    "sigmoid": "(a) -> 1 / (1 + e ** -a)",
    "relu": "(a) -> max(a, 0)",
    "gt": "(a, b) -> a > b (bool)",
    "ge": "(a, b) -> a >= b (bool)",
    "lt": "(a, b) -> a < b (bool)",
    "le": "(a, b) -> a <= b (bool)",
    "eq": "(a, b) -> a == b (bool)",
    "where": "(cond, a, b) -> a where cond else b",
    "matmul": "(a, b) -> a @ b with NumPy matmul semantics (1-D promotion, batch broadcasting)",
    "permute": "(a) -> a with axes reordered; attrs axes: tuple[int, ...]",
    "reshape": "(a) -> a reshaped; attrs shape: tuple[int, ...] (no -1)",
    "expand": "(a) -> a broadcast to attrs shape",
    "sum": "(a) -> sum over attrs axes (tuple or None for all), attrs keepdims: bool",
    "mean": "(a) -> mean over attrs axes (tuple or None for all), attrs keepdims: bool",
    "split": "(a) -> len(outputs) pieces of a along attrs axis, cut at attrs indices: tuple[int, ...]",
    "cat": "(*arrays) -> arrays concatenated along attrs axis",
    "cast": "(a) -> a converted to outputs[0].dtype",
}


class Executor(ABC):
    """Computes (or schedules) array commands; the only place where array values exist."""

    @abstractmethod
    def execute(
        self, op: str, inputs: tuple[Array, ...], attrs: Mapping[str, Any], outputs: tuple[TensorMeta, ...]
    ) -> tuple[Array, ...]:
        """Run command `op` (a key of INSTRUCTIONS) on input handles; return one handle per entry of `outputs`."""

    @abstractmethod
    def upload(self, value: np.ndarray) -> Array:
        """Turn a host array into a handle this executor owns (the value is copied or sent, never aliased)."""

    @abstractmethod
    def download(self, array: Array, meta: TensorMeta) -> np.ndarray:
        """Return the values behind a handle as a host array with `meta`'s shape and dtype."""


class _ExecutorStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[Executor] = []


_STACK = _ExecutorStack()
#: the process-wide executor outside any use_executor(); simdist.autograd installs a NumpyExecutor (which
#: builds on this module, so this module cannot make it)
_DEFAULT: list[Executor] = []


def set_default_executor(executor: Executor) -> None:
    """Make ``executor`` the one tensors are created on outside any ``use_executor()`` block."""
    _DEFAULT[:] = [executor]


def current_executor() -> Executor:
    """The executor new tensors are created on: the innermost use_executor(), else the process-wide default."""
    if _STACK.stack:
        return _STACK.stack[-1]
    return _DEFAULT[0]


@contextmanager
def use_executor(executor: Executor) -> Iterator[Executor]:
    """Create tensors inside the block on `executor` (ops always run on their inputs' executor)."""
    _STACK.stack.append(executor)
    try:
        yield executor
    finally:
        _STACK.stack.pop()
