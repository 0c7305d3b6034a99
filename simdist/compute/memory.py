"""Per-rank accounting of live tensor bytes over simulated time, by category, with a device capacity (bytes).

The unit is the storage: views share their base's storage and count once; a storage is live from the op that
created it until Python frees it (a weak reference's callback). Each storage carries one category, raised
(never lowered) as the run learns more about it: a parameter registered on a module, a gradient accumulated
into ``.grad``, an optimizer's state, a tensor autograd saved for backward, the output of a collective.
What is learnt later also corrects the peak's breakdown: a storage live at the peak and tagged afterwards
(a parameter allocated, then registered; Adam's state allocated inside its first step) moves to its category
there too. Meta and fake tensors count by their size, so models too large to allocate can be sized.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Parameter
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from simdist.cuda.tensor import SimCudaTensor
from simdist.errors import OutOfMemoryError
from simdist.patching import replaced
from simdist.units import format_size

#: categories in rising precedence: a storage's category only ever moves right (a saved activation that is a
#: parameter stays a parameter; a collective's output saved for backward stays a communication buffer)
CATEGORIES: tuple[str, ...] = (
    "other",
    "activations",
    "communication",
    "optimizer_state",
    "gradients",
    "parameters",
)
OTHER, ACTIVATIONS, COMMUNICATION, OPTIMIZER_STATE, GRADIENTS, PARAMETERS = range(len(CATEGORIES))

#: ops whose new outputs are communication buffers (collectives; the network model times them)
_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})

#: how many of the largest live tensors an out-of-memory error lists
_LARGEST_SHOWN = 5

#: numbers the trackers of a process: a parameter records the trackers watching it by number, not by a weak
#: reference (torch.utils.swap_tensors, how Module.to moves a parameter to a GPU, refuses weakly referenced tensors)
_SERIALS = itertools.count()


@dataclass(frozen=True)
class MemoryStats:
    """One rank's live tensor bytes over a run: the peak, when it happened, and what was live then."""

    rank: int
    #: the most bytes live at once
    peak_bytes: int
    #: simulated seconds at which ``peak_bytes`` was first reached
    peak_time: float
    #: bytes still live when the rank's function returned (its return values, module state kept alive)
    current_bytes: int
    #: category -> bytes live at the peak (sums to ``peak_bytes``); categories in :data:`CATEGORIES`
    breakdown: dict[str, int] = field(default_factory=dict)
    #: category -> bytes live at the end
    current_breakdown: dict[str, int] = field(default_factory=dict)
    #: the device's capacity in bytes (``math.inf`` when unlimited)
    capacity: float = float("inf")


class _Block:
    """One live storage: its size, category, allocation number and the shape/dtype of the tensor that created it."""

    __slots__ = ("category", "dtype", "nbytes", "number", "ref", "shape")

    def __init__(self, nbytes: int, category: int, number: int, shape: Any, dtype: Any, ref: weakref.ref) -> None:
        self.nbytes = nbytes
        self.number = number
        self.category = category
        self.shape = shape
        self.dtype = dtype
        self.ref = ref


def _storages(t: torch.Tensor, device_only: bool = False) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or its inner tensors' for a wrapper subclass such as DTensor; with
    ``device_only``, only those on a simulated GPU (reached through a :class:`SimCudaTensor`)."""
    if type(t) is SimCudaTensor:
        return [t._elem.untyped_storage()]
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out.extend(_storages(inner, device_only))
        return out
    if device_only:
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):
        return []  # sparse and other layouts without one storage: not counted


class Collections:
    """Python's cyclic garbage collector in a run that accounts memory: at points the run's own allocations fix.

    A tensor held in a reference cycle is freed when the collector finds the cycle. Left to itself, the collector
    runs after a number of Python allocations, and those include what the process does once (imports, caches
    filled by the first run), so the same run freed such tensors at other points in a fresh process than in one
    that had run before: other peaks, another memory track, another trace hash. During the run the automatic
    collector is off, and a collection runs every :attr:`every` storages the ranks allocate (every tenth of them
    two generations, every hundredth all three), as CPython's thresholds (700, 10, 10) count objects.
    """

    def __init__(self, every: int = 1000) -> None:
        self.every = every
        self._allocations = 0

    def allocated(self) -> None:
        """One storage allocated by some rank: collect where the count says so."""
        self._allocations += 1
        if self._allocations % self.every == 0:
            n = self._allocations // self.every
            gc.collect(2 if n % 100 == 0 else 1 if n % 10 == 0 else 0)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The automatic collector off during the block (on again after it if it was on)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()


class MemoryTracker:
    """Live tensor bytes of one rank, fed by its dispatch mode (:meth:`after`), autograd's saved-tensor hooks,
    and global module/optimizer hooks (see :func:`tracking_hooks`).

    ``now`` gives the rank's simulated time (seconds), ``call_site`` the user's line (for the error), and
    ``capacity`` the device's bytes. Enter it in every thread that runs the rank's code.
    """

    def __init__(
        self,
        rank: int,
        capacity: float,
        now: Callable[[], float],
        call_site: Callable[[], str] | None = None,
        device_name: str = "",
        clock: str = "simulated time",
        collections: Collections | None = None,
    ) -> None:
        self.rank = rank
        #: the run's collector, told of each storage this rank allocates
        self._collections = collections
        #: what ``now`` reads, as an out-of-memory error names it
        self._clock = clock
        self.capacity = capacity
        self._now = now
        self._call_site = call_site
        self._device_name = device_name
        self._live: dict[int, _Block] = {}
        self._totals = [0] * len(CATEGORIES)
        self.current = 0
        self.peak = 0
        self.peak_time = 0.0
        self._peak_totals: tuple[int, ...] = tuple(self._totals)
        #: (simulated seconds, bytes per category) after each change; one sample per instant (the last)
        self.samples: list[tuple[float, tuple[int, ...]]] = []
        self._last_time = 0.0
        self._closed = False
        #: allocations so far, and the number of the one that reached the peak
        self._allocs = 0
        self._peak_alloc = 0
        #: the op being accounted (named in an out-of-memory error)
        self._op: Any = None
        self._serial = next(_SERIALS)
        #: whether host (CPU) tensors count: they do until the rank's code uses a simulated GPU, whose tensors
        #: are then the only device memory (see :meth:`device_memory_only`)
        self._host_counts = True
        #: the most bytes live at once since the last :meth:`reset_peak` (``torch.cuda.max_memory_allocated``)
        self.peak_since_reset = 0
        #: bytes allocated and freed, and storages allocated and freed, since the accounting started (the
        #: cumulative figures of ``torch.cuda.memory_stats``)
        self.allocated_total = self.freed_total = self.allocations = self.frees = 0
        #: the most storages live at once since the last :meth:`reset_peak`
        self.blocks_peak = 0

    # ------------------------------------------------------------------ feeding
    def after(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> None:
        """Account one op's new storages (dispatch-mode callback; runs on every op of the rank)."""
        self._op = func
        # Inputs first: tensors made before the rank's mode (its copied arguments, tensors from NumPy) join
        # when an op first reads them.
        live = self._live
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) is Parameter:
                    self._watch_parameter(a)
                elif type(a) is torch.Tensor and id(a.untyped_storage()) in live:
                    continue
                else:
                    self.tag(a, OTHER)
        if func.namespace in _COMM_NAMESPACES:
            category = COMMUNICATION
        else:
            category = OTHER
        if isinstance(out, torch.Tensor):
            self.tag(out, category)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self.tag(o, category)

    def tag(self, t: torch.Tensor, category: int) -> None:
        """Count ``t``'s storages if new (as ``category``), resize them if they changed, and raise their category."""
        live = self._live
        kind = type(t)
        if not self._host_counts:
            storages = _storages(t, device_only=True)
        elif kind is torch.Tensor or kind is Parameter:
            storages = [t.untyped_storage()]
        else:
            storages = _storages(t)
        for st in storages:
            key = id(st)
            block = live.get(key)
            if block is None:
                nbytes = st.nbytes()
                if nbytes:
                    self._add(key, st, nbytes, category, t)
                continue
            if block.category < category:
                self._retag(block, category)
            nbytes = st.nbytes()
            if nbytes != block.nbytes:
                self._resize(block, nbytes)

    def _retag(self, block: _Block, category: int) -> None:
        self._totals[block.category] -= block.nbytes
        self._totals[category] += block.nbytes
        if block.number <= self._peak_alloc:
            # live now and allocated before the peak, so live at the peak: correct the peak's breakdown too
            peak = list(self._peak_totals)
            peak[block.category] -= block.nbytes
            peak[category] += block.nbytes
            self._peak_totals = tuple(peak)
        block.category = category

    def _add(self, key: int, st: torch.UntypedStorage, nbytes: int, category: int, t: torch.Tensor) -> None:
        if self.current + nbytes > self.capacity:
            self._raise_oom(nbytes, t)
        ref = weakref.ref(st, self._freer(key))
        self._allocs += 1
        self._live[key] = _Block(nbytes, category, self._allocs, t.shape, t.dtype, ref)
        self._totals[category] += nbytes
        self.current += nbytes
        self.allocated_total += nbytes
        self.allocations += 1
        self.blocks_peak = max(self.blocks_peak, len(self._live))
        self._changed()
        if self._collections is not None:
            self._collections.allocated()

    def _freer(self, key: int) -> Callable[[weakref.ref], None]:
        # The callback holds the tracker weakly: parameters and storages outliving the run keep no tracker alive.
        me = weakref.ref(self)

        def freed(_: weakref.ref) -> None:
            tracker = me()
            if tracker is not None:
                tracker._free(key)

        return freed

    def _free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None or self._closed:
            return
        self._totals[block.category] -= block.nbytes
        self.current -= block.nbytes
        self.freed_total += block.nbytes
        self.frees += 1
        self._changed()

    def _resize(self, block: _Block, nbytes: int) -> None:
        grow = nbytes - block.nbytes
        if grow > 0 and self.current + grow > self.capacity:
            self._raise_oom(grow, None, block)
        block.nbytes = nbytes
        self._totals[block.category] += grow
        self.current += grow
        if grow > 0:
            self.allocated_total += grow
        else:
            self.freed_total -= grow
        self._changed()

    def resized(self, st: torch.UntypedStorage) -> None:
        """A storage changed size outside dispatch (``UntypedStorage.resize_``, how FSDP frees unsharded weights)."""
        block = self._live.get(id(st))
        if block is not None and block.ref() is st:
            nbytes = st.nbytes()
            if nbytes != block.nbytes:
                self._resize(block, nbytes)

    def _changed(self) -> None:
        if self._closed:
            return
        # A free may run in another thread (the clock's, another rank's): keep this rank's samples in order.
        now = max(self._now(), self._last_time)
        self._last_time = now
        totals = tuple(self._totals)
        samples = self.samples
        if samples and samples[-1][0] == now:
            samples[-1] = (now, totals)
        else:
            samples.append((now, totals))
        if self.current > self.peak:
            self.peak = self.current
            self.peak_time = now
            self._peak_totals = totals
            self._peak_alloc = self._allocs
        self.peak_since_reset = max(self.peak_since_reset, self.current)

    def reset_peak(self) -> None:
        """Start :attr:`peak_since_reset` again from the bytes live now (``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_since_reset = self.current
        self.blocks_peak = len(self._live)

    def reserve(self, nbytes: int, func: Any = None) -> None:
        """Refuse, before op ``func`` makes it, an allocation of ``nbytes`` that would exceed the capacity."""
        if self.current + nbytes > self.capacity:
            self._op = func
            self._raise_oom(nbytes, None)

    def device_memory_only(self) -> None:
        """From now on count only tensors on a simulated GPU: the rank's code has started using one, so its CPU
        tensors are host memory. What was counted until now was host memory too: the accounting starts again."""
        if not self._host_counts:
            return
        self._host_counts = False
        self._live.clear()
        self._totals = [0] * len(CATEGORIES)
        self.current = self.peak = self.peak_since_reset = 0
        self.allocated_total = self.freed_total = self.allocations = self.frees = self.blocks_peak = 0
        self.peak_time = max(self._now(), self._last_time)
        self._peak_totals = tuple(self._totals)
        self._peak_alloc = self._allocs
        self._changed()

    # ------------------------------------------------------------------ categories from torch's hooks
    def _watch_parameter(self, p: torch.Tensor) -> None:
        """Count ``p`` as a parameter and, once per parameter, tag the gradients accumulated into it."""
        self.tag(p, PARAMETERS)
        watched = p.__dict__.setdefault("_simdist_memory_watched", set())
        if self._serial in watched:
            return
        watched.add(self._serial)
        if p.requires_grad and p.is_leaf:
            me = weakref.ref(self)

            def grad_accumulated(param: torch.Tensor) -> None:
                tracker = me()
                if tracker is not None and param.grad is not None:
                    tracker.tag(param.grad, GRADIENTS)

            p.register_post_accumulate_grad_hook(grad_accumulated)

    def _saved(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensor pack hook: a tensor autograd keeps for backward is an activation (unless it is more)."""
        if isinstance(t, torch.Tensor):
            self.tag(t, ACTIVATIONS)
        return t

    def optimizer_step(self, optimizer: torch.optim.Optimizer, starting: bool) -> None:
        """Before a step: tag gradients and parameters; after: tag the optimizer's state.

        A step allocates its state lazily (Adam's first step) next to temporaries of the same sizes: only what
        the state holds afterwards is optimizer state; the temporaries stay "other".
        """
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor):
                    if p.grad is not None:
                        self.tag(p.grad, GRADIENTS)
                    self._watch_parameter(p)
        if starting:
            return
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.tag(value, OPTIMIZER_STATE)

    # ------------------------------------------------------------------ entering, results
    @contextlib.contextmanager
    def entered(self) -> Iterator[MemoryTracker]:
        """Track the calling thread's saved tensors and hooks into this tracker while inside."""
        previous = getattr(_CURRENT, "tracker", None)
        _CURRENT.tracker = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._saved, _unpack):
                yield self
        finally:
            _CURRENT.tracker = previous

    def close(self) -> MemoryStats:
        """Stop accounting (later frees change nothing) and return the figures."""
        self._closed = True
        return MemoryStats(
            rank=self.rank,
            peak_bytes=self.peak,
            peak_time=self.peak_time,
            current_bytes=self.current,
            breakdown=dict(zip(CATEGORIES, self._peak_totals)),
            current_breakdown=dict(zip(CATEGORIES, self._totals)),
            capacity=self.capacity,
        )

    def largest(self, n: int = _LARGEST_SHOWN) -> list[tuple[int, str]]:
        """The ``n`` largest live storages as (bytes, "shape dtype, size, category"), largest first."""
        blocks = sorted(self._live.values(), key=lambda b: -b.nbytes)[:n]
        return [(b.nbytes, _describe(b)) for b in blocks]

    def _raise_oom(self, nbytes: int, t: torch.Tensor | None, block: _Block | None = None) -> None:
        now = max(self._now(), self._last_time)
        what = _describe_tensor(t) if t is not None else f"growing {_describe(block)}" if block else "a new tensor"
        op = self._op._schema.name if self._op is not None else "an op"
        site = self._call_site() if self._call_site is not None else ""
        lines = "\n".join(f"    {desc}" for _, desc in self.largest())
        device = f" ({self._device_name})" if self._device_name else ""
        raise OutOfMemoryError(
            f"simulated out of memory: tried to allocate {format_size(nbytes)} ({what}); rank {self.rank} has "
            f"{format_size(self.current)} of {format_size(self.capacity)}{device} in use, "
            f"{format_size(max(0, self.capacity - self.current))} free, at {self._clock} {now:.9g} s, in op {op}"
            + (f", called from {site}" if site else "")
            + f".\n  largest live tensors on rank {self.rank}:\n{lines}\n"
            "  Reduce the batch or sequence length, shard parameters, gradients or optimizer state (FSDP, ZeRO), "
            "checkpoint activations, or model a larger device with "
            "dataclasses.replace(device, memory_capacity=BYTES).",
            rank=self.rank,
            sim_time=now,
            op=op,
            requested=nbytes,
            in_use=self.current,
            capacity=self.capacity,
        )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _describe_tensor(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _describe(b: _Block) -> str:
    dtype = str(b.dtype).removeprefix("torch.")
    return f"shape {tuple(b.shape)} {dtype}, {format_size(b.nbytes)}, {CATEGORIES[b.category]}"


# ---------------------------------------------------------------------- process-wide hooks, one run at a time
_CURRENT = threading.local()


def _tracker() -> MemoryTracker | None:
    return getattr(_CURRENT, "tracker", None)


def current_tracker() -> MemoryTracker | None:
    """The tracker the calling thread's rank accounts into, or None (no run with ``memory=True``, or no rank)."""
    return getattr(_CURRENT, "tracker", None)


def _parameter_registered(module: torch.nn.Module, name: str, param: Any) -> None:
    tracker = _tracker()
    if tracker is not None and isinstance(param, torch.Tensor):
        tracker._watch_parameter(param)


def _step_starting(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    tracker = _tracker()
    if tracker is not None:
        tracker.optimizer_step(optimizer, starting=True)


def _step_done(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    tracker = _tracker()
    if tracker is not None:
        tracker.optimizer_step(optimizer, starting=False)


@contextlib.contextmanager
def tracking_hooks() -> Iterator[None]:
    """Install the process-wide hooks that feed the calling thread's tracker: parameter registration, optimizer
    steps, and ``UntypedStorage.resize_`` (which dispatch does not see)."""
    original_resize = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> Any:
        result = original_resize(st, size)
        tracker = _tracker()
        if tracker is not None:
            tracker.resized(st)
        return result

    handles = [
        register_module_parameter_registration_hook(_parameter_registered),
        register_optimizer_step_pre_hook(_step_starting),
        register_optimizer_step_post_hook(_step_done),
    ]
    try:
        with replaced("simdist.compute.memory", {"torch.UntypedStorage.resize_": resize_}):
            yield
    finally:
        for h in handles:
            h.remove()
