"""``torch.cuda``'s device, property, memory and random-number functions, answered for the calling rank from its
simulated devices (:mod:`simdist.cudart.install` puts them in place in rank code only).

Devices: a rank sees its node's GPUs, ``cuda:0`` to ``cuda:{n-1}``; the current device is per host thread, as
CUDA's is. Properties come from the cluster's device model. Memory is the rank's device memory as the run
accounts it (``simdist.run(..., memory=True)``), reserved equal to allocated (no caching allocator is
modelled). Each (rank, device) has its own generator.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from simdist.compute.memory import MemoryTracker, current_tracker
from simdist.cuda import device as current
from simdist.cuda.rank import RankCuda
from simdist.cudart.state import active, follow, rank
from simdist.errors import SimdistError

#: what ``torch.version.cuda`` answers during a run that emulates CUDA (the toolkit torch 2.13's CUDA wheels
#: build with), and ``torch.cuda.nccl.version()``
CUDA_VERSION = "12.8"
NCCL_VERSION = (2, 27, 5)


def _rank() -> RankCuda:
    found = rank()
    if found is None:  # the install calls these in rank code only
        raise SimdistError("simulated torch.cuda called outside a rank of a run that emulates CUDA")
    return found


def index_of(device: Any = None, *, optional: bool = True) -> int:
    """The device index ``device`` names (an int, ``"cuda:1"``, a ``torch.device``; None: the current device)."""
    if device is None:
        return current.current()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return current.current() if device.index is None else device.index
    if isinstance(device, int) and not isinstance(device, bool):
        return current.current() if device < 0 and optional else device
    raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")


# ---------------------------------------------------------------------------------------------- devices
def is_available() -> bool:
    """Simulated GPUs are available."""
    return True


def is_initialized() -> bool:
    """Whether the rank's code has initialised CUDA (a tensor on a device, ``set_device``), as torch answers."""
    return _rank().initialized


def bind_group(device_id: Any) -> None:
    """``init_process_group(device_id=...)`` in rank code: a group bound to a GPU makes the rank's code a GPU program
    (fully_shard's default mesh is on CUDA), but runs no torch.cuda initialisation, so DeviceMesh still sets the
    device from LOCAL_RANK, as on a GPU machine."""
    found = rank()
    if found is not None and (isinstance(device_id, int) or getattr(device_id, "type", None) == "cuda"):
        found.use(initialize=False)


def lazy_init() -> None:
    """Nothing to initialise: the simulated devices exist from the rank's start."""


def device_count() -> int:
    """The node's GPUs (as many as the cluster has ranks per node)."""
    return current.count()


def current_device() -> int:
    """The calling thread's current device."""
    return current.current()


def set_device(device: Any) -> None:
    """Make ``device`` the calling thread's current device (a negative index is a no-op, as in torch)."""
    index = index_of(device, optional=False)
    if index < 0:
        return
    current.set_current(index)
    follow()
    _rank().use()


def exchange_device(index: int) -> int:
    """Make ``index`` current and return the previous one (``torch.cuda.device(i)`` enters with it)."""
    if index < 0:
        return -1
    previous = current.current()
    current.set_current(index)
    follow()
    return previous


def maybe_exchange_device(index: int) -> int:
    """As :func:`exchange_device` (``torch.cuda.device`` leaves with it)."""
    return exchange_device(index)


@dataclass(frozen=True)
class CudaDeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers for a simulated device."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    uuid: str
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    warp_size: int = 32
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count}, "
            f"uuid={self.uuid}) (simulated)"
        )


def get_device_properties(device: Any = None) -> CudaDeviceProperties:
    """The simulated device's name, compute capability, memory and multiprocessors, from the cluster's model."""
    index = current.check(
        index_of(device, optional=False)
    )  # a negative index is refused, as torch refuses it
    emulation = active()
    assert emulation is not None
    spec, node_rank = emulation.spec, _rank().rank // max(emulation.per_node, 1)
    major, minor = spec.compute_capability
    capacity = spec.memory_capacity
    return CudaDeviceProperties(
        name=spec.cuda_device_name,
        major=major,
        minor=minor,
        total_memory=int(capacity) if capacity < 2**62 else 2**62,
        multi_processor_count=spec.multiprocessors,
        uuid=f"GPU-{node_rank:08x}-0000-0000-0000-{index:012x}",
    )


def get_device_name(device: Any = None) -> str:
    """The simulated device's name (e.g. ``"NVIDIA H100 80GB HBM3"``)."""
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """The simulated device's compute capability (major, minor)."""
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 is supported from compute capability 8.0 (Ampere) on, as torch decides on a GPU."""
    return get_device_capability()[0] >= 8


def is_tf32_supported() -> bool:
    """TF32 is supported from compute capability 8.0 (Ampere) on."""
    return get_device_capability()[0] >= 8


# ---------------------------------------------------------------------------------------------- memory
def _tracker() -> MemoryTracker | None:
    """The rank's memory accounting, or None (warned once) in a run without ``memory=True``."""
    tracker = current_tracker()
    if tracker is None:
        emulation = active()
        if emulation is not None and not emulation.warned_memory:
            emulation.warned_memory = True
            warnings.warn(
                "torch.cuda's memory statistics answer 0 in this run: simdist accounts device memory only with "
                "simdist.run(..., memory=True) (simdist run --memory)",
                stacklevel=5,
            )
    return tracker


#: torch.cuda.memory_stats' metrics of bytes, and of counts (each per pool, with current, peak, allocated, freed)
_BYTE_METRICS = (
    "allocated_bytes",
    "active_bytes",
    "requested_bytes",
    "reserved_bytes",
    "inactive_split_bytes",
)
_COUNT_METRICS = ("allocation", "active", "segment", "inactive_split")


def memory_stats(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats`` with the keys torch's allocator reports: each live storage is one allocation
    in one segment of the large pool (no caching allocator is modelled, so reserved equals allocated, and nothing
    is inactive or split)."""
    current.check(index_of(device))
    tracker = _tracker()
    stats: dict[str, Any] = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0}
    live = {
        "bytes": (
            (tracker.current, tracker.peak_since_reset, tracker.allocated_total, tracker.freed_total)
            if tracker is not None
            else (0, 0, 0, 0)
        ),
        "count": (
            (len(tracker._live), tracker.blocks_peak, tracker.allocations, tracker.frees)
            if tracker is not None
            else (0, 0, 0, 0)
        ),
    }
    stats["num_device_alloc"], stats["num_device_free"] = live["count"][2], live["count"][3]
    for metrics, kind in ((_BYTE_METRICS, "bytes"), (_COUNT_METRICS, "count")):
        for metric in metrics:
            inactive = metric.startswith("inactive_split")
            for pool in ("all", "large_pool", "small_pool"):
                figures = (0, 0, 0, 0) if inactive or pool == "small_pool" else live[kind]
                for name, value in zip(("current", "peak", "allocated", "freed"), figures):
                    stats[f"{metric}.{pool}.{name}"] = value
    for metric in ("oversize_allocations", "oversize_segments"):
        for name in ("current", "peak", "allocated", "freed"):
            stats[f"{metric}.{name}"] = 0
    return dict(sorted(stats.items()))


def _bytes() -> tuple[int, int]:
    """The rank's device bytes live now and at their peak since the last reset."""
    tracker = _tracker()
    return (tracker.current, tracker.peak_since_reset) if tracker is not None else (0, 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start the peak (``max_memory_allocated``) again from the bytes live now."""
    current.check(index_of(device))
    tracker = current_tracker()
    if tracker is not None:
        tracker.reset_peak()


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Nothing is accumulated beyond the current and peak figures."""
    current.check(index_of(device))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the simulated device: its capacity less the rank's live device memory."""
    total = get_device_properties(device).total_memory
    return max(0, total - _bytes()[0]), total


def empty_cache() -> None:
    """No caching allocator is modelled: nothing to release."""


# ---------------------------------------------------------------------------------------------- random numbers
def manual_seed(seed: int) -> None:
    """Seed the current device's generator."""
    _rank().generator(current.current()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator."""
    _rank().seed_all(int(seed))


def seed() -> None:
    """Seed the current device's generator from the run's seed stream."""
    _rank().generator(current.current()).seed()


def seed_all() -> None:
    """Seed every device's generator with one seed from the run's seed stream."""
    r = _rank()
    value = r.generator(current.current()).seed()
    r.seed_all(value)


def initial_seed() -> int:
    """The current device's generator's seed."""
    return _rank().generator(current.current()).initial_seed()


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """The device's generator state (a CPU generator's: it loads back with :func:`set_rng_state` only)."""
    return _rank().generator(current.check(index_of(device))).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """Restore the device's generator state."""
    _rank().generator(current.check(index_of(device))).set_state(new_state.detach().to("cpu", torch.uint8))


def get_rng_state_all() -> list[torch.Tensor]:
    """Every device's generator state."""
    return [get_rng_state(i) for i in range(current.count())]


def set_rng_state_all(new_states: Any) -> None:
    """Restore every device's generator state."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def seed_devices(seed: int) -> None:
    """``torch.manual_seed(seed)`` in rank code: seeds every device's generator too, as torch does."""
    found = rank()
    if found is not None:
        found.seed_all(seed)
