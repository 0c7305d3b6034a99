"""Putting the simulated CUDA runtime in place for one run, and taking it away afterwards.

On a cluster whose device is a GPU model, rank code's ``torch.cuda`` and ``torch.accelerator`` answer from the
rank's simulated devices (:mod:`simdist.cudart.api`, :mod:`simdist.cudart.events`); anywhere else (the
simulator's own threads, the caller's) torch's own functions answer. The native pieces are installed and checked
first (:mod:`simdist.cuda.native`), then a backward pass on a simulated GPU tensor is run: any failure stops the
run before a rank starts. On a cluster without a GPU model, rank code that uses CUDA gets a clear error naming
its line. Every change is declared in :data:`simdist.patching.INVENTORY` and undone when the run ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.cuda.memory
import torch.cuda.nccl
import torch.cuda.nvtx
import torch.cuda.random
import torch.distributed as dist
import torch.optim.optimizer as optimizer_module
import torch.utils._foreach_utils as foreach_utils

from simdist.clock.baton import current_rank_state
from simdist.comm.context import RunContext
from simdist.compute.devices import DeviceSpec
from simdist.cuda import attention, native, pending
from simdist.cuda.rank import RankCuda
from simdist.cuda.tensor import SimCudaTensor, swapping
from simdist.cudart import api, checkpoints, dtensor_random, events, streams
from simdist.cudart.generator import CudaGenerator
from simdist.cudart.nvtx import NvtxRanges, record_function_methods
from simdist.cudart.state import Emulation, activate, in_ranks
from simdist.cudart.state import rank as rank_cuda
from simdist.errors import CudaEmulationError, NoCudaError
from simdist.patching import OnImport, replaced

#: the patches of simdist.patching.INVENTORY this module makes
_OWNER = "simdist.cudart.install"

#: torch.cuda's functions answered from the simulated devices, and the modules that hold them too
_FUNCTIONS: dict[str, Any] = {
    "_lazy_init": api.lazy_init,
    "set_device": api.set_device,
    "init": api.lazy_init,
    "is_available": api.is_available,
    "is_initialized": api.is_initialized,
    "device_count": api.device_count,
    "current_device": api.current_device,
    "_exchange_device": api.exchange_device,
    "_maybe_exchange_device": api.maybe_exchange_device,
    "get_device_name": api.get_device_name,
    "get_device_capability": api.get_device_capability,
    "get_device_properties": api.get_device_properties,
    "is_bf16_supported": api.is_bf16_supported,
    "is_tf32_supported": api.is_tf32_supported,
    "is_current_stream_capturing": lambda: False,
    "current_stream": streams.current_stream,
    "default_stream": streams.default_stream,
    "_set_stream_by_id": streams.set_stream_by_id,
}
_MEMORY: dict[str, Any] = {
    "memory_stats": api.memory_stats,
    "reset_peak_memory_stats": api.reset_peak_memory_stats,
    "reset_accumulated_memory_stats": api.reset_accumulated_memory_stats,
    "mem_get_info": api.mem_get_info,
    "empty_cache": api.empty_cache,
}
_RANDOM: dict[str, Any] = {
    "manual_seed": api.manual_seed,
    "manual_seed_all": api.manual_seed_all,
    "seed": api.seed,
    "seed_all": api.seed_all,
    "initial_seed": api.initial_seed,
    "get_rng_state": api.get_rng_state,
    "set_rng_state": api.set_rng_state,
    "get_rng_state_all": api.get_rng_state_all,
    "set_rng_state_all": api.set_rng_state_all,
}
_STREAM_METHODS: dict[str, Any] = {
    "__init__": streams.stream_init,
    "device": property(streams.stream_device),
    "wait_event": streams.stream_wait_event,
    "wait_stream": streams.stream_wait_stream,
    "record_event": streams.stream_record_event,
    "query": streams.stream_query,
    "synchronize": streams.stream_synchronize,
    "is_capturing": streams.stream_is_capturing,
    "__eq__": streams.stream_eq,
    "__hash__": streams.stream_hash,
    "__repr__": streams.stream_repr,
}
_EVENT_METHODS: dict[str, Any] = {
    "__init__": events.event_init,
    "record": events.event_record,
    "query": events.event_query,
    "synchronize": events.event_synchronize,
    "wait": events.event_wait,
    "elapsed_time": events.event_elapsed_time,
    "ipc_handle": events.event_ipc_handle,
    "__repr__": events.event_repr,
}
_ACCELERATOR: dict[str, Any] = {
    "is_available": api.is_available,
    "current_accelerator": lambda check_available=False: torch.device("cuda"),
    "device_count": api.device_count,
    "current_device_index": api.current_device,
    "current_device_idx": api.current_device,
    "set_device_index": api.set_device,
    "set_device_idx": api.set_device,
    "current_stream": streams.current_stream,
}
#: where torch keeps the tensor types its optimizers and gradient clipping run ``_foreach`` kernels on
_FOREACH_TYPE_LISTS = (optimizer_module._foreach_supported_types, foreach_utils._foreach_supported_types)


def _run_backward(original: Any) -> Any:
    """autograd's entry to its C++ engine, raising the error of a hook that raised (kept while the engine unwound
    through the simulated device guard, see :mod:`simdist.cuda.pending`) where the engine returned without one."""

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        return pending.guarded(original, *args, **kwargs)

    return run_backward


def _patches() -> dict[str, Any]:
    """Every attribute the emulation replaces, with its replacement."""
    patches: dict[str, Any] = {}
    for name, fn in _FUNCTIONS.items():
        patches[f"torch.cuda.{name}"] = in_ranks(getattr(torch.cuda, name), fn)
    for name, fn in _MEMORY.items():
        for module in ("torch.cuda", "torch.cuda.memory"):
            patches[f"{module}.{name}"] = in_ranks(getattr(torch.cuda.memory, name), fn)
    for name, fn in _RANDOM.items():
        for module in ("torch.cuda", "torch.cuda.random"):
            patches[f"{module}.{name}"] = in_ranks(getattr(torch.cuda.random, name), fn)
    for name, fn in _ACCELERATOR.items():
        patches[f"torch.accelerator.{name}"] = in_ranks(getattr(torch.accelerator, name), fn)
    stream_new, event_new = torch.cuda.Stream.__new__, torch.cuda.Event.__new__
    patches["torch.cuda.Stream.__new__"] = staticmethod(in_ranks(stream_new, streams.stream_new))
    patches["torch.cuda.Event.__new__"] = staticmethod(in_ranks(event_new, events.event_new))
    patches.update({f"torch.cuda.Stream.{n}": v for n, v in _STREAM_METHODS.items()})
    patches.update({f"torch.cuda.Event.{n}": v for n, v in _EVENT_METHODS.items()})
    patches["torch.cuda.nccl.version"] = in_ranks(torch.cuda.nccl.version, lambda: api.NCCL_VERSION)
    patches["torch.cuda.nvtx._nvtx"] = NvtxRanges(torch.cuda.nvtx._nvtx)
    enter, leave = record_function_methods()
    patches["torch.autograd.profiler.record_function.__enter__"] = enter
    patches["torch.autograd.profiler.record_function.__exit__"] = leave
    patches["torch.distributed.is_nccl_available"] = in_ranks(dist.is_nccl_available, lambda: True)
    # torch's Python code asks C++ for the accelerator (fully_shard's default mesh, the default backend of a
    # device): the CPU build's answer is the CPU. A rank whose code never used CUDA keeps that answer, so a program
    # written for the CPU runs on a GPU cluster as it did before (its fully_shard stays on the host)
    original_accelerator = torch._C._get_accelerator

    def accelerator(*args: Any, **kwargs: Any) -> torch.device:
        cuda = rank_cuda()
        return torch.device("cuda") if cuda is not None and cuda.in_use else original_accelerator(*args, **kwargs)

    patches["torch._C._get_accelerator"] = in_ranks(original_accelerator, accelerator)
    patches["torch.version.cuda"] = api.CUDA_VERSION
    # activation checkpointing saves and restores the device generators only where CUDA is initialised
    patches["torch.cuda._initialized"] = True
    patches["torch.Generator"] = CudaGenerator
    patches["torch.serialization.default_restore_location"] = checkpoints.restore_location(
        torch.serialization.default_restore_location
    )
    patches["torch._utils._rebuild_tensor_v2"] = checkpoints.rebuild_tensor(torch._utils._rebuild_tensor_v2)
    patches["torch.nn.functional.scaled_dot_product_attention"] = attention.scaled_dot_product_attention
    # DTensor's random module: now, or when rank code first imports DTensor (its import costs about a second)
    dtensor = "torch.distributed.tensor._random"
    patches[f"{dtensor}._PhiloxState.__init__"] = OnImport(dtensor_random.philox_state_init)
    patches[f"{dtensor}._PhiloxState.state"] = OnImport(lambda _: dtensor_random.philox_state_whole)
    patches[f"{dtensor}.OffsetBasedRNGTracker._distribute_region"] = OnImport(dtensor_random.distribute_region)
    patches[f"{dtensor}.OffsetBasedRNGTracker.__init__"] = OnImport(dtensor_random.tracker_init)
    patches[f"{dtensor}.__class__"] = OnImport(lambda _: dtensor_random.PerRankTracker)
    patches[f"{dtensor}.manual_seed"] = OnImport(dtensor_random.manual_seed)
    patches["torch.utils.swap_tensors"] = swapping(torch.utils.swap_tensors)
    run_backward = _run_backward(torch.autograd.graph._engine_run_backward)
    patches["torch.autograd._engine_run_backward"] = run_backward
    patches["torch.autograd.graph._engine_run_backward"] = run_backward
    # DDP's reducer keeps no timer for CUDA parameters on a CPU build (it is compiled with CUDA only), and its
    # runtime-statistics logging asserts on it: nothing is logged
    logger = torch._C._distributed_c10d.Logger
    patches["torch._C._distributed_c10d.Logger.set_runtime_stats_and_log"] = in_ranks(
        logger.set_runtime_stats_and_log, lambda self: None
    )
    return patches


@contextlib.contextmanager
def _foreach_types() -> Iterator[None]:
    """Optimizers and ``clip_grad_norm_`` take their ``_foreach`` path on simulated GPU tensors, as on a GPU."""
    added = [types for types in _FOREACH_TYPE_LISTS if SimCudaTensor not in types]
    for types in added:
        types.append(SimCudaTensor)
    try:
        yield
    finally:
        for types in added:
            while SimCudaTensor in types:
                types.remove(SimCudaTensor)


def _smoke_test() -> None:
    """A backward pass over a simulated GPU tensor, in the calling thread: the last check before ranks start."""
    x = SimCudaTensor(torch.ones(3), torch.device("cuda", 0), requires_grad=True)
    with torch.autograd.set_multithreading_enabled(False):
        (x * 2.0).sum().backward()
    grad = x.grad
    if (
        type(grad) is not SimCudaTensor
        or grad.device != x.device
        or not torch.equal(grad._elem, torch.full((3,), 2.0))
    ):
        raise CudaEmulationError(
            f"simulated CUDA devices fail their self-test: a backward pass gave {type(grad).__name__} on "
            f"{getattr(grad, 'device', None)} instead of the gradient 2.0 on cuda:0"
        )


@contextlib.contextmanager
def emulated(
    ctx: RunContext | Any,
    spec: DeviceSpec,
    per_node: int,
    ranks: list[RankCuda],
    process_rank: RankCuda | None = None,
) -> Iterator[None]:
    """During the block, rank code sees ``per_node`` simulated GPUs of model ``spec``; raises
    :class:`CudaEmulationError` (having changed nothing) if they cannot be set up in this process.

    With ``process_rank`` the whole process is that rank's code (:mod:`simdist.cudart.process`), and ``ctx`` is
    the clock its events read."""
    native.install(per_node)
    try:
        with replaced(_OWNER, _patches()), _foreach_types(), _unpickler_globals():
            activate(Emulation(ctx, spec, per_node, ranks, process_rank=process_rank))
            try:
                _smoke_test()
                yield
            finally:
                activate(None)
    finally:
        native.uninstall()


@contextlib.contextmanager
def _unpickler_globals() -> Iterator[None]:
    """torch.load's weights-only unpickler resolves ``torch._utils._rebuild_tensor_v2`` through a table it builds once
    per process (an lru_cache): built before the run, it holds torch's own function and checkpoints would load onto
    the CPU; built during it, the run's. So the table is built again on entering and on leaving."""
    table = torch._weights_only_unpickler._get_allowed_globals
    table.cache_clear()
    try:
        yield
    finally:
        table.cache_clear()


@contextlib.contextmanager
def rank_thread() -> Iterator[None]:
    """What a thread of a rank with simulated GPUs runs under (thread-local settings of torch's, restored after)."""
    # torch.tensor(data, device="cuda") fills its tensor with Python dispatch excluded: made on the CPU first, it
    # reaches the rank's mode as a copy to the device
    lift = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        # autograd's engine would run CUDA gradients on its device threads, outside the baton
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        torch._C._set_only_lift_cpu_tensors(lift)


def _refuse(what: str, ctx: RunContext) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        state = current_rank_state()
        raise NoCudaError(
            f"rank {state.rank if state else '?'} used CUDA ({what}) at {ctx.call_site()}, but this run's cluster has "
            f"no GPU model (its device is {ctx.cluster.device if isinstance(ctx.cluster.device, str) else ctx.cluster.device.name!r}). "
            "Run GPU code on a cluster whose device is a GPU (a GPU preset such as simdist.Cluster.preset('dgx-h100', "
            "world_size=...), simdist.Cluster.switch(n, device='H100'), or `simdist run --cluster dgx-h100`), or write "
            "the program for the CPU"
        )

    return refuse


@contextlib.contextmanager
def refused(ctx: RunContext) -> Iterator[None]:
    """During the block, rank code that uses CUDA on a cluster without a GPU model gets :class:`NoCudaError`."""
    patches = {
        "torch.cuda._lazy_init": in_ranks(torch.cuda._lazy_init, _refuse("a tensor on 'cuda'", ctx)),
        "torch.cuda.set_device": in_ranks(torch.cuda.set_device, _refuse("torch.cuda.set_device", ctx)),
    }
    with replaced(_OWNER, patches):
        yield
