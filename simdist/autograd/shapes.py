"""Shape and dtype rules of the ops, computed from metadata alone so no executor is ever asked for values."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np  # dtype promotion only: no array values are handled here

from simdist.autograd.errors import ShapeError
from simdist.autograd.executor import TensorMeta
from simdist.autograd.sites import call_site

Shape = tuple[int, ...]


def _fail(op: str, what: str, fix: str) -> ShapeError:
    return ShapeError(f"{op} at {call_site()}: {what}. {fix}")


@functools.cache
def result_dtype(a: np.dtype, b: np.dtype) -> np.dtype:
    """NumPy's promotion of two dtypes (float32 with float64 gives float64)."""
    return np.result_type(a, b)


@functools.cache
def float_dtype(a: np.dtype) -> np.dtype:
    """The dtype of a floating-valued op (exp, log, division) on `a`: `a` if floating, else float64."""
    return a if a.kind in "fc" else np.dtype(np.float64)


def floating_meta(meta: TensorMeta) -> TensorMeta:
    """`meta` itself when its dtype is floating (no new object: the common case), else the same shape in float64."""
    return meta if meta.dtype.kind in "fc" else TensorMeta(meta.shape, np.dtype(np.float64))


_BINARY: dict[tuple[TensorMeta, TensorMeta], TensorMeta] = {}


def binary_meta(a: TensorMeta, b: TensorMeta, op: str) -> TensorMeta:
    """Metadata of a broadcasting elementwise op on `a` and `b`: broadcast shape, promoted dtype."""
    if a is b or a == b:
        return a
    # Memoized: a backward pass meets the same few shape pairs (gradient against saved input) over and over.
    meta = _BINARY.get((a, b))
    if meta is None:
        meta = TensorMeta(broadcast_shapes(a.shape, b.shape, op), result_dtype(a.dtype, b.dtype))
        if len(_BINARY) >= 4096:
            _BINARY.clear()
        _BINARY[(a, b)] = meta
    return meta


def broadcast_shapes(a: Shape, b: Shape, op: str) -> Shape:
    """NumPy broadcasting of two shapes; a ShapeError naming `op` when they do not broadcast."""
    if a == b:
        return a
    n = max(len(a), len(b))
    pa = (1,) * (n - len(a)) + a
    pb = (1,) * (n - len(b)) + b
    out = []
    for i, (x, y) in enumerate(zip(pa, pb)):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise _fail(
                op,
                f"cannot broadcast shapes {a} and {b}: aligned from the right, dimension {i - n} has sizes "
                f"{x} and {y}, expected equal sizes or one of them 1",
                "Reshape one operand (e.g. insert a size-1 axis) so the sizes line up",
            )
    return tuple(out)


def sum_to_axes(shape: Shape, target: Shape) -> tuple[int, ...]:
    """Axes of `shape` to sum (keepdims) so the result reshapes to `target`, undoing a broadcast to `shape`."""
    lead = len(shape) - len(target)
    axes = list(range(lead))
    for i, size in enumerate(target):
        if size == 1 and shape[lead + i] != 1:
            axes.append(lead + i)
    return tuple(axes)


def normalize_axes(axis: int | Sequence[int] | None, ndim: int, op: str) -> tuple[int, ...] | None:
    """Reduction axes as a sorted tuple of non-negative ints, or None for all axes."""
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for ax in axes:
        if not -ndim <= ax < ndim:
            raise _fail(
                op,
                f"axis {ax} is out of range for a tensor with {ndim} dimensions",
                f"Pass axes in [-{ndim}, {ndim - 1}]" if ndim else "A 0-d tensor has no axes: pass axis=None",
            )
        out.append(int(ax) % ndim)
    if len(set(out)) != len(out):
        raise _fail(op, f"axis {axis} names the same dimension twice", "Pass each axis once")
    return tuple(sorted(out))


def reduced_shape(shape: Shape, axes: tuple[int, ...] | None, keepdims: bool) -> Shape:
    """The shape left after reducing `axes` (None: all) of `shape`."""
    if axes is None:
        axes = tuple(range(len(shape)))
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def reshape_shape(shape: Shape, new: Sequence[int], op: str = "reshape") -> Shape:
    """`new` with a single -1 resolved; a ShapeError when the element counts differ."""
    new = tuple(int(s) for s in new)
    size = math.prod(shape)
    unknown = [i for i, s in enumerate(new) if s == -1]
    if len(unknown) > 1 or any(s < -1 for s in new):
        raise _fail(op, f"target shape {new} is invalid", "Use non-negative sizes and at most one -1")
    if unknown:
        known = math.prod(s for s in new if s != -1)
        if known == 0 or size % known:
            raise _fail(
                op,
                f"cannot infer -1 in {new} for {size} elements (input shape {shape})",
                "Make the known sizes divide the element count",
            )
        new = tuple(size // known if s == -1 else s for s in new)
    if math.prod(new) != size:
        raise _fail(
            op,
            f"cannot reshape {shape} ({size} elements) to {new} ({math.prod(new)} elements)",
            "Keep the element count unchanged",
        )
    return new


def permute_axes(axes: Sequence[int], ndim: int, op: str = "permute") -> tuple[int, ...]:
    """`axes` as non-negative ints after checking they are a permutation of range(ndim)."""
    out = tuple(int(a) % ndim if ndim and -ndim <= a < ndim else a for a in axes)
    if sorted(out) != list(range(ndim)):
        raise _fail(
            op,
            f"axes {tuple(axes)} are not a permutation of the {ndim} dimensions",
            f"Pass each of 0..{ndim - 1} exactly once",
        )
    return out


def matmul_shape(a: Shape, b: Shape) -> Shape:
    """Shape of a @ b under NumPy matmul rules (1-D operands promoted, batch dimensions broadcast)."""
    if not a or not b:
        raise _fail(
            "matmul",
            f"got a 0-d operand (shapes {a} and {b})",
            "Use mul for scalars; matmul needs at least 1-D operands",
        )
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise _fail(
            "matmul",
            f"inner dimensions differ: {a} @ {b} contracts {a2[-1]} with {b2[-2]}",
            "The last axis of the left operand must match the second-to-last (or only) axis of the right; "
            "transpose an operand if needed",
        )
    batch = broadcast_shapes(a2[:-2], b2[:-2], "matmul (batch dimensions)")
    out = batch + (a2[-2], b2[-1])
    if len(b) == 1:
        out = out[:-1]
    if len(a) == 1:
        out = out[:-2] + out[-1:] if len(b) > 1 else out[:-1]
    return out


def split_sizes(size: int, sections: int | Sequence[int], axis: int, op: str = "split") -> tuple[int, ...]:
    """Piece sizes along an axis of `size`: an int is a piece size (the last may be smaller), a list the sizes."""
    if isinstance(sections, (int, np.integer)):
        if sections <= 0:
            raise _fail(op, f"piece size {sections} is not positive", "Pass a piece size >= 1")
        sizes = [int(sections)] * (size // sections)
        if size % sections or not sizes:
            sizes.append(size % sections if size else 0)
        return tuple(sizes)
    sizes = tuple(int(s) for s in sections)
    if not sizes:
        raise _fail(op, "no sizes were given", "Pass at least one piece size")
    if sum(sizes) != size or any(s < 0 for s in sizes):
        raise _fail(
            op,
            f"sizes {sizes} sum to {sum(sizes)}, but axis {axis} has size {size}",
            "Pass non-negative sizes that add up to the axis size",
        )
    return sizes


def chunk_sizes(size: int, chunks: int, axis: int) -> tuple[int, ...]:
    """torch.chunk's split: pieces of ceil(size / chunks) along the axis, possibly fewer than `chunks`."""
    if chunks <= 0:
        raise _fail("chunk", f"chunks={chunks} is not positive", "Pass chunks >= 1")
    if size == 0:
        return (0,) * chunks  # as torch: `chunks` empty pieces
    return split_sizes(size, max(1, -(-size // chunks)), axis, "chunk")


def normalize_axis(axis: int, ndim: int, op: str) -> int:
    """One axis as a non-negative int, checked against ndim."""
    if not -ndim <= axis < ndim:
        raise _fail(
            op, f"axis {axis} is out of range for {ndim} dimensions", f"Pass an axis in [-{ndim}, {ndim - 1}]"
        )
    return axis % ndim
