"""Simulated CUDA devices for one whole process, outside a simulated run: a real rank process without a GPU runs
code written for GPUs (``python -m real --emulate-cuda``).

The process is one rank of a real job. Its tensors on ``cuda:i`` are the simulated device's wrappers, and every op
on them runs on the CPU tensors inside, in a dispatch mode of the process's own (:class:`ProcessCudaMode`): the
same unwrapping, device checks, per-device generators and memory accounting as in a simulated run, so the same
program gives the same numbers here as under ``simdist.run``. There is no simulated clock: kernels run on the CPU
when they are called, so the device is never behind the host, and events read the wall clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from simdist.clock.sites import caller_site
from simdist.compute.devices import DeviceSpec, get_device
from simdist.compute.memory import MemoryTracker, tracking_hooks
from simdist.cuda.rank import RankCuda
from simdist.cuda.tensor import rewrap, unwrap
from simdist.cuda.transfers import planned_bytes
from simdist.cudart.install import emulated, rank_thread
from simdist.cudart.state import in_ranks
from simdist.errors import CudaEmulationError
from simdist.layers import LIBRARY_FILES, NOT_CALL_SITES
from simdist.patching import replaced

#: the patches of simdist.patching.INVENTORY this module makes
_OWNER = "simdist.cudart.process"
#: the GPU model a process emulates unless told otherwise (the H100 preset's)
DEFAULT_DEVICE = "H100"


class WallClock:
    """What the simulated events read in a process of its own: the wall clock, with a device that is never behind
    its host (each CPU kernel has run when its call returns)."""

    def __init__(self) -> None:
        #: events ask ``ctx.time.device_now()``: the device's clock is the host's
        self.time = self
        self.baton = self

    def now(self) -> float:
        """The host's clock, seconds."""
        return time.perf_counter()

    def device_now(self) -> float:
        """Where the device's queue ends, seconds: now (nothing is queued)."""
        return time.perf_counter()

    def settle(self) -> None:
        """Nothing is queued."""

    def synchronize(self) -> None:
        """Nothing is queued."""

    def sleep(self, seconds: float, why: str = "") -> None:
        """Wait ``seconds`` of wall time (an event recorded in the future; never the case here)."""
        time.sleep(max(0.0, seconds))

    def stream_end(self, stream: int | None = None) -> float:
        """Where a stream's queue ends, seconds: now (each kernel has run when its call returns)."""
        return time.perf_counter()

    def stream_wait(self, stream: int, until: float) -> None:
        """A stream waiting for an event: nothing to wait for, the event was reached when it was recorded."""

    def synchronize_stream(self, stream: int | None = None) -> None:
        """Nothing is queued."""

    def wait_for_device(self, until: float) -> None:
        """Wait until the device reaches ``until`` (seconds): it has, when its event was recorded."""
        self.sleep(until - time.perf_counter())

    @property
    def races(self) -> NoRaces:
        """Streams never overlap here (each kernel has run when its call returns): no race to look for."""
        return _NO_RACES


class NoRaces:
    """The race detector's part that events and streams call, for a process whose streams never overlap."""

    def clock(self, rank: int, stream: int, now: float) -> dict[int, float]:
        """What an event orders after it: nothing to order."""
        return {}

    def stream_waited(self, rank: int, waiter: int | None, clock: dict[int, float]) -> None:
        """A stream or the host waited for an event: nothing was in flight."""


_NO_RACES = NoRaces()


class ProcessCudaMode(TorchDispatchMode):
    """Runs each op on simulated-GPU tensors on the CPU tensors inside them, as a simulated run's rank mode does,
    without pricing it: random ops draw from the device's generator, and device memory is accounted."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # as simdist.compute.cost.ComputeCostMode: nothing here is meant to be compiled
        return False

    def __init__(self, cuda: RankCuda, tracker: MemoryTracker) -> None:
        super().__init__()
        self._cuda = cuda
        self._tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        call = unwrap(func, args, kwargs or {})
        if call is None:
            out = func(*args, **(kwargs or {}))
            if not self._cuda.in_use:
                self._tracker.after(func, args, kwargs, out)
            return out
        if call is NotImplemented:
            return NotImplemented
        self._cuda.use()
        planned = planned_bytes(call)
        if planned:
            self._tracker.reserve(planned, func)
        result = rewrap(call, call.run(self._cuda.generator))
        self._tracker.after(func, call.inputs(), None, result)
        return result


def _spec(device: str | DeviceSpec) -> DeviceSpec:
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    if not spec.is_gpu:
        raise CudaEmulationError(
            f"a process can emulate CUDA on a GPU model only; {spec.name!r} is not one (use a GPU such as "
            f"{DEFAULT_DEVICE!r})"
        )
    return spec


@contextlib.contextmanager
def emulated_process(
    devices: int, rank: int = 0, device: str | DeviceSpec = DEFAULT_DEVICE, seed: int | None = None
) -> Iterator[None]:
    """During the block this process (rank ``rank`` of a job) has ``devices`` simulated GPUs of model ``device``,
    and the calling thread runs its ops on them.

    Each device's generator starts from ``seed`` (None: the CPU generator's seed, which a real process draws at
    random, as torch's CUDA generators do). ``torch.manual_seed`` seeds them all, as on a GPU. Raises
    :class:`CudaEmulationError`, having changed nothing, where the emulation cannot run in this process.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise CudaEmulationError(
            f"a process emulating CUDA needs at least one device; got devices={devices!r}"
        )
    spec = _spec(device)
    start = int(torch.initial_seed()) if seed is None else int(seed)
    started = time.perf_counter()
    tracker = MemoryTracker(
        rank,
        spec.memory_capacity,
        lambda: time.perf_counter() - started,
        lambda: str(caller_site(NOT_CALL_SITES, LIBRARY_FILES)),
        spec.name,
        clock="wall time since the emulation started",
    )
    cuda = RankCuda(
        rank,
        lambda index: start,
        lambda: None,
        tracker.device_memory_only,
        host_link_bandwidth=spec.host_link_bandwidth,
        link_latency=spec.launch_overhead,
    )

    def on_devices() -> contextlib.ExitStack:
        """What a thread of the process runs under: the devices' mode, accounted into the process's tracker."""
        stack = contextlib.ExitStack()
        for manager in (tracker.entered(), rank_thread(), ProcessCudaMode(cuda, tracker)):
            stack.enter_context(manager)
        return stack

    patches = {
        "torch.cuda.synchronize": in_ranks(torch.cuda.synchronize, lambda device=None: None),
        "threading.Thread.start": _starting_on_devices(threading.Thread.start, on_devices),
    }
    with (
        emulated(WallClock(), spec, devices, [cuda], process_rank=cuda),
        replaced(_OWNER, patches),
        tracking_hooks(),
        on_devices(),
    ):
        yield


def _starting_on_devices(start: Any, on_devices: Any) -> Any:
    """``Thread.start`` for threads that run on the process's simulated devices, as the thread that started them
    does (a dispatch mode belongs to one thread: without one, ``torch.ones(2, device="cuda")`` fails there)."""

    def start_on_devices(self: threading.Thread) -> None:
        run = self.run

        def run_on_devices() -> None:
            with on_devices():
                run()

        self.run = run_on_devices  # type: ignore[method-assign]
        start(self)

    return start_on_devices
