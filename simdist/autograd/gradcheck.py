"""Gradients as values (like torch.autograd.grad), numerical gradients, and gradcheck against them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np  # host-side finite differences: this module reads values on purpose

from simdist.autograd.backward import BackwardPass
from simdist.autograd.errors import GradcheckError
from simdist.autograd.grad_mode import no_grad
from simdist.autograd.graph import Graph
from simdist.autograd.tensor import Tensor


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


class GradientComputer:
    """Computes gradients of outputs with respect to chosen inputs without touching any .grad."""

    def __init__(self, graph: Graph | None = None) -> None:
        self.graph = graph

    def compute_gradients(
        self,
        outputs: Tensor | Sequence[Tensor],
        inputs: Tensor | Sequence[Tensor],
        grad_outputs: Any = None,
        *,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        allow_unused: bool = False,
    ) -> tuple[Tensor | None, ...]:
        """One gradient per input of sum(outputs * grad_outputs); grad_outputs may be omitted for scalar outputs."""
        outs = _as_tuple(outputs)
        grads = None if grad_outputs is None else _as_tuple(grad_outputs)
        return BackwardPass(self.graph).gradients(
            outs,
            _as_tuple(inputs),
            grads,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=allow_unused,
        )

    def compute_gradient(
        self,
        output: Tensor,
        input: Tensor,
        grad_output: Any = None,
        *,
        retain_graph: bool | None = None,
        create_graph: bool = False,
    ) -> Tensor:
        """d(sum(output * grad_output))/d(input), with input's shape."""
        (grad,) = self.compute_gradients(
            output, input, grad_output, retain_graph=retain_graph, create_graph=create_graph
        )
        assert grad is not None
        return grad

    @staticmethod
    def numerical_gradient(
        f: Callable[[Tensor], Tensor], x: Tensor | Any, eps: float = 1e-6, grad_output: Any = None
    ) -> np.ndarray:
        """Central-difference estimate of d(sum(f(x) * grad_output))/dx, with x's shape (see numerical_gradient)."""
        return numerical_gradient(f, x, eps, grad_output)

    def gradcheck(self, f: Callable[..., Any], inputs: Sequence[Tensor], **kwargs: Any) -> bool:
        """See gradcheck()."""
        return gradcheck(f, inputs, **kwargs)


def numerical_gradient(
    f: Callable[[Tensor], Tensor], x: Tensor | Any, eps: float = 1e-6, grad_output: Any = None
) -> np.ndarray:
    """Central-difference estimate of d(sum(f(x) * grad_output))/dx as a float64 array of x's shape.

    f is evaluated 2 * x.size times without recording; grad_output defaults to ones (so a scalar f gives its
    gradient). Error is O(eps**2) from truncation plus O(ulp(f) / eps) from rounding.
    """
    executor = x.executor if isinstance(x, Tensor) else None
    base = np.array(x.numpy() if isinstance(x, Tensor) else x, dtype=np.float64)
    weights = (
        None
        if grad_output is None
        else np.asarray(
            grad_output.numpy() if isinstance(grad_output, Tensor) else grad_output, dtype=np.float64
        )
    )
    dtype = np.dtype(x.dtype if isinstance(x, Tensor) else np.asarray(x).dtype)
    if dtype.kind != "f":
        raise GradcheckError(
            f"numerical_gradient: x has dtype {dtype}; central differences need a floating-point input. "
            f"Pass x as float64 (x.astype('float64'))"
        )

    def value(point: np.ndarray) -> float:
        with no_grad():
            out = np.asarray(f(Tensor(point.astype(dtype), executor=executor)).numpy(), dtype=np.float64)
        return float(np.sum(out if weights is None else out * weights))

    grad = np.zeros_like(base)
    flat, gflat = base.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        original = flat[i]
        # the step that survives rounding to x's dtype (a float32 x moves by less, or not at all, than eps)
        hi = float(np.asarray(original + eps, dtype=dtype))
        lo = float(np.asarray(original - eps, dtype=dtype))
        if hi == lo:
            raise GradcheckError(
                f"numerical_gradient: eps={eps} vanishes when x[{i}]={original} is rounded to {dtype}; "
                f"use a larger eps or a float64 input"
            )
        flat[i] = hi
        upper = value(base)
        flat[i] = lo
        lower = value(base)
        flat[i] = original
        gflat[i] = (upper - lower) / (hi - lo)
    return grad


def gradcheck(
    f: Callable[..., Any],
    inputs: Sequence[Tensor],
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
) -> bool:
    """Compare the full Jacobian of f(*inputs) from backward passes with central differences, per input.

    Every input with requires_grad is checked; f may return a tensor or a tuple of tensors. Returns True, or
    raises GradcheckError naming the input, output and element that disagree (False if raise_exception=False).
    """
    inputs = tuple(inputs)
    outputs = _as_tuple(f(*inputs))
    computer = GradientComputer()
    for i, x in enumerate(inputs):
        if not (isinstance(x, Tensor) and x.requires_grad):
            continue
        for j, out in enumerate(outputs):
            analytic = np.zeros(out.shape + x.shape)
            for position in np.ndindex(*out.shape):
                onehot = np.zeros(out.shape, dtype=out.dtype)
                onehot[position] = 1
                if out.requires_grad:
                    (g,) = computer.compute_gradients(
                        out, x, Tensor(onehot, executor=out.executor), retain_graph=True, allow_unused=True
                    )
                    if g is not None:
                        analytic[position] = g.numpy()

            def f_of_x(xi: Tensor, i: int = i, j: int = j) -> Tensor:
                args = list(inputs)
                args[i] = xi
                return _as_tuple(f(*args))[j]

            numerical = np.zeros_like(analytic)
            for position in np.ndindex(*out.shape):
                onehot = np.zeros(out.shape)
                onehot[position] = 1
                numerical[position] = numerical_gradient(f_of_x, x, eps, onehot)
            bad = np.abs(analytic - numerical) > atol + rtol * np.abs(numerical)
            if bad.any():
                where = tuple(int(k) for k in np.argwhere(bad)[0])
                out_pos, in_pos = where[: out.ndim], where[out.ndim :]
                message = (
                    f"gradcheck: d(output {j} at {out_pos}) / d(input {i} at {in_pos}) is "
                    f"{float(analytic[where]):.10g} from backward but {float(numerical[where]):.10g} from central "
                    f"differences (eps={eps}); expected agreement within atol={atol} + rtol={rtol} * |numerical| "
                    f"({int(bad.sum())} of {bad.size} Jacobian entries differ). Check the backward of the ops "
                    "between them; a kink (relu at 0) within eps of the point also causes this: move the point"
                )
                if raise_exception:
                    raise GradcheckError(message)
                return False
    return True
