"""Pinned (page-locked) host memory on a simulated GPU node: which host tensors are pinned, and what a copy
between host and device costs from pinned or from pageable memory.

On CUDA, a copy from or to pinned memory is one DMA at the host link's bandwidth, and with ``non_blocking=True``
the host goes on at once. A copy from or to pageable memory (any CPU tensor not pinned) is staged by the driver
through a pinned bounce buffer: the host memcpy into (or out of) that buffer and the DMA share the time, so the copy
runs slower, and the host waits for it even with ``non_blocking=True`` (CUDA Runtime API, "API synchronization
behavior": a transfer from pageable memory returns once the data is staged, one to pageable memory once it has
completed). Which tensors are pinned is tracked by their storage: those ``pin_memory()``, a factory's
``pin_memory=True`` and torch's own non-blocking copies to the host (``.to("cpu", non_blocking=True)`` pins its
output) made; ``is_pinned()`` answers from that, ``False`` for every other tensor (and for GPU tensors).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

aten = torch.ops.aten

#: the share of the host link's bandwidth a copy from or to pageable memory runs at. An estimate, not a
#: measurement: staging copies every byte twice (host memcpy, then DMA), which at best halves the rate where the two
#: do not overlap; NVIDIA's "How to Optimize Data Transfers in CUDA C/C++" (M. Harris, 2012) and its
#: ``bandwidthTest`` sample measure pageable copies below pinned ones by a factor that depends on the host's memory
#: system. Override it per run by assigning ``simdist.cuda.pinned.PAGEABLE_SHARE`` before ``simdist.run``.
PAGEABLE_SHARE = 0.5

#: ops that ask or make pinned memory
ASKS = frozenset({aten.is_pinned.default, aten._pin_memory.default})


class PinnedMemory:
    """The pinned host storages of one rank, held weakly (a storage leaves the set when it is freed)."""

    def __init__(self) -> None:
        self._storages: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        """Record ``tensor``'s storage as pinned."""
        storage = tensor.untyped_storage()
        key = id(storage)
        self._storages[key] = weakref.ref(storage, lambda _ref, key=key: self._storages.pop(key, None))

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor`` is a host tensor in pinned memory."""
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
            return False
        if tensor.device.type != "cpu":
            return False
        storage = tensor.untyped_storage()
        ref = self._storages.get(id(storage))
        return ref is not None and ref() is storage

    def dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run ``is_pinned``, ``_pin_memory`` or a factory with ``pin_memory=True`` as CUDA would."""
        if func is aten.is_pinned.default:
            return self.holds(args[0])
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.add(out)
        return out

    def share(self, tensor: Any) -> float:
        """The share of the host link's bandwidth a copy from or to host tensor ``tensor`` runs at."""
        return 1.0 if self.holds(tensor) else PAGEABLE_SHARE
