"""Route one command to the executor of its input tensors and wrap the resulting handles as Tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from simdist.autograd.errors import ExecutorError
from simdist.autograd.executor import Executor, TensorMeta
from simdist.autograd.sites import call_site
from simdist.autograd.tensor import Tensor

_NO_ATTRS: Mapping[str, Any] = {}


def executor_of(tensors: tuple[Tensor, ...], op: str) -> Executor:
    """The one executor all `tensors` live on; an ExecutorError naming `op` when they differ."""
    executor = tensors[0].executor
    for t in tensors[1:]:
        if t.executor is not executor:
            raise ExecutorError(
                f"{op} at {call_site()}: inputs live on different executors ({executor!r} and {t.executor!r}); "
                "expected one executor per computation. Move the data with tensor(x.numpy(), executor=...)"
            )
    return executor


def emit(
    op: str,
    inputs: tuple[Tensor, ...],
    outputs: tuple[TensorMeta, ...],
    attrs: Mapping[str, Any] = _NO_ATTRS,
    executor: Executor | None = None,
) -> tuple[Tensor, ...]:
    """Run `op` on `inputs` (or on `executor` if none) and wrap the results as constant Tensors of `outputs`."""
    ex = executor if executor is not None else executor_of(inputs, op)
    arrays = ex.execute(op, tuple([t.data for t in inputs]), attrs, outputs)
    return tuple([Tensor._wrap(a, m, ex) for a, m in zip(arrays, outputs)])


def emit1(
    op: str, inputs: tuple[Tensor, ...], output: TensorMeta, attrs: Mapping[str, Any] = _NO_ATTRS
) -> Tensor:
    """emit() for the common single-output case (kept lean: it runs once per op)."""
    ex = inputs[0].executor
    if len(inputs) == 1:
        data: tuple[Any, ...] = (inputs[0].data,)
    else:
        for t in inputs:
            if t.executor is not ex:
                executor_of(inputs, op)  # raises with the details
        data = tuple([t.data for t in inputs])
    (array,) = ex.execute(op, data, attrs, (output,))
    return Tensor._wrap(array, output, ex)


# 0-d constants by (executor, dtype, value, sign of a zero). The same few scalars recur in every backward formula
# (1.0 in tanh's, 0.0 in relu's), and a constant is immutable, so one handle can serve them all.
_CONSTANTS: dict[tuple[Any, ...], Tensor] = {}
_MAX_CONSTANTS = 1024


def constant(value: bool | float, dtype: np.dtype, executor: Executor) -> Tensor:
    """A 0-d tensor holding `value` as `dtype` on `executor` (made once by a "full" command, then reused)."""
    key = (executor, dtype, value, value == 0 and math.copysign(1.0, value))
    t = _CONSTANTS.get(key)
    if t is None:
        if isinstance(value, float) and math.isnan(value):  # NaN never equals itself: it would never be found
            return emit("full", (), (TensorMeta((), dtype),), {"value": value}, executor)[0]
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = emit("full", (), (TensorMeta((), dtype),), {"value": value}, executor)[0]
    return t
