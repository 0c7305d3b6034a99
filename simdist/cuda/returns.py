"""What a rank returns leaves the run with its simulated GPU tensors moved to the host.

A simulated device ends with its run: once its native pieces are removed, torch aborts the process at the first
autograd op on a tensor whose device is CUDA. So every simulated GPU tensor reachable from a rank's return value
is replaced by a CPU copy of its values: in lists, tuples (named ones too), dicts (keys too), frozen dataclasses,
tensor subclasses that wrap tensors (DTensor: FSDP2's and tensor parallelism's parameters), gradients, and the
attributes of any other object (a model's parameters, buffers and state, an optimizer's). Mutable containers
and objects are changed in place: they are the run's own. A tensor reached twice becomes one host tensor, so
ties and aliases between tensors stay.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from simdist.cuda.tensor import SimCudaTensor

#: values with nothing inside
_ATOMS = (int, float, bool, str, bytes, complex)
#: objects never looked into: they hold no rank results, and their references reach far (globals, the process)
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
#: how deep a return value is looked into
_DEPTH = 64


def to_host(obj: Any) -> Any:
    """``obj`` with every simulated GPU tensor reachable from it replaced by a CPU copy of its values."""
    return _Mover().move(obj, 0)


class _Mover:
    """One conversion: remembers what it has moved (by identity), so that shared tensors stay shared."""

    def __init__(self) -> None:
        self._moved: dict[int, Any] = {}
        self._keep: list[Any] = []  # the originals, alive while their ids are keys

    def move(self, obj: Any, depth: int) -> Any:
        """``obj`` moved to the host: a new object for tensors and immutable containers, the same one otherwise."""
        if obj is None or type(obj) in _ATOMS or isinstance(obj, _OPAQUE):
            return obj
        key = id(obj)
        if key in self._moved:
            return self._moved[key]
        if depth > _DEPTH:
            return obj
        self._keep.append(obj)
        if type(obj) is SimCudaTensor:
            return self._remember(key, self._tensor(obj, depth))
        if isinstance(obj, torch.Tensor):
            return self._remember(key, self._other_tensor(obj, depth))
        if isinstance(obj, tuple):
            items = [self.move(o, depth + 1) for o in obj]
            if all(a is b for a, b in zip(items, obj)):
                return self._remember(key, obj)
            return self._remember(key, type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items))
        self._remember(key, obj)
        try:
            return self._in_place(key, obj, depth)
        except Exception:  # noqa: BLE001 - an object that refuses changes keeps what it holds
            return obj

    def _in_place(self, key: int, obj: Any, depth: int) -> Any:
        if isinstance(obj, list):
            obj[:] = [self.move(o, depth + 1) for o in obj]
        elif isinstance(obj, dict):
            items = list(obj.items())
            moved = [(self.move(k, depth + 1), self.move(v, depth + 1)) for k, v in items]
            if any(new is not old for (new, _), (old, _) in zip(moved, items)):
                obj.clear()  # keys moved too: an optimizer's state is keyed by its parameters
                obj.update(moved)
            else:
                for (k, v), (_, new) in zip(items, moved):
                    if new is not v:
                        obj[k] = new
        elif dataclasses.is_dataclass(obj) and type(obj).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            fields = {
                f.name: self.move(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj) if f.init
            }
            return self._remember(key, dataclasses.replace(obj, **fields))
        else:
            attributes = getattr(obj, "__dict__", None)
            if type(attributes) is dict:
                for name, value in list(attributes.items()):
                    new = self.move(value, depth + 1)
                    if new is not value:
                        attributes[name] = new
        return obj

    def _remember(self, key: int, moved: Any) -> Any:
        self._moved[key] = moved
        return moved

    def _tensor(self, t: SimCudaTensor, depth: int) -> torch.Tensor:
        host = _host_copy(t._elem)
        moved: torch.Tensor = (
            torch.nn.Parameter(host, requires_grad=t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else host.requires_grad_(t.requires_grad)
        )
        self._move_grad(t, moved, depth)
        return moved

    def _other_tensor(self, t: torch.Tensor, depth: int) -> torch.Tensor:
        """A host tensor's gradient moved; a wrapper subclass (DTensor) rebuilt around its moved inner tensors."""
        if is_traceable_wrapper_subclass(t):
            names, context = t.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = {name: getattr(t, name) for name in names}
            moved = {name: self.move(value, depth + 1) for name, value in inner.items()}
            if any(moved[name] is not inner[name] for name in names):
                rebuilt = type(t).__tensor_unflatten__(moved, context, t.size(), t.stride())  # type: ignore[attr-defined]
                rebuilt = (
                    torch.nn.Parameter(rebuilt, requires_grad=t.requires_grad)
                    if isinstance(t, torch.nn.Parameter)
                    else rebuilt.requires_grad_(t.requires_grad)
                )
                self._move_grad(t, rebuilt, depth)
                return rebuilt
        self._move_grad(t, t, depth)
        return t

    def _move_grad(self, t: torch.Tensor, moved: torch.Tensor, depth: int) -> None:
        if t.is_leaf and t.grad is not None:
            grad = self.move(t.grad, depth + 1)
            if moved is not t or grad is not t.grad:
                moved.grad = grad


def _host_copy(elem: torch.Tensor) -> torch.Tensor:
    """A copy of ``elem``'s values; where its storage was freed (FSDP resizes unsharded parameters' storages to
    nothing between uses), a tensor of its shape whose storage is freed alike, not a read past the storage's end."""
    elem = elem.detach()
    if elem.numel() == 0:
        return elem.clone()
    last = elem.storage_offset() + sum((n - 1) * s for n, s in zip(elem.shape, elem.stride()))
    storage = elem.untyped_storage()
    if (last + 1) * elem.element_size() <= storage.nbytes():
        return elem.clone()
    empty = torch.empty_strided(elem.shape, elem.stride(), dtype=elem.dtype)
    empty.untyped_storage().resize_(storage.nbytes())
    return empty
