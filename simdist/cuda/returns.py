"""What a rank returns leaves the run with its simulated GPU tensors moved to the host.

A simulated device ends with its run: once its native pieces are removed, torch aborts the process at the first
autograd op on a tensor whose device is CUDA. So every simulated GPU tensor in a rank's return value is replaced
by a CPU copy of its values: in lists, tuples (named ones too), dicts (of any dict type), dataclasses, modules
(their parameters, buffers and gradients) and the attributes of other objects, which are changed in place (they
are the run's own objects). A tensor reached twice becomes one host tensor, so ties and aliases stay.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Any

import torch

from simdist.cuda.tensor import SimCudaTensor

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
        """``obj`` moved to the host (a new object for tensors and immutable containers, the same one otherwise)."""
        kind = type(obj)
        if obj is None or kind in (int, float, bool, str, bytes, complex) or isinstance(obj, _OPAQUE):
            return obj
        key = id(obj)
        if key in self._moved:
            return self._moved[key]
        if depth > _DEPTH:
            return obj
        self._keep.append(obj)
        if kind is SimCudaTensor:
            return self._remember(key, self._tensor(obj, depth))
        if isinstance(obj, torch.Tensor):
            if obj.is_leaf and obj.grad is not None and type(obj.grad) is SimCudaTensor:
                obj.grad = self.move(obj.grad, depth + 1)
            return self._remember(key, obj)
        if isinstance(obj, torch.nn.Module):
            self._remember(key, obj)
            for module in obj.modules():
                for table in (module._parameters, module._buffers):
                    for name, value in table.items():
                        table[name] = self.move(value, depth + 1)
                for name, value in list(vars(module).items()):
                    if isinstance(value, torch.Tensor):  # a tensor kept as a plain attribute
                        setattr(module, name, self.move(value, depth + 1))
            return obj
        if isinstance(obj, tuple):
            items = [self.move(o, depth + 1) for o in obj]
            return self._remember(key, kind(*items) if hasattr(obj, "_fields") else kind(items))
        if isinstance(obj, list):
            self._remember(key, obj)
            obj[:] = [self.move(o, depth + 1) for o in obj]
            return obj
        if isinstance(obj, dict):
            items = list(obj.items())
            moved = self._remember(key, copy.copy(obj))
            moved.clear()
            for k, v in items:  # keys too: an optimizer's state is keyed by its parameters
                moved[self.move(k, depth + 1)] = self.move(v, depth + 1)
            return moved
        if dataclasses.is_dataclass(obj):
            fields = {
                f.name: self.move(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj) if f.init
            }
            return self._remember(key, dataclasses.replace(obj, **fields))
        attributes = getattr(obj, "__dict__", None)
        if type(attributes) is dict:
            self._remember(key, obj)
            for name, value in list(attributes.items()):
                attributes[name] = self.move(value, depth + 1)
        return obj

    def _remember(self, key: int, moved: Any) -> Any:
        self._moved[key] = moved
        return moved

    def _tensor(self, t: SimCudaTensor, depth: int) -> torch.Tensor:
        host = t._elem.detach().clone()
        moved: torch.Tensor = (
            torch.nn.Parameter(host, requires_grad=t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else host.requires_grad_(t.requires_grad)
        )
        if t.is_leaf and t.grad is not None:
            moved.grad = self.move(t.grad, depth + 1)
        return moved
