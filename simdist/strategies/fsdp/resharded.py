"""What a module holds in place of a sharded parameter while it is not gathered: a placeholder that knows it.

Between uses, a sharding unit's full parameter has no memory (its storage is resized to zero). A tensor in that
state still answers ``shape`` and ``dtype``, but an op that reads it either raises torch's ``setStorage: ...
storage of size 0`` or reads unallocated memory and crashes the process. So while a unit is not gathered, every
module that owns it holds a :class:`Resharded` placeholder instead: the same shape, dtype and device, a view of
the same (empty) storage (a meta tensor of that shape over a tensor subclass), and a ``__torch_function__`` that
reads metadata from the full parameter and, for every other op, asks the FSDP wrapper for the gathered parameter first (:meth:`Gatherer._use_sharded`).
Inside the wrapper's forward the unit is gathered on the spot, as FSDP2 gathers every parameter of the module it
wraps; outside it the wrapper raises an error that names the parameter and what to do. torch's FSDP2 keeps a
sharded DTensor in the module between uses, with the same effect: the full parameter exists only in forward
and backward.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import resolve_name
from torch.utils._pytree import tree_map_only


class Gatherer(Protocol):
    """What a placeholder needs from its FSDP wrapper."""

    def _use_sharded(self, name: str, func: Any, metadata: bool) -> nn.Parameter: ...


def _getters(*names: str) -> list[Any]:
    return [getattr(torch.Tensor, n).__get__ for n in names if hasattr(torch.Tensor, n)]


#: properties that describe a tensor without reading its values
_PROPERTIES = (
    *("shape", "dtype", "device", "layout", "ndim", "itemsize", "nbytes", "_version", "output_nr"),
    *("requires_grad", "grad", "grad_fn", "is_leaf", "retains_grad"),
    *("is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested"),
)

#: ops that read or set a tensor's metadata, its gradient or its hooks, never its values: they run on the full
#: parameter whether it is gathered or not (counting parameters, freezing them, ``zero_grad``)
_METADATA = frozenset(
    [
        *_getters(*_PROPERTIES),
        torch.Tensor.grad.__set__,
        torch.Tensor.requires_grad.__set__,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.is_contiguous,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.get_device,
        torch.Tensor.data_ptr,
        torch.Tensor.untyped_storage,
        torch.Tensor.requires_grad_,
        torch.Tensor.register_hook,
        torch.Tensor.register_post_accumulate_grad_hook,
        torch.Tensor.__len__,
    ]
)


def op_name(func: Any) -> str:
    """How an error names the op that used the parameter (``torch.nn.functional.linear``, ``torch.Tensor.sum``)."""
    name = resolve_name(func) or getattr(func, "__qualname__", repr(func))
    return name.removesuffix(".__get__")  # a property read: torch.Tensor.data


class Resharded(nn.Parameter):
    """A sharding unit's full parameter while it is not gathered (see the module docstring)."""

    _fsdp: weakref.ref[Gatherer]
    _unit: str

    @staticmethod
    def of(view: torch.Tensor, requires_grad: bool, unit: str, fsdp: Gatherer) -> Resharded:
        """The placeholder of unit ``unit`` of ``fsdp``, over ``view``: a tensor shaped as its full parameter.

        ``view`` is a plain tensor, not the full parameter itself: an op on that parameter here would count it
        as used (a memory tracker watches parameters from their first use).
        """
        if type(view) is not torch.Tensor:
            # torch's Parameter makes a tensor subclass (a wrapper tensor, such as a device emulation's) a
            # parameter by flagging the subclass's own object, which would not be a Resharded: no redirection,
            # no hooks on the full parameter, reads of freed memory. The placeholder computes nothing and every
            # op on it, its device and storage included, goes to the full parameter, so it can stand on a meta
            # tensor of the same shape and dtype.
            view = torch.empty(view.shape, dtype=view.dtype, device="meta")
        placeholder = Resharded(view, requires_grad=requires_grad)
        placeholder._fsdp = weakref.ref(fsdp)
        placeholder._unit = unit
        return placeholder

    def _full(self, func: Any, metadata: bool) -> torch.Tensor:
        fsdp = self._fsdp()
        if fsdp is None:
            raise RuntimeError(
                f"{op_name(func)} used {self._unit!r}, a parameter sharded by an FSDP wrapper that no longer "
                "exists; its values went with the wrapper (save model.state_dict() before dropping it)"
            )
        return fsdp._use_sharded(self._unit, func, metadata)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            metadata = func in _METADATA
        except TypeError:  # an unhashable callable: not one of the metadata ops
            metadata = False
        args, kwargs = tree_map_only(Resharded, lambda p: p._full(func, metadata), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(self.shape), self.dtype
        return f"Resharded({self._unit!r}, shape={shape}, dtype={dtype}): a parameter FSDP holds sharded"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickling and deepcopy read the values: through the wrapper, which refuses outside forward
        return self._full(Resharded.__reduce_ex__, False).__reduce_ex__(protocol)


def full_parameter(param: nn.Parameter) -> nn.Parameter:
    """``param``, or the full parameter a :class:`Resharded` placeholder stands for (without gathering it)."""
    return param._full(None, True) if isinstance(param, Resharded) else param  # type: ignore[return-value]
