"""``torch.load`` in rank code: checkpoints written on GPUs, or mapped to them, load onto the simulated GPUs.

``torch.load`` reads each storage on the host and asks ``torch.serialization.default_restore_location`` to move it
where its tag (``"cuda:1"`` in a checkpoint written on a GPU) or ``map_location`` says; a CPU build cannot make a
CUDA storage, and a simulated GPU tensor has none of its own. So a storage bound for a GPU stays on the host,
marked with its device (resolved and validated by torch's own function: ``"cuda"`` is the current device,
a device the node lacks is torch's error), and when tensors are rebuilt from it, the storage is copied to the device once (a host-to-device
copy, priced and accounted as any other) and each tensor becomes a view of that copy on the simulated GPU: views
saved together stay views of one another.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.serialization

from simdist.cuda.tensor import SimCudaTensor
from simdist.cudart.state import in_ranks

#: the attributes a marked host storage carries during a load: its device, then its copy there
_DEVICE, _COPY = "_simdist_cuda_device", "_simdist_cuda_copy"


def restore_location(original: Any) -> Any:
    """``torch.serialization.default_restore_location``: in rank code, storages bound for CUDA stay on the host,
    marked with their simulated device."""

    def restore(storage: Any, location: Any) -> Any:
        if isinstance(location, str) and location.startswith("cuda"):
            setattr(storage, _DEVICE, torch.serialization._validate_device(location, "cuda"))
            return storage
        return original(storage, location)

    return in_ranks(original, restore)


def rebuild_tensor(original: Any) -> Any:
    """``torch._utils._rebuild_tensor_v2``: a tensor of a marked storage is rebuilt as a view of the storage's copy
    on its simulated GPU. (Same name and module as torch's: the weights-only unpickler allows it by them.)"""

    @functools.wraps(original)
    def rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *args: Any, **kwargs: Any) -> Any:
        untyped = getattr(storage, "_untyped_storage", None)
        dev = getattr(untyped, _DEVICE, None)
        if dev is None:
            return original(storage, storage_offset, size, stride, *args, **kwargs)
        copy = getattr(untyped, _COPY, None)
        if copy is None:
            copy = torch.empty(0, dtype=torch.uint8).set_(untyped).to(dev)
            setattr(untyped, _COPY, copy)
        on_device = torch.storage.TypedStorage(
            wrap_storage=copy._elem.untyped_storage(), dtype=storage.dtype, _internal=True
        )
        host = original(on_device, storage_offset, size, stride, *args, **kwargs)
        return SimCudaTensor(host.detach(), dev, requires_grad=host.requires_grad)

    return rebuild
