"""``torch.Generator(device="cuda")`` in rank code: a generator for a simulated GPU.

Simulated GPUs compute on the CPU, so a generator for one is a device generator (a CPU generator with CUDA's
Philox seed and offset beside it, :mod:`simdist.cuda.rngstate`) that says it belongs to ``cuda:i``. Every other
generator is torch's own, and ``isinstance(g, torch.Generator)`` holds for all of them.
"""

from __future__ import annotations

from typing import Any

import torch

from simdist.cuda.rngstate import DeviceGenerator
from simdist.cudart.api import index_of
from simdist.cudart.state import rank

_TorchGenerator = torch._C.Generator


class _Meta(type(_TorchGenerator)):  # type: ignore[misc]
    """Makes every torch generator an instance of :class:`CudaGenerator` (it stands for ``torch.Generator``)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _TorchGenerator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _TorchGenerator)


class CudaGenerator(DeviceGenerator, metaclass=_Meta):
    """``torch.Generator`` during a run that emulates CUDA."""

    _sim_device: torch.device

    def __new__(cls, device: Any = None) -> Any:
        target = torch.device(device) if isinstance(device, (str, int)) else device
        if rank() is None or not isinstance(target, torch.device) or target.type != "cuda":
            return _TorchGenerator() if device is None else _TorchGenerator(device)
        gen = super().__new__(cls)
        gen._sim_device = torch.device("cuda", index_of(target))
        return gen

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The simulated GPU the generator belongs to."""
        return self._sim_device

    def __reduce__(self) -> Any:
        return (_restore, (self._sim_device, self.get_state()))


def _restore(device: torch.device, state: torch.Tensor) -> Any:
    gen = CudaGenerator(device)
    gen.set_state(state)
    return gen
