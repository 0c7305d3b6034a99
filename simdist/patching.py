"""Everything simdist changes in the process, declared in one inventory and changed through one function.

A simulated run makes a process look like one of many: rank threads need their own ``os.environ``, their
own generators, a ``time.sleep`` that waits in simulated time, torch.distributed's world per thread. The
equivalence oracle and memory accounting hook into torch too. Each such change is a :class:`Patch` in
:data:`INVENTORY`, made only through :func:`replaced` (which refuses an undeclared one) by the module the
inventory names, for the duration of a ``with`` block, and undone when the block ends however it ends.
Process-wide hook registrations (:data:`HOOKS`) and process settings (:data:`SETTINGS`) are listed beside
them. :func:`process_state` reads all of it, for the test that a run leaves the process as it found it, and
:func:`markdown` writes the inventory table of ``docs/simulator.md``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.optim.optimizer as optimizer_module
import torch.utils._foreach_utils as foreach_utils

from simdist.cuda import native
from simdist.errors import SimdistError


def _bound_to(module: Any, instance: object) -> tuple[str, ...]:
    """Names of ``module``'s attributes that are methods bound to ``instance`` (its module-level functions)."""
    return tuple(sorted(n for n, v in vars(module).items() if getattr(v, "__self__", None) is instance and callable(v)))


#: ``random``'s module-level functions: methods of its hidden instance ``random._inst``
PYTHON_RANDOM_FUNCTIONS = _bound_to(random, random._inst)  # type: ignore[attr-defined]
#: ``numpy.random``'s legacy functions: methods of ``numpy.random.mtrand._rand`` (``seed`` is a plain function)
NUMPY_RANDOM_FUNCTIONS = _bound_to(np.random, np.random.mtrand._rand)

#: torch.cuda's device, property and stream functions a run that emulates CUDA answers in rank code
CUDA_DEVICE_FUNCTIONS = (
    "init", "is_available", "is_initialized", "device_count", "current_device", "_exchange_device",
    "_maybe_exchange_device", "get_device_name", "get_device_capability", "get_device_properties",
    "is_bf16_supported", "is_tf32_supported", "is_current_stream_capturing", "current_stream", "default_stream",
    "_set_stream_by_id",
)
#: torch.cuda.memory's functions the others (memory_allocated, max_memory_allocated, ...) are answered through
CUDA_MEMORY_FUNCTIONS = ("memory_stats", "reset_peak_memory_stats", "reset_accumulated_memory_stats", "mem_get_info", "empty_cache")
#: torch.cuda.random's functions
CUDA_RANDOM_FUNCTIONS = (
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all",
)
#: torch.accelerator's functions
ACCELERATOR_FUNCTIONS = (
    "is_available", "current_accelerator", "device_count", "current_device_index", "current_device_idx",
    "set_device_index", "set_device_idx", "current_stream",
)

#: Tensor methods that copy values to the host without passing through torch's dispatcher (``.item()`` does):
#: a GPU host waits for its device there, and the race detector counts them as reads
HOST_READS = ("tolist", "numpy", "__repr__", "__array__")

#: ``time``'s clocks that rank code reads in simulated time (its rank's host time plus a base taken at the start)
RANK_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns")
#: ``time``'s calendar functions that, given no time, read the system clock in C: in rank code they take the rank's
RANK_CALENDAR = ("localtime", "gmtime", "ctime", "asctime", "strftime")


@dataclass(frozen=True)
class Patch:
    """Attributes ``names`` of the object at ``path``, replaced by module ``owner`` for the reason ``why``."""

    path: str
    names: tuple[str, ...]
    owner: str
    why: str
    #: some of ``names`` may not exist before the patch (methods a CPU build's stand-in class lacks): the patch
    #: adds them, and removing them again restores the class
    adds: bool = False

    def targets(self) -> list[str]:
        """The dotted path of every attribute this patch replaces."""
        return [f"{self.path}.{n}" for n in self.names]


#: who changes the settings every run changes
_RUN = "simdist.engine.process, simdist.c10d.backend"

INVENTORY: tuple[Patch, ...] = (
    Patch("os", ("environ",), "simdist.engine.process",
          "each rank reads torchrun's variables (RANK, LOCAL_RANK, ...) with its own values; its writes stay its own"),
    Patch("os", ("_exit",), "simdist.engine.process", "os._exit in rank code ends that rank, not the process"),
    Patch("signal", ("signal", "getsignal"), "simdist.engine.process",
          "rank code runs in a thread, where Python refuses handlers: one handler table per rank"),
    Patch("time", ("sleep",), "simdist.engine.process", "a rank sleeps in simulated time and lets the others run"),
    Patch("time", RANK_CLOCKS, "simdist.engine.process",
          "a rank's clocks read its simulated host time, so what it times takes simulated seconds"),
    Patch("time", RANK_CALENDAR, "simdist.engine.process",
          "given no time, they take the rank's time.time(): a run's file names and log lines are the same every run"),
    Patch("os", ("getpid",), "simdist.engine.process",
          "each rank has a process id of its own, and none of a live process"),
    Patch("tqdm.std.tqdm", ("monitor_interval",), "simdist.engine.process",
          "0 during a run: tqdm's monitor thread waits in wall-clock time and would keep a rank's turn (the watchdog "
          "stopped every run whose rank code made a progress bar); bars still draw, without the monitor's checks"),
    Patch("sys", ("argv",), "simdist.engine.process", "each rank reads and changes its own command line (argv=)"),
    Patch("sys", ("stdout", "stderr"), "simdist.engine.process",
          "each line a rank writes starts with [rankN]:, or is left out by local rank (prefix_output, local_ranks_filter)"),
    Patch("torch", ("manual_seed",), "simdist.engine.process",
          "seeds the CPU generator only: torch's also queues CUDA seeding at a millisecond per call"),
    Patch("torch.random", ("manual_seed",), "simdist.engine.process", "as torch.manual_seed"),
    Patch("torch.cuda", ("synchronize",), "simdist.engine.process", "waits for the rank's simulated device"),
    Patch("torch._C", ("_set_fp32_precision_setter", "_set_float32_matmul_precision", "_set_cublas_allow_tf32",
                       "_set_cudnn_allow_tf32", "_set_onednn_allow_tf32"), "simdist.engine.process",
          "a rank's TF32 and matmul precision switches are its own (the run notes which rank set one)"),
    Patch("torch", ("compile",), "simdist.engine.process",
          "regions rank code compiles price their elementwise chains as one fused kernel each"),
    Patch("torch.backends.ContextProp", ("__set__",), "simdist.engine.process",
          "as torch._C's precision setters, which cuDNN's and oneDNN's switches hold through it"),
    Patch("torch.cuda", ("synchronize",), "simdist.cudart.process",
          "in a process emulating CUDA by itself: the CPU kernels have run, nothing to wait for"),
    Patch("torch.Tensor", HOST_READS, "simdist.engine.process",
          "reading values to the host waits for the simulated device and is checked by the race detector"),
    Patch("threading.Thread", ("start",), "simdist.cudart.process",
          "in a process emulating CUDA by itself: threads it starts run on its simulated devices too"),
    Patch("threading.Thread", ("__init__", "start", "join"), "simdist.engine.threads",
          "threads rank code starts act as their rank and take the baton; join waits in simulated time"),
    Patch("random", PYTHON_RANDOM_FUNCTIONS, "simdist.engine.rng", "each rank draws from its own Python generator"),
    Patch("random.Random", ("seed",), "simdist.engine.rng", "an argument-less seed() takes the run's seed stream"),
    Patch("numpy.random", NUMPY_RANDOM_FUNCTIONS, "simdist.engine.rng", "each rank draws from its own NumPy generator"),
    Patch("numpy.random", ("seed", "default_rng"), "simdist.engine.rng",
          "the rank's generator; an argument-less seed takes the run's seed stream"),
    Patch("torch", ("seed",), "simdist.engine.rng", "torch.seed() takes the run's seed stream, not the OS's"),
    Patch("torch.random", ("seed",), "simdist.engine.rng", "as torch.seed"),
    Patch("torch.distributed.distributed_c10d", ("_world",), "simdist.c10d.backend",
          "torch.distributed's world (default group, group maps) per rank thread"),
    Patch("torch.distributed.distributed_c10d", ("_backend", "_default_pg_init_method"), "simdist.c10d.backend",
          "torch's own init_process_group in rank code sets them: the process's values come back after the run"),
    Patch("torch.distributed.distributed_c10d", ("init_process_group",), "simdist.c10d.backend",
          "rank code's own init_process_group is checked as a real launch checks it, and finds its group made"),
    Patch("torch.distributed", ("init_process_group",), "simdist.c10d.backend", "as c10d.init_process_group"),
    Patch("torch.distributed.distributed_c10d", ("_new_process_group_helper",), "simdist.c10d.backend",
          "new_group(backend='gloo' or 'nccl') makes a simulated group presenting that name"),
    Patch("torch.distributed.distributed_c10d", ("rendezvous",), "simdist.c10d.backend",
          "torch's own init_process_group in rank code meets the launch's values, checked, and contacts nothing"),
    Patch("torch.distributed.distributed_c10d", ("monitored_barrier",), "simdist.c10d.backend",
          "monitored_barrier on a group presented as 'simdist'"),
    Patch("torch.distributed", ("monitored_barrier",), "simdist.c10d.backend", "as c10d.monitored_barrier"),
    Patch("torch.distributed.distributed_c10d", ("default_pg_nccl_timeout",), "simdist.c10d.backend",
          "CPU builds have none, and warn at every group named 'nccl'"),
    Patch("torch.futures", ("wait_all", "collect_all"), "simdist.c10d.backend",
          "waiting on simulated futures in simulated time (torch waits in C++)"),
    Patch("torch.cuda", ("_lazy_init", "set_device"), "simdist.cudart.install",
          "CUDA answered from the rank's simulated GPUs (on a cluster without one: a clear error naming the line)"),
    Patch("torch.cuda", CUDA_DEVICE_FUNCTIONS, "simdist.cudart.install",
          "devices, properties and streams answered from the rank's simulated GPUs"),
    Patch("torch.cuda", CUDA_MEMORY_FUNCTIONS, "simdist.cudart.install", "the rank's device memory as the run accounts it"),
    Patch("torch.cuda.memory", CUDA_MEMORY_FUNCTIONS, "simdist.cudart.install", "as torch.cuda's"),
    Patch("torch.cuda", CUDA_RANDOM_FUNCTIONS, "simdist.cudart.install", "one generator per (rank, simulated GPU)"),
    Patch("torch.cuda.random", CUDA_RANDOM_FUNCTIONS, "simdist.cudart.install", "as torch.cuda's"),
    Patch("torch.accelerator", ACCELERATOR_FUNCTIONS, "simdist.cudart.install", "the simulated GPUs are torch's accelerator"),
    Patch("torch._C", ("_get_accelerator",), "simdist.cudart.install",
          "fully_shard's default mesh and a device's default backend ask C++, which answers the CPU on a CPU build"),
    Patch("torch.cuda.Stream", ("__new__", "__init__", "device", "wait_event", "wait_stream", "record_event", "query",
                                "synchronize", "is_capturing", "__eq__", "__hash__", "__repr__"), "simdist.cudart.install",
          "side streams of the simulated device, in simulated time", adds=True),
    Patch("torch.cuda.Event", ("__new__", "__init__", "record", "query", "synchronize", "wait", "elapsed_time",
                               "ipc_handle", "__repr__"), "simdist.cudart.install", "events in simulated time", adds=True),
    Patch("torch.cuda.nccl", ("version",), "simdist.cudart.install", "a run presenting NCCL has one"),
    Patch("torch.cuda.nvtx", ("_nvtx",), "simdist.cudart.install", "NVTX ranges in rank code become spans of the trace"),
    Patch("torch.autograd.profiler.record_function", ("__enter__", "__exit__"), "simdist.cudart.install",
          "ranges rank code opens with torch.profiler.record_function become spans of the trace, as NVTX ranges do"),
    Patch("torch.distributed", ("is_nccl_available",), "simdist.cudart.install", "a run presenting NCCL has one"),
    Patch("torch.version", ("cuda",), "simdist.cudart.install",
          "CUDA code checks it (DDP's bf16 compression hook): a module attribute, so every thread sees it"),
    Patch("torch.cuda", ("_initialized",), "simdist.cudart.install",
          "activation checkpointing saves the GPU generators' states only where it is set: a module attribute, so "
          "every thread sees it"),
    Patch("torch", ("Generator",), "simdist.cudart.install", "torch.Generator(device='cuda') in rank code"),
    Patch("torch.serialization", ("default_restore_location",), "simdist.cudart.install",
          "torch.load of storages bound for CUDA: they stay on the host, marked with their simulated GPU"),
    Patch("torch._utils", ("_rebuild_tensor_v2",), "simdist.cudart.install",
          "torch.load rebuilds the tensors of those storages on their simulated GPU"),
    Patch("torch.nn.functional", ("scaled_dot_product_attention",), "simdist.cudart.install",
          "attention on simulated GPUs takes the CPU's fused kernel where the CPU program does (torch picks by "
          "device in C++)"),
    Patch("torch.distributed.tensor._random._PhiloxState", ("__init__", "state"), "simdist.cudart.install",
          "DTensor's random ops read CUDA's Philox seed and offset from the first 16 bytes of a simulated GPU "
          "generator's state, which goes on with the CPU generator's"),
    Patch("torch.distributed.tensor._random.OffsetBasedRNGTracker", ("_distribute_region", "__init__"),
          "simdist.cudart.install",
          "inside DTensor's RNG region a simulated GPU's generator draws counter-based numbers at the offset set; "
          "making the tracker compares CUDA's 16 bytes of the generator's state with rank 0's, as on a GPU"),
    Patch("torch.distributed.tensor._random", ("__class__", "manual_seed"), "simdist.cudart.install",
          "DTensor's RNG tracker, a module global (one per process), is each rank's own"),
    Patch("torch.utils", ("swap_tensors",), "simdist.cudart.install",
          "Module.to moves a parameter onto a simulated GPU by a swap where a GPU sets its data: the parameter "
          "keeps its attributes and hooks, as on a GPU"),
    Patch("torch.autograd", ("_engine_run_backward",), "simdist.cudart.install",
          "a hook that raises in a backward pass over simulated GPU tensors raises its own error (C++ unwinds "
          "through the simulated device guard, which keeps the error aside)"),
    Patch("torch.autograd.graph", ("_engine_run_backward",), "simdist.cudart.install", "as torch.autograd's"),
    Patch("torch._C._distributed_c10d.Logger", ("set_runtime_stats_and_log",), "simdist.cudart.install",
          "a CPU build's DDP keeps no timer for CUDA parameters, and its statistics logging asserts on one"),
    Patch("torch.UntypedStorage", ("resize_",), "simdist.compute.memory",
          "storage resizes (FSDP's) change live bytes without an op the dispatcher sees"),
    Patch("torch.autograd", ("backward", "grad"), "simdist.oracle.capture",
          "the equivalence oracle records each step's loss roots"),
    Patch("torch.distributed.pipelining.stage.PipelineStage", ("_prepare_forward_infra", "_prepare_backward_infra"),
          "simdist.oracle.record", "localisation does not record torch pipelining's shape inference"),
    Patch("torch.distributed.pipelining.stage._PipelineStage", ("_prepare_forward_infra", "_prepare_backward_infra"),
          "simdist.oracle.record", "as PipelineStage's"),
)

#: process-wide hook registries simdist adds to while it runs (each removed by its owner afterwards)
HOOKS: Mapping[str, tuple[str, ...]] = {
    "torch.nn.modules.module._global_forward_pre_hooks": ("simdist.oracle.capture", "simdist.oracle.record"),
    "torch.nn.modules.module._global_forward_hooks": ("simdist.oracle.record",),
    "torch.nn.modules.module._global_module_parameter_registration_hooks": ("simdist.compute.memory",),
    "torch.optim.optimizer._global_optimizer_pre_hooks": ("simdist.compute.memory", "simdist.oracle.record"),
    "torch.optim.optimizer._global_optimizer_post_hooks": (
        "simdist.compute.memory", "simdist.oracle.capture", "simdist.oracle.record",
    ),
}

#: process settings a run changes and restores: what, (the modules that change it, why)
SETTINGS: Mapping[str, tuple[str, str]] = {
    "torch.get_num_threads()": (
        f"{_RUN}, simdist.clock.baton",
        "1 during a run, set again in each thread of rank code (MKL keeps its count per thread): rank threads "
        + "run one at a time",
    ),
    "os.sched_getaffinity(0)": (_RUN, "pinned where allowed to the one CPU the run starts on: a baton hand-off is several times cheaper"),
    "gc.get_threshold(), gc.get_freeze_count()": (_RUN, "young objects collected less often among thousands of rank threads"),
    "gc.isenabled()": (
        "simdist.compute.memory",
        "off with memory=True: the run collects where its allocations say, freeing cycles alike in every run",
    ),
    "torch.get_default_dtype()": (_RUN, "kept per rank, as per process"),
    "torch.get_rng_state()": (_RUN, "kept per rank, as per process"),
    "torch's float32 precision (TF32, set_float32_matmul_precision)": (_RUN, "kept per rank, as per process"),
    "sys.excepthook": (_RUN, "restored after rank threads' unhandled exceptions"),
    "sys.meta_path": (
        "simdist.patching",
        (
            "a finder while a run waits for rank code to import a module it patches (DTensor's random module, not "
            "imported up front: about a second of CPU); it patches the module as it loads"
        ),
    ),
    "sys.modules['__main__']": (
        "simdist.engine.rank_process",
        "a rank running a script as torchrun runs it has a __main__ module of its own",
    ),
    "torch.autograd.is_multithreading_enabled()": (_RUN, "off: autograd's device threads would run outside the baton"),
    "C++ process-group registry": (_RUN, "thread isolation mode on: group names resolve per rank thread"),
    "torch.library: _c10d_functional CPU kernels": (_RUN, "wait_tensor and all_gather_into_tensor_out wait in simulated time"),
    "torch.distributed.Backend: the 'simdist' backend": (_RUN, "registered for a run's groups, unregistered after it"),
    "c10's CUDA device guard, torch's CUDA hooks (native)": (
        "simdist.cuda.native",
        "on a GPU cluster: a simulated GPU's device guard, and CUDA as torch's accelerator",
    ),
    "torch's _foreach tensor types (optimizers, clip_grad_norm_)": (
        "simdist.cudart.install",
        "on a GPU cluster: simulated GPU tensors take the _foreach path",
    ),
    "torch._C._only_lift_cpu_tensors() in rank threads": (
        "simdist.cudart.install",
        "on in each rank thread of a GPU cluster: torch.tensor(data, device='cuda') is made on the CPU and copied",
    ),
    "torch.autograd multithreading in rank threads": (
        "simdist.cudart.install",
        "off in each rank thread of a GPU cluster: autograd's device threads would run outside the baton",
    ),
}

#: the modules that may replace each target (a target two modules replace, never at once, lists both)
_OWNERS: dict[str, frozenset[str]] = {}
for _patch in INVENTORY:
    for _target in _patch.targets():
        _OWNERS[_target] = _OWNERS.get(_target, frozenset()) | {_patch.owner}
_MISSING = object()


def _resolve(path: str) -> Any | None:
    """The module or class at dotted ``path``, or None if its module is not imported (nothing to patch there)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None and i == 1:
            module = importlib.import_module(parts[0])
        if module is not None:
            obj: Any = module
            for name in parts[i:]:
                obj = getattr(obj, name, None)
                if obj is None:
                    return None
            return obj
    return None


@dataclass(frozen=True)
class OnImport:
    """A replacement made from the target's own value (``make(original)``), set when the block starts if the
    target's module is imported, or else the moment the program imports it during the block.

    For targets in modules that cost much to import (DTensor's pulls in sympy, about a second of CPU): importing
    them up front would charge every process that imports simdist, rank processes of real launches included.
    """

    make: Callable[[Any], Any]


@contextlib.contextmanager
def replaced(owner: str, values: Mapping[str, Any]) -> Iterator[None]:
    """Set each dotted target of ``values`` (declared in :data:`INVENTORY` for ``owner``) during the block.

    A plain value is set if its module is imported (otherwise the program cannot reach it); an :class:`OnImport`
    value also when its module is imported during the block. Whatever ends the block, each target gets back
    what it had: the same object, or no attribute of its own (a class attribute that was inherited is deleted
    again), in the reverse order of setting.
    """
    done: list[tuple[Any, str, Any]] = []
    waiting: dict[str, OnImport] = {}
    try:
        for target, value in values.items():
            if owner not in _OWNERS.get(target, ()):
                raise SimdistError(
                    f"{owner} replaces {target}, which simdist.patching.INVENTORY does not list for it: declare every "
                    "process-wide change there"
                )
            if not _set(target, value, done) and isinstance(value, OnImport):
                waiting[target] = value
        with _set_on_import(waiting, done) if waiting else contextlib.nullcontext():
            yield
    finally:
        for obj, name, previous in reversed(done):
            if previous is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)


def _set(target: str, value: Any, done: list[tuple[Any, str, Any]]) -> bool:
    """Set ``target`` to ``value`` (noting in ``done`` what it had); False if its module is not imported."""
    path, _, name = target.rpartition(".")
    obj = _resolve(path)
    if obj is None:
        return False
    previous = vars(obj).get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)
    setattr(obj, name, value.make(getattr(obj, name, None)) if isinstance(value, OnImport) else value)
    done.append((obj, name, previous))
    return True


@contextlib.contextmanager
def _set_on_import(waiting: dict[str, OnImport], done: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """During the block, set each waiting target as soon as an import makes it reachable."""
    lock = threading.RLock()  # making a replacement may import a watched module again

    def imported() -> None:
        with lock:
            for target in [t for t in waiting if _set(t, waiting[t], done)]:
                del waiting[target]

    watcher = _ImportWatcher({p for t in waiting for p in _prefixes(t)}, imported)
    sys.meta_path.insert(0, watcher)
    try:
        yield
    finally:
        sys.meta_path.remove(watcher)


def _prefixes(target: str) -> list[str]:
    """Every dotted prefix of ``target``'s path: any of them may be the module that holds it."""
    parts = target.split(".")[:-1]
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: has the next finder find a watched module and calls ``then()`` once it has run."""

    def __init__(self, names: set[str], then: Callable[[], None]) -> None:
        self.names = names
        self.then = then

    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the next finder gives a watched module, its loader followed by ``then()``."""
        if name not in self.names:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self.then)
                return spec
        return None


class _ThenLoader(importlib.abc.Loader):
    """``loader``, followed by ``then()`` once the module has run; the module keeps ``loader`` as its own."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        """The wrapped loader's module."""
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Run the module with the wrapped loader as its own, then ``then()``."""
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then()


def current(target: str) -> Any:
    """What the declared ``target`` holds now (its own attribute, for a class), or a sentinel if nothing."""
    path, _, name = target.rpartition(".")
    obj = _resolve(path)
    if obj is None:
        return _MISSING
    return vars(obj).get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)


def process_state() -> dict[str, Any]:
    """Everything in the inventory as it is now: each patched attribute, each hook registry's keys, each setting.

    Equal before and after a run (``==``; attributes compare by identity) when the run restored the process.
    """
    state: dict[str, Any] = {t: _Identity(current(t)) for t in _OWNERS}
    for path in HOOKS:
        registry = _resolve(path)
        state[path] = tuple(registry.keys()) if registry is not None else None
    state["os.environ contents"] = dict(os.environ)
    state["torch.get_num_threads()"] = torch.get_num_threads()
    state["os.sched_getaffinity(0)"] = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    state["gc"] = (gc.get_threshold(), gc.get_freeze_count(), gc.isenabled())
    state["torch.get_default_dtype()"] = torch.get_default_dtype()
    state["torch.get_rng_state()"] = bytes(torch.get_rng_state().numpy())
    state["torch's float32 precision"] = tuple(
        torch._C._get_fp32_precision_getter(*pair)
        for pair in (("generic", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("mkldnn", "matmul"))
    )
    state["random.getstate()"] = random.getstate()
    state["numpy.random.get_state()"] = bytes(np.random.get_state()[1].tobytes())
    state["sys.excepthook"] = _Identity(sys.excepthook)
    state["sys.meta_path"] = tuple(map(_Identity, sys.meta_path))
    state["sys.modules['__main__']"] = _Identity(sys.modules.get("__main__"))
    state["threading.excepthook"] = _Identity(threading.excepthook)
    state["torch.autograd.is_multithreading_enabled()"] = torch.autograd.is_multithreading_enabled()
    state["torch.distributed.Backend"] = (tuple(dist.Backend.backend_list), tuple(dist.Backend._plugins))
    state["torch.distributed.is_initialized()"] = dist.is_initialized()
    state["simulated CUDA (native)"] = native.state()
    state["torch._C._only_lift_cpu_tensors()"] = torch._C._only_lift_cpu_tensors()
    state["torch's _foreach tensor types"] = (
        tuple(optimizer_module._foreach_supported_types),
        tuple(foreach_utils._foreach_supported_types),
    )
    state["threads"] = tuple(sorted(t.name for t in threading.enumerate() if not t.daemon))
    return state


class _Identity:
    """Compares equal to another holding the very same object."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{getattr(self.obj, '__qualname__', type(self.obj).__name__)} at {id(self.obj):#x}>"


def markdown() -> str:
    """The inventory as the Markdown table of ``docs/simulator.md``."""
    rows = ["| what | changed by | why |", "|---|---|---|"]
    for p in INVENTORY:
        names = p.names if len(p.names) <= 4 else (*p.names[:3], f"... ({len(p.names)} functions)")
        what = ", ".join(f"`{p.path}.{n}`" if not n.startswith("...") else n for n in names)
        rows.append(f"| {what} | `{p.owner}` | {p.why} |")
    for path, owners in HOOKS.items():
        rows.append(f"| `{path}` (hooks added) | {', '.join(f'`{o}`' for o in owners)} | removed by the last user |")
    for what, (owners, why) in SETTINGS.items():
        rows.append(f"| {what} | {', '.join(f'`{o}`' for o in owners.split(', '))} | {why} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
