"""Which tensors a group presented under a backend name takes on a GPU cluster, as torch 2.13 routes them.

torch's ``ProcessGroup`` holds one backend per device type (``BackendConfig``: ``"nccl"`` is ``cuda:nccl``,
``"gloo"`` is ``cpu:gloo,cuda:gloo``, ``"cpu:gloo,cuda:nccl"`` one of each) and sends each call to the backend of
its tensors' device; a device without one is refused ("No backend type associated with device type cpu"). gloo
takes CUDA tensors in most collectives (it stages them through pinned host memory) but not in
``allreduce_coalesced``, which it refuses, nor in ``allgather_coalesced`` and point-to-point calls, where it
passes device pointers to its host transport. On a cluster without a GPU model every group takes CPU tensors
whatever its name: programs written for the CPU present ``"nccl"`` there for NCCL's timing and reduction order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from simdist.cuda.tensor import SimCudaTensor, collective_on_device
from simdist.errors import InvalidArgumentError

#: the devices each backend name serves when it is given alone (torch's ``Backend.backend_capability``);
#: ``"simdist"`` serves both with itself
_CAPABILITY = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "simdist": ("cpu", "cuda")}

#: operations (the process group's method names) that gloo refuses on CUDA tensors, with gloo's words; None where
#: gloo has no check and would hand device memory to its host transport
_GLOO_HOST_ONLY: dict[str, str | None] = {
    "allreduce_coalesced": "ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda",
    "allgather_coalesced": None,
    "all_gather_single_coalesced": None,
    "send": None,
    "recv": None,
    "recv_anysource": None,
}


#: the torch.distributed names of the process group's methods, for messages
_USER_NAMES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor (coalesced)",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor (coalesced)",
    "alltoall": "all_to_all",
    "recv_anysource": "recv",
}


def device_backends(name: str) -> dict[str, str]:
    """The backend of each device type a group presented as ``name`` has (``BackendConfig``'s map)."""
    text = name.lower()
    if ":" not in text:
        return {device: text for device in _CAPABILITY.get(text, ("cpu", "cuda"))}
    pairs = (pair.split(":") for pair in text.split(","))
    return {device.strip(): backend.strip() for device, backend in pairs}


def device_of(t: torch.Tensor) -> str:
    """The device type a process group takes ``t`` for: a simulated GPU's tensor (or, inside a collective op with
    device operands, the CPU tensor holding its values) is ``"cuda"``."""
    if type(t) is SimCudaTensor:
        return "cuda"
    kind = t.device.type
    return "cuda" if kind == "cpu" and collective_on_device() else kind


def _tensors(values: Iterable[object]) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def gpu_index(args: Iterable[object]) -> int | None:
    """The simulated GPU a call's first tensor on one is on, as its caller holds it (None: no such tensor)."""
    return next((t.device.index for t in _tensors(args) if type(t) is SimCudaTensor), None)


def call_device(args: Iterable[object]) -> str | None:
    """The device type of a call's first tensor as its caller holds it (None for a call without tensors)."""
    return next((device_of(t) for t in _tensors(args)), None)


class DevicePolicy:
    """What one group presented as ``name`` takes, per device type, on a GPU cluster (read-only: see :func:`policy`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.backends = device_backends(name)
        #: the device types, as ``ProcessGroup._device_types`` answers them (CPU first, as torch lists them)
        self.device_types = [torch.device(d) for d in sorted(self.backends, key=lambda d: d != "cpu")]

    def check(
        self, op: str, args: Iterable[object], reject: Callable[[str, str, str], InvalidArgumentError]
    ) -> None:
        """Refuse ``op`` on ``args`` where the backend for their device would: none for the device, or gloo on
        CUDA tensors where gloo does not take them. ``reject(op, problem, expected)`` makes the error."""
        what = _USER_NAMES.get(op, op)
        for t in _tensors(args):
            device = device_of(t)
            if device == "meta":
                continue
            backend = self.backends.get(device)
            if backend is None:
                raise reject(
                    what,
                    f"No backend type associated with device type {device}",
                    f"a group created with backend {self.name!r} has a backend for "
                    f"{', '.join(sorted(self.backends))} tensors only, and this {what} got a tensor on {t.device} "
                    f"(NCCL moves GPU memory only). Move the tensor to the GPU first (tensor.cuda(), or create it "
                    f"with device='cuda'), or create the group with backend='cpu:gloo,cuda:nccl' so that CPU "
                    f"tensors go through gloo",
                )
            if backend == "gloo" and device == "cuda" and op in _GLOO_HOST_ONLY:
                words = _GLOO_HOST_ONLY[op]
                raise reject(
                    what,
                    words
                    or f"ProcessGroupGloo::{op}: gloo takes CPU tensors only here (given a CUDA tensor, it "
                    f"passes device memory to its host transport)",
                    f"gloo serves {what} for CPU tensors only; copy the tensor to the host (tensor.cpu()) and back, "
                    f"or use a group whose CUDA backend is NCCL (backend='nccl' or 'cpu:gloo,cuda:nccl')",
                )


@functools.cache
def policy(name: str) -> DevicePolicy:
    """The :class:`DevicePolicy` of ``name``, one shared by every group presented as ``name`` (every rank of a run
    makes its default group with one)."""
    return DevicePolicy(name)
