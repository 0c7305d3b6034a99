"""The local executor: runs every command with NumPy and checks results against the engine's shape rules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from simdist.autograd.errors import ExecutorError
from simdist.autograd.executor import Array, Executor, TensorMeta


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only, so neither branch overflows for large |x|.
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def _unary(f: Callable[[Any], Any]) -> Callable[..., tuple[Array, ...]]:
    return lambda inputs, attrs, outputs: (f(inputs[0]),)


def _floating_unary(f: Callable[[Any], Any]) -> Callable[..., tuple[Array, ...]]:
    # Compute in the result dtype the shape rule chose: NumPy would pick float16/float32 for small integer
    # and bool inputs, and unsigned arithmetic inside the kernel (sigmoid's -|x|) would wrap around.
    return lambda inputs, attrs, outputs: (f(np.asarray(inputs[0], dtype=outputs[0].dtype)),)


def _binary(f: Callable[[Any, Any], Any]) -> Callable[..., tuple[Array, ...]]:
    return lambda inputs, attrs, outputs: (f(inputs[0], inputs[1]),)


_KERNELS: dict[str, Callable[..., tuple[Array, ...]]] = {
    "full": lambda inputs, attrs, outputs: (np.full(outputs[0].shape, attrs["value"], outputs[0].dtype),),
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "div": _binary(np.true_divide),
    "pow": _binary(np.power),
    "pow_scalar": lambda inputs, attrs, outputs: (np.power(inputs[0], attrs["exponent"]),),
    "neg": _unary(np.negative),
    "exp": _floating_unary(np.exp),
    "log": _floating_unary(np.log),
    "tanh": _floating_unary(np.tanh),
    "sigmoid": _floating_unary(_sigmoid),
    "relu": lambda inputs, attrs, outputs: (np.maximum(inputs[0], np.zeros((), inputs[0].dtype)),),
    "gt": _binary(np.greater),
    "ge": _binary(np.greater_equal),
    "lt": _binary(np.less),
    "le": _binary(np.less_equal),
    "eq": _binary(np.equal),
    "where": lambda inputs, attrs, outputs: (np.where(*inputs),),
    "matmul": _binary(np.matmul),
    "permute": lambda inputs, attrs, outputs: (np.transpose(inputs[0], attrs["axes"]),),
    "reshape": lambda inputs, attrs, outputs: (np.reshape(inputs[0], attrs["shape"]),),
    "expand": lambda inputs, attrs, outputs: (np.broadcast_to(inputs[0], attrs["shape"]),),
    "sum": lambda inputs, attrs, outputs: (
        np.sum(inputs[0], axis=attrs["axes"], keepdims=attrs["keepdims"]),
    ),
    "mean": lambda inputs, attrs, outputs: (
        np.mean(inputs[0], axis=attrs["axes"], keepdims=attrs["keepdims"]),
    ),
    "split": lambda inputs, attrs, outputs: tuple(np.split(inputs[0], attrs["indices"], axis=attrs["axis"])),
    "cat": lambda inputs, attrs, outputs: (np.concatenate(inputs, axis=attrs["axis"]),),
    "cast": lambda inputs, attrs, outputs: (np.asarray(inputs[0]).astype(outputs[0].dtype),),
}


class NumpyExecutor(Executor):
    """Computes each command immediately with NumPy; arrays are np.ndarray (or NumPy scalars for 0-d results)."""

    def __init__(self, check: bool = True) -> None:
        # check: verify every result's shape and dtype against the engine's metadata; this is what lets a
        # command executor trust that metadata without ever fetching values.
        self.check = check

    def execute(
        self, op: str, inputs: tuple[Array, ...], attrs: Mapping[str, Any], outputs: tuple[TensorMeta, ...]
    ) -> tuple[Array, ...]:
        """Run `op` now; see simdist.autograd.executor.INSTRUCTIONS for the command set."""
        kernel = _KERNELS.get(op)
        if kernel is None:
            raise ExecutorError(
                f"NumpyExecutor has no kernel for op {op!r}; expected one of {sorted(_KERNELS)}. "
                "Add the op to INSTRUCTIONS and to every executor."
            )
        results = kernel(inputs, attrs, outputs)
        if self.check:
            if len(results) != len(outputs):
                raise ExecutorError(
                    f"op {op!r} produced {len(results)} arrays, the engine expected {len(outputs)}"
                )
            for i, array in enumerate(results):
                meta = outputs[i]
                # .shape and .dtype exist on arrays and on the NumPy scalars 0-d results come back as.
                if array.shape != meta.shape or array.dtype != meta.dtype:
                    raise ExecutorError(
                        f"op {op!r} output {i}: the shape rule says {meta.shape} {meta.dtype}, NumPy computed "
                        f"{array.shape} {array.dtype} (attrs {dict(attrs)}); the op's shape rule is wrong"
                    )
        return results

    def upload(self, value: np.ndarray) -> Array:
        """Copy a host array (tensors are immutable, so later edits to `value` must not show through)."""
        return np.array(value, copy=True)

    def download(self, array: Array, meta: TensorMeta) -> np.ndarray:
        """Return the array itself (read-only views stay read-only)."""
        return np.asarray(array)
