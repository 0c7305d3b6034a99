"""The reduce ops, declared once: one :class:`Reduction` record per op the ``"simdist"`` backend implements.

A record names the op as op descriptions, mismatch errors and traces print it, ties it to torch's
``ReduceOp``, says which element types gloo accepts it on, how a message's payload is reduced into the
receiver's buffer, what happens to the result at the end (AVG divides by the group size) and what
``simdist bench --op`` calls it. The process group, the message runner, the collective plans, the bench and
the documentation read these records. ``PREMUL_SUM`` (NCCL only) is refused as gloo refuses it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from simdist.errors import InvalidArgumentError

#: an in-place reduction: ``dst = dst (op) payload``
Combine = Callable[[torch.Tensor, torch.Tensor], object]

_RED = dist.ReduceOp.RedOpType


@dataclass(frozen=True)
class Reduction:
    """One reduce op."""

    #: as op descriptions, mismatch errors and traces print it: torch's enum name in lower case
    name: str
    torch_op: dist.ReduceOp.RedOpType
    #: the element types gloo accepts it on: "any"; "integral" (integers and bool: the bitwise ops);
    #: "floating" (floating-point and complex: AVG, which divides in floating point)
    dtypes: Literal["any", "integral", "floating"]
    #: ``dst = dst (op) payload`` in place, on every element type but bool
    combine: Combine
    #: the same op of two Python numbers (the value a reduction of scalars must give)
    scalar: Callable[[Any, Any], Any]
    #: gloo's step of its ring, ``fn(own, arrived)``, done in place on the arrived partial result ``acc``:
    #: ``gloo_step(acc, own)``. It is ``combine`` but for MIN and MAX, where gloo's ``std::min``/``std::max``
    #: keep the arrived value only when it compares smaller (larger), so a NaN or a signed zero comes out as
    #: gloo's does, while ``combine`` propagates NaN (see :mod:`simdist.algorithms.gloo_order`)
    gloo_step: Combine
    #: on bool tensors, where it differs from ``combine`` (SUM is logical or, PRODUCT logical and, as gloo)
    combine_bool: Combine | None = None
    #: it reduces complex tensors (torch's ``supports_complex``: SUM and AVG add real and imaginary parts
    #: apart; the others have no complex meaning gloo implements)
    on_complex: bool = False
    #: the result is divided by the group size once every payload has been reduced (AVG)
    divides: bool = False
    #: what ``simdist bench --op`` calls it (nccl-tests' ``-o`` names); None where the bench does not offer
    #: it: nccl-tests has no bitwise ops, and AVG's expected values are not exact in every type
    bench_name: str | None = None

    def combiner(self, dtype: torch.dtype) -> Combine:
        """The in-place reduction for buffers of ``dtype``."""
        if dtype == torch.bool and self.combine_bool is not None:
            return self.combine_bool
        return self.combine

    def finish(self, buf: torch.Tensor, n: int) -> None:
        """What the op does to a rank's reduced buffer of a group of ``n`` at the end (AVG divides by ``n``)."""
        if not self.divides:
            return
        if buf.dtype.is_floating_point or buf.dtype.is_complex:
            buf.div_(n)
        else:
            buf.copy_(torch.div(buf, n, rounding_mode="trunc"))

    def check_dtype(self, dtype: torch.dtype, what: str) -> None:
        """Raise InvalidArgumentError, with gloo's words first, unless gloo accepts this op on ``dtype``."""
        floating = dtype.is_floating_point or dtype.is_complex
        if self.dtypes == "integral" and floating:
            raise InvalidArgumentError(
                f"Cannot use ReduceOp.{self.torch_op.name} with non-integral dtype: {what} has dtype {dtype}; "
                f"bitwise reductions need an integer or bool tensor"
            )
        if dtype.is_complex and not self.on_complex:
            # torch's front end refuses all_reduce of complex tensors with these ops; reduce and
            # reduce_scatter reach gloo, which refuses them ("reduce does not support on complex tensors")
            raise InvalidArgumentError(
                f"ReduceOp.{self.torch_op.name} on complex tensors is not supported (gloo refuses it): "
                f"{what} has dtype {dtype}; complex tensors reduce with SUM and AVG only"
            )
        if self.dtypes == "floating" and not floating:
            # gloo divides by the world size in floating point, then fails to write the float back
            raise InvalidArgumentError(
                f"result type Float can't be cast to the desired output type {_TORCH_TYPE_NAMES.get(dtype, dtype)}: "
                f"ReduceOp.{self.torch_op.name} on {what} of dtype {dtype}; use a floating-point tensor, or SUM "
                f"and divide yourself"
            )


#: torch's C++ names of the integer types, as its casting error spells them
_TORCH_TYPE_NAMES = {
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool",
}  # fmt: skip


def _minimum(d: torch.Tensor, p: torch.Tensor) -> object:
    return torch.minimum(d, p, out=d)


def _maximum(d: torch.Tensor, p: torch.Tensor) -> object:
    return torch.maximum(d, p, out=d)


def _gloo_min(acc: torch.Tensor, own: torch.Tensor) -> object:
    # std::min(own, acc) is (acc < own) ? acc : own
    return torch.where(acc < own, acc, own, out=acc)


def _gloo_max(acc: torch.Tensor, own: torch.Tensor) -> object:
    # std::max(own, acc) is (own < acc) ? acc : own
    return torch.where(own < acc, acc, own, out=acc)


REDUCE_OPS: tuple[Reduction, ...] = (
    Reduction("sum", _RED.SUM, "any", torch.Tensor.add_, operator.add, torch.Tensor.add_, torch.Tensor.logical_or_,
              on_complex=True, bench_name="sum"),
    Reduction("avg", _RED.AVG, "floating", torch.Tensor.add_, operator.add, torch.Tensor.add_, on_complex=True,
              divides=True),
    Reduction("product", _RED.PRODUCT, "any", torch.Tensor.mul_, operator.mul, torch.Tensor.mul_,
              torch.Tensor.logical_and_, bench_name="prod"),
    Reduction("min", _RED.MIN, "any", _minimum, min, _gloo_min, bench_name="min"),
    Reduction("max", _RED.MAX, "any", _maximum, max, _gloo_max, bench_name="max"),
    Reduction("band", _RED.BAND, "integral", torch.Tensor.bitwise_and_, operator.and_, torch.Tensor.bitwise_and_),
    Reduction("bor", _RED.BOR, "integral", torch.Tensor.bitwise_or_, operator.or_, torch.Tensor.bitwise_or_),
    Reduction("bxor", _RED.BXOR, "integral", torch.Tensor.bitwise_xor_, operator.xor, torch.Tensor.bitwise_xor_),
)  # fmt: skip
"""Every reduce op simdist implements: the ones gloo implements, in torch's order."""

_BY_NAME: dict[str, Reduction] = {r.name: r for r in REDUCE_OPS}
_BY_TORCH: dict[Any, Reduction] = {r.torch_op: r for r in REDUCE_OPS}


def reduce_op(name: str) -> Reduction:
    """The record of the reduce op ``name`` (``"sum"``); a ValueError naming the choices if there is none."""
    found = _BY_NAME.get(name)
    if found is None:
        raise ValueError(f"unsupported reduce op {name!r}; expected one of {', '.join(_BY_NAME)}")
    return found


def reduce_op_of(op: Any) -> Reduction:
    """The record of torch's ``op`` (a ``ReduceOp`` or its ``RedOpType``); gloo's error for the ops it does not
    implement (PREMUL_SUM, UNUSED)."""
    kind = getattr(op, "op", op)
    found = _BY_TORCH.get(kind)
    if found is None:
        label = str(kind).rsplit(".", 1)[-1]
        raise InvalidArgumentError(
            f"Cannot use ReduceOp.{label} with Gloo: simdist implements the reduce ops gloo does "
            f"({', '.join(r.torch_op.name for r in REDUCE_OPS)}); scale the tensor yourself for PREMUL_SUM"
        )
    return found
