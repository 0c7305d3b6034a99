"""A profiled op rebuilt as a call on the meta device, so that simdist's cost model prices it as a run would.

A Kineto trace recorded with ``record_shapes=True`` lists each op's inputs: ``Input type`` (a dtype, or
``Scalar``, ``ScalarList``, ``TensorList``, ...), ``Input Dims``, ``Input Strides`` and ``Concrete Inputs``
(scalar values, in newer torch). Tensors become meta tensors of those shapes, strides and dtypes, scalars their
recorded values; the op's overload is the first whose schema takes them (the trace names the op, not the
overload). An op that cannot be rebuilt (a value the trace did not record, an op without a meta kernel) is
not priced, and the fit says how many.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the profiler's names of tensor dtypes (c10's ``toString`` of the scalar type)
DTYPES: Mapping[str, torch.dtype] = {
    "float": torch.float32,
    "double": torch.float64,
    "c10::Half": torch.float16,
    "c10::BFloat16": torch.bfloat16,
    "c10::Float8_e4m3fn": torch.float8_e4m3fn,
    "c10::Float8_e5m2": torch.float8_e5m2,
    "long int": torch.int64,
    "int": torch.int32,
    "short int": torch.int16,
    "signed char": torch.int8,
    "unsigned char": torch.uint8,
    "bool": torch.bool,
    "c10::complex<float>": torch.complex64,
    "c10::complex<double>": torch.complex128,
}
#: an input whose value the trace did not record: the call cannot be rebuilt
_UNKNOWN = object()


@dataclass(frozen=True)
class Call:
    """An op rebuilt on meta tensors: the overload, its arguments and its (meta) output."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any


def _value(text: str) -> Any:
    """A recorded concrete input (``'1'``, ``'False'``, ``'[64, 512]'``, ``'tanh'``) as a Python value."""
    if text == "":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a string argument, as gelu's approximate='tanh'


def _inputs(args: Mapping[str, Any]) -> list[Any] | None:
    """The op's inputs as values (meta tensors, scalars, lists), or None where a tensor's shape is unreadable."""
    types = args.get("Input type") or []
    dims = args.get("Input Dims") or []
    strides = args.get("Input Strides") or []
    concrete = args.get("Concrete Inputs") or []
    known = next((DTYPES[t] for t in types if t in DTYPES), torch.float32)
    out: list[Any] = []
    for i, kind in enumerate(types):
        shape = dims[i] if i < len(dims) else None
        text = concrete[i] if i < len(concrete) and isinstance(concrete[i], str) else None
        if kind in DTYPES:
            if not _is_shape(shape):
                return None
            stride = strides[i] if i < len(strides) and _is_shape(strides[i]) else None
            if stride is not None and len(stride) == len(shape):
                out.append(torch.empty_strided(shape, stride, dtype=DTYPES[kind], device="meta"))
            else:
                out.append(torch.empty(shape, dtype=DTYPES[kind], device="meta"))
        elif kind == "TensorList":
            if not isinstance(shape, list) or not all(_is_shape(s) for s in shape):
                return None
            out.append([torch.empty(s, dtype=known, device="meta") for s in shape])
        elif text is not None and (text != "" or kind == ""):
            out.append(_value(text))
        elif kind == "":
            out.append(None)  # an absent optional argument (older traces record no concrete inputs)
        elif kind == "Scalar":
            out.append(1)  # alpha/beta of addmm, add's alpha: 1 unless the trace says otherwise
        else:
            out.append(_UNKNOWN)
    return out


def _is_shape(d: Any) -> bool:
    return isinstance(d, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in d)


def rebuild(name: str, args: Mapping[str, Any]) -> Call | None:
    """The call a trace's op event describes, run on the meta device; None where it cannot be rebuilt."""
    namespace, sep, op = name.partition("::")
    if not sep or namespace != "aten":
        return None
    packet = getattr(torch.ops.aten, op, None)
    inputs = _inputs(args)
    if packet is None or inputs is None:
        return None
    for overload in _overloads(packet):
        func = getattr(packet, overload)
        placed = _place(func._schema, inputs)
        if placed is None:
            continue
        call_args, call_kwargs = placed
        out = _run(func, call_args, call_kwargs)
        if out is not _UNKNOWN:
            return Call(func, tuple(call_args), call_kwargs, out)
    return None


def _run(func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``func``'s output on these meta arguments; ``_UNKNOWN`` where it refuses them or has no meta kernel."""
    try:
        return func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any refusal means another overload, or an op the fit cannot price
        return _UNKNOWN


def _overloads(packet: Any) -> list[str]:
    """The overloads to try, the default first and ``out=`` variants last (the profiler shows out= as inputs)."""
    names = list(packet.overloads())
    return sorted(names, key=lambda o: (o != "default", "out" in o, o))


def _place(schema: Any, inputs: Sequence[Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """(positional, keyword) arguments of ``schema`` from the recorded ``inputs``; None where they do not fit."""
    arguments = schema.arguments
    if len(inputs) > len(arguments):
        return None
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for arg, value in zip(arguments, inputs):
        if value is _UNKNOWN:
            return None
        tensor_arg = str(arg.type).startswith(("Tensor", "Optional[Tensor]"))
        if tensor_arg != isinstance(value, torch.Tensor) and not (
            value is None and "Optional" in str(arg.type)
        ):
            return None
        if arg.kwarg_only:
            if value is not None:
                keywords[arg.name] = value
        else:
            positional.append(value)
    return positional, keywords
