"""Tensor: an executor's array handle, its shape/dtype metadata, and its autograd state."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np  # host-side conversion of user data only; ops go through the executor

from simdist.autograd.errors import BackwardError
from simdist.autograd.executor import Array, Executor, TensorMeta, current_executor
from simdist.autograd.shapes import normalize_axis

if TYPE_CHECKING:
    from simdist.autograd.graph import Node


class Tensor:
    """An n-d array whose ops can be differentiated in reverse mode.

    The values live in `executor` behind the handle `data`; `shape` and `dtype` (together: `meta`) are tracked
    by the ops' shape rules, so they are known without asking the executor. A tensor is a leaf when it has no `grad_fn`; leaves
    with `requires_grad` receive gradients in `grad`. Tensors are immutable: no op writes into one.
    """

    __slots__ = (
        "__weakref__",
        "_accumulator",
        "data",
        "dtype",
        "executor",
        "grad",
        "grad_fn",
        "meta",
        "output_index",
        "requires_grad",
        "shape",
    )
    # NumPy defers `ndarray <op> Tensor` to the Tensor's reflected operator (and ufuncs refuse Tensors).
    __array_ufunc__ = None

    def __init__(
        self,
        data: Any,
        dtype: Any = None,
        *,
        requires_grad: bool = False,
        executor: Executor | None = None,
    ) -> None:
        if isinstance(data, Tensor):
            data = data.numpy()
        host = np.array(data, dtype=dtype)
        ex = executor if executor is not None else current_executor()
        self.data = ex.upload(host)
        self.shape: tuple[int, ...] = tuple(host.shape)
        self.dtype: np.dtype = host.dtype
        self.meta = TensorMeta(self.shape, self.dtype)
        self.executor = ex
        self.requires_grad = False
        self.grad: Tensor | None = None
        self.grad_fn: Node | None = None
        self.output_index = 0
        self._accumulator = None
        if requires_grad:
            self.requires_grad_(True)

    @classmethod
    def _wrap(cls, data: Array, meta: TensorMeta, executor: Executor) -> Tensor:
        """A constant tensor around an executor handle whose metadata the caller vouches for."""
        t = object.__new__(cls)
        t.data = data
        t.shape = meta.shape
        t.dtype = meta.dtype
        t.meta = meta
        t.executor = executor
        t.requires_grad = False
        t.grad = None
        t.grad_fn = None
        t.output_index = 0
        t._accumulator = None
        return t

    # --- metadata -------------------------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def numel(self) -> int:
        """Number of elements (torch spelling)."""
        return math.prod(self.shape)

    @property
    def is_leaf(self) -> bool:
        """True when not produced by a recorded op (created by the user, detached, or made under no_grad)."""
        return self.grad_fn is None

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # --- values (these fetch from the executor) ---------------------------------------------------------------

    def numpy(self) -> np.ndarray:
        """The values as a host NumPy array (read-only for the local executor: tensors are immutable)."""
        return self.executor.download(self.data, self.meta)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.numpy()
        return array.astype(dtype) if dtype is not None else (array.copy() if copy else array)

    def __bool__(self) -> bool:
        """Truth of a one-element tensor (as in torch); ambiguous, hence an error, for more elements."""
        if self.size != 1:
            raise ValueError(
                f"the truth value of a tensor of shape {self.shape} is ambiguous; expected one element. "
                "Reduce it first, e.g. bool((x > 0).numpy().all())"
            )
        return bool(self.item())

    def item(self) -> Any:
        """The single value of a one-element tensor as a Python number."""
        if self.size != 1:
            raise ValueError(f"item() needs a tensor with one element, this one has shape {self.shape}")
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        """The values as (nested) Python lists."""
        return self.numpy().tolist()

    def __repr__(self) -> str:
        extra = ""
        if self.grad_fn is not None:
            extra = f", grad_fn={self.grad_fn.name}"
        elif self.requires_grad:
            extra = ", requires_grad=True"
        body = np.array2string(np.asarray(self.numpy()), separator=", ", prefix="Tensor(")
        return f"Tensor({body}, dtype={self.dtype}{extra})"

    # --- autograd -----------------------------------------------------------------------------------------------

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Mark a leaf as needing a gradient (floating dtypes only); returns self."""
        if self.grad_fn is not None:
            raise BackwardError(
                f"requires_grad_() on a non-leaf tensor (produced by {self.grad_fn.name}): only leaves can be "
                "marked. Use x.detach().requires_grad_() to start a new leaf"
            )
        if requires_grad and self.dtype.kind not in "fc":
            raise BackwardError(
                f"requires_grad=True on a tensor of dtype {self.dtype}: expected a floating dtype, since only "
                "those have gradients. Convert first, e.g. x.astype('float64')"
            )
        self.requires_grad = bool(requires_grad)
        return self

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's values, cut from the graph (gradients do not flow through it)."""
        return Tensor._wrap(self.data, self.meta, self.executor)

    def backward(
        self, gradient: Tensor | None = None, retain_graph: bool | None = None, create_graph: bool = False
    ) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's .grad; `gradient` is required unless self has one element."""
        _late.BackwardPass(retain_graph=retain_graph, create_graph=create_graph).run(self, gradient)

    # --- operators ----------------------------------------------------------------------------------------------

    def _lift(self, other: Any) -> Tensor:
        """`other` as a tensor on this executor; Python scalars take this tensor's dtype, as in torch."""
        if isinstance(other, Tensor):
            return other
        if isinstance(other, (bool, int, float)):
            kind = self.dtype.kind
            if isinstance(other, bool) or (isinstance(other, int) and kind in "iufc") or kind in "fc":
                dtype = self.dtype
            else:
                dtype = np.result_type(self.dtype, type(other))
            return _late.dispatch.constant(other, dtype, self.executor)
        return Tensor(other, executor=self.executor)

    def __add__(self, other: Any) -> Tensor:
        return _late.ops.Add.apply(self, other if type(other) is Tensor else self._lift(other))

    def __radd__(self, other: Any) -> Tensor:
        return _late.ops.Add.apply(self._lift(other), self)

    def __sub__(self, other: Any) -> Tensor:
        return _late.ops.Sub.apply(self, other if type(other) is Tensor else self._lift(other))

    def __rsub__(self, other: Any) -> Tensor:
        return _late.ops.Sub.apply(self._lift(other), self)

    def __mul__(self, other: Any) -> Tensor:
        return _late.ops.Mul.apply(self, other if type(other) is Tensor else self._lift(other))

    def __rmul__(self, other: Any) -> Tensor:
        return _late.ops.Mul.apply(self._lift(other), self)

    def __truediv__(self, other: Any) -> Tensor:
        return _late.ops.Div.apply(self, other if type(other) is Tensor else self._lift(other))

    def __rtruediv__(self, other: Any) -> Tensor:
        return _late.ops.Div.apply(self._lift(other), self)

    def __neg__(self) -> Tensor:
        return _late.ops.Neg.apply(self)

    def __pos__(self) -> Tensor:
        return self

    def __pow__(self, exponent: Any) -> Tensor:
        return self.pow(exponent)

    def __rpow__(self, base: Any) -> Tensor:
        return _late.ops.Pow.apply(self._lift(base), self)

    def __matmul__(self, other: Any) -> Tensor:
        return _late.ops.Matmul.apply(self, self._lift(other))

    def __rmatmul__(self, other: Any) -> Tensor:
        return _late.ops.Matmul.apply(self._lift(other), self)

    def __gt__(self, other: Any) -> Tensor:
        return _late.ops.compare("gt", self, self._lift(other))

    def __ge__(self, other: Any) -> Tensor:
        return _late.ops.compare("ge", self, self._lift(other))

    def __lt__(self, other: Any) -> Tensor:
        return _late.ops.compare("lt", self, self._lift(other))

    def __le__(self, other: Any) -> Tensor:
        return _late.ops.compare("le", self, self._lift(other))

    def eq(self, other: Any) -> Tensor:
        """Elementwise ==, as a bool tensor (== itself keeps Python identity semantics so tensors stay hashable)."""
        return _late.ops.compare("eq", self, self._lift(other))

    def __and__(self, other: Any) -> Tensor:
        return _late.ops.logical_and(self, self._lift(other))

    # --- methods ------------------------------------------------------------------------------------------------

    def pow(self, exponent: Any) -> Tensor:
        """self ** exponent; a Python number exponent is an attribute, a tensor exponent is differentiated too."""
        if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
            return _late.ops.PowScalar.apply(self, exponent=float(exponent))
        return _late.ops.Pow.apply(self, self._lift(exponent))

    def matmul(self, other: Any) -> Tensor:
        """self @ other with NumPy matmul semantics."""
        return _late.ops.Matmul.apply(self, self._lift(other))

    def exp(self) -> Tensor:
        """e ** self."""
        return _late.ops.Exp.apply(self)

    def log(self) -> Tensor:
        """Natural logarithm."""
        return _late.ops.Log.apply(self)

    def tanh(self) -> Tensor:
        """Hyperbolic tangent."""
        return _late.ops.Tanh.apply(self)

    def sigmoid(self) -> Tensor:
        """Logistic function 1 / (1 + e ** -self)."""
        return _late.ops.Sigmoid.apply(self)

    def relu(self) -> Tensor:
        """max(self, 0); the gradient at exactly 0 is 0, as in torch."""
        return _late.ops.Relu.apply(self)

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Sum over `axis` (None: all axes)."""
        return _late.ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        """Mean over `axis` (None: all axes)."""
        return _late.ops.Mean.apply(self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape: Any) -> Tensor:
        """Same values in a new shape (one size may be -1); accepts reshape(2, 3) or reshape((2, 3))."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        return _late.ops.Reshape.apply(self, shape=shape)

    def view(self, *shape: Any) -> Tensor:
        """Alias of reshape (tensors are immutable, so views and copies behave alike)."""
        return self.reshape(*shape)

    def flatten(self) -> Tensor:
        """The values as a 1-D tensor."""
        return self.reshape(-1)

    def unsqueeze(self, axis: int) -> Tensor:
        """Insert a size-1 axis at `axis`."""
        axis = normalize_axis(axis, self.ndim + 1, "unsqueeze")
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

    def squeeze(self, axis: int | None = None) -> Tensor:
        """Drop size-1 axes (only `axis` when given and of size 1)."""
        if axis is None:
            return self.reshape(tuple(s for s in self.shape if s != 1))
        axis = normalize_axis(axis, self.ndim, "squeeze")
        if self.shape[axis] != 1:
            return self.reshape(self.shape)
        return self.reshape(self.shape[:axis] + self.shape[axis + 1 :])

    def permute(self, *axes: Any) -> Tensor:
        """Reorder the axes; accepts permute(1, 0) or permute((1, 0))."""
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])
        return _late.ops.Permute.apply(self, axes=axes)

    def transpose(self, axis0: int = -2, axis1: int = -1) -> Tensor:
        """Swap two axes (torch semantics; by default the last two)."""
        axes = list(range(self.ndim))
        a, b = normalize_axis(axis0, self.ndim, "transpose"), normalize_axis(axis1, self.ndim, "transpose")
        axes[a], axes[b] = axes[b], axes[a]
        return _late.ops.Permute.apply(self, axes=tuple(axes))

    @property
    def T(self) -> Tensor:
        """All axes reversed."""
        return _late.ops.Permute.apply(self, axes=tuple(range(self.ndim - 1, -1, -1)))

    @property
    def mT(self) -> Tensor:
        """The last two axes swapped (batched matrix transpose)."""
        return self.transpose(-2, -1)

    def expand(self, *shape: Any) -> Tensor:
        """Broadcast to `shape` (NumPy rules); the gradient sums back."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        return _late.ops.Expand.apply(self, shape=tuple(shape))

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        """Alias of expand(shape)."""
        return _late.ops.Expand.apply(self, shape=tuple(shape))

    def sum_to(self, shape: Sequence[int]) -> Tensor:
        """Sum a broadcast result back to `shape` (the adjoint of expand)."""
        return _late.ops.sum_to(self, tuple(shape))

    def split(self, sections: int | Sequence[int], axis: int = 0) -> tuple[Tensor, ...]:
        """Pieces along `axis`: an int is the piece size (torch.split), a sequence the sizes."""
        return _late.ops.split(self, sections, axis)

    def chunk(self, chunks: int, axis: int = 0) -> tuple[Tensor, ...]:
        """About `chunks` equal pieces along `axis` (torch.chunk)."""
        return _late.ops.chunk(self, chunks, axis)

    def astype(self, dtype: Any) -> Tensor:
        """Values converted to `dtype`; differentiable between floating dtypes."""
        return _late.ops.Cast.apply(self, dtype=np.dtype(dtype))

    def to(self, dtype: Any) -> Tensor:
        """Alias of astype (dtype only: the executor is fixed per tensor)."""
        return self.astype(dtype)


class _Late:
    """What Tensor's methods call from modules that build on Tensor (the ops, constants, the backward pass).

    Those modules import this one, so this one cannot import them; ``simdist.autograd`` binds them here
    once it has imported them (importing any autograd module runs the package's ``__init__`` first).
    """

    ops: Any = None
    dispatch: Any = None
    BackwardPass: Any = None


_late = _Late()


def bind(ops: Any, dispatch: Any, backward_pass: type) -> None:
    """Give Tensor's methods the ops package, the dispatch module and the BackwardPass class."""
    _late.ops, _late.dispatch, _late.BackwardPass = ops, dispatch, backward_pass
