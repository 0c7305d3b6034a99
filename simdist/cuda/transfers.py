"""What an op on a simulated GPU moves across the host link, and what it will allocate on the device.

A copy between host and device (``.to("cuda")``, ``.cpu()``, ``copy_`` across devices) runs at the host link's
bandwidth, not the device's, from or to pinned memory, and slower from or to pageable memory
(:mod:`simdist.cuda.pinned`); a blocking one (``non_blocking=False``, torch's default), and any copy from or to
pageable memory, makes the host wait until it is done, as ``cudaMemcpy`` does. Factories and copies know how many bytes they will allocate before they run,
so an allocation that cannot fit is refused before the CPU memory behind it is taken.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch

from simdist.cuda.tensor import Call, SimCudaTensor

aten = torch.ops.aten

#: torch profiler's names for the two directions (what a GPU trace shows)
HOST_TO_DEVICE = "Memcpy HtoD"
DEVICE_TO_HOST = "Memcpy DtoH"

_COPIES = frozenset(
    {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
)
#: ops whose output has the size of their first operand
_LIKE = frozenset(
    {
        aten._to_copy.default,
        aten.empty_like.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.rand_like.default,
        aten.randn_like.default,
        aten.clone.default,
    }
)


class Transfer:
    """A copy across the host link: its direction, bytes, whether the program asked the host to wait for it, its
    host-side tensor, and whether the copy makes that tensor pinned (torch pins a non-blocking copy's output)."""

    __slots__ = ("blocking", "direction", "host", "nbytes", "pins")

    def __init__(self, direction: str, nbytes: int, blocking: bool, host: Any = None, pins: bool = False) -> None:
        self.direction = direction
        self.nbytes = nbytes
        self.blocking = blocking
        self.host = host
        self.pins = pins


def _argument(call: Call, position: int, name: str, default: Any) -> Any:
    if len(call.orig_args) > position:
        return call.orig_args[position]
    return call.orig_kwargs.get(name, default)


def transfer(call: Call, out: Any) -> Transfer | None:
    """The host-link copy ``call`` makes (its CPU result ``out``), or None if it is not one."""
    func = call.func
    if func not in _COPIES or not call.host_operand and call.out_device is not None:
        return None
    if func is aten._to_copy.default:
        src = call.orig_args[0]
        to_host = call.out_device is None
        if (type(src) is SimCudaTensor) != to_host:
            return None  # host to host, device to device
        blocking = not bool(_argument(call, 5, "non_blocking", False))
        nbytes = out.nbytes if isinstance(out, torch.Tensor) else 0
        if to_host:
            # torch's _to_copy allocates a non-blocking copy's host output in pinned memory
            return Transfer(DEVICE_TO_HOST, nbytes, blocking, out, pins=not blocking)
        return Transfer(HOST_TO_DEVICE, nbytes, blocking, src)
    dst, src = (
        call.orig_args[0],
        call.orig_args[1] if len(call.orig_args) > 1 else call.orig_kwargs.get("src"),
    )
    if not isinstance(src, torch.Tensor) or (type(dst) is SimCudaTensor) == (type(src) is SimCudaTensor):
        return None
    blocking = not bool(_argument(call, 2, "non_blocking", False))
    to_device = type(dst) is SimCudaTensor
    direction = HOST_TO_DEVICE if to_device else DEVICE_TO_HOST
    return Transfer(direction, dst.numel() * dst.element_size(), blocking, src if to_device else dst)


def copies_or_plans(func: Any) -> bool:
    """Whether ``func`` may be a copy across the host link (:func:`transfer`) or allocate what :func:`planned_bytes`
    knows before it runs; ops that are neither skip both."""
    if func in _COPIES or func in _LIKE:
        return True
    return not func.is_view and any(a.name == "size" for a in func._schema.arguments)


def planned_bytes(call: Call) -> int:
    """Bytes the op will allocate on the device, where that is known before it runs (factories, copies to the
    device, ``*_like``); 0 otherwise (the op's outputs are accounted once they exist)."""
    if call.out_device is None or call.func.is_view:  # a view allocates nothing, whatever its size argument
        return 0
    func = call.func
    kwargs = call.orig_kwargs
    dtype = kwargs.get("dtype")
    if func in _LIKE:
        src = call.orig_args[0]
        if not isinstance(src, torch.Tensor):
            return 0
        return src.numel() * (src.element_size() if dtype is None else _itemsize(dtype))
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "size":
            size = call.orig_args[i] if i < len(call.orig_args) else kwargs.get("size")
            if not isinstance(size, (list, tuple)) or not all(type(s) is int for s in size):
                return 0
            if dtype is None and call.orig_args and isinstance(call.orig_args[0], torch.Tensor):
                dtype = call.orig_args[0].dtype  # new_empty, new_zeros, ...
            return prod(size) * _itemsize(dtype if dtype is not None else torch.get_default_dtype())
    return 0


def _itemsize(dtype: Any) -> int:
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0
