"""Process-wide state a simulated run changes, all restored afterwards.

Environment variables as torchrun sets them (a per-rank view of ``os.environ``), what else a rank reads of its own
process (its clock, process id and, when the run gives one, command line: :mod:`simdist.engine.rank_process`;
its ``sys.stdout`` and ``sys.stderr`` when they are prefixed or filtered: :mod:`simdist.engine.rank_output`),
torch's thread count,
global RNG, default dtype and float32 precision switches (TF32), CPU pinning, garbage-collector settings, CPU-only seeding, the ``"simdist"`` backend's
installation in torch.distributed, and the process-wide calls rank code may make as if it were a process of
its own: ``os._exit`` (ends the rank, not the simulator's process), ``signal.signal`` (a handler per rank) and
``time.sleep`` (the rank waits in simulated time, handing the others the baton), ``torch.cuda.synchronize`` and
the tensor methods that read values to the host without torch's dispatcher (``tolist``, ``numpy``, printing: the
rank's host waits for its simulated device).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from simdist.c10d import backend
from simdist.clock.baton import current_rank_state
from simdist.comm.context import RunContext
from simdist.comm.races import direct_read
from simdist.cudart import state as cuda_state
from simdist.cudart.api import seed_devices
from simdist.engine.compiled import fusing_compile
from simdist.engine.precision import RankPrecision
from simdist.engine.rank_output import RankStream
from simdist.engine.rank_process import RankArgv, rank_calendar, rank_clocks, rank_getpid, rank_mains
from simdist.errors import RankExit
from simdist.patching import HOST_READS, OnImport, replaced

#: the patches of simdist.patching.INVENTORY this module makes
_OWNER = "simdist.engine.process"


class RankProcesses:
    """What a run's ranks share of the process and is settled as each rank ends: their prefixed output."""

    def __init__(self, streams: list[RankStream]) -> None:
        self._streams = streams

    def end_rank(self, rank: int) -> None:
        """``rank``'s program ended: write what it left unfinished on its streams, as a process's exit does."""
        for stream in self._streams:
            stream.end_rank(rank)

    def end(self) -> None:
        """The run is over: write what any rank (or a thread of one) left unfinished."""
        for stream in self._streams:
            stream.end()


@contextlib.contextmanager
def run_context(ctx: RunContext, n: int, local_world: int) -> Iterator[RankProcesses]:
    """Process-wide state a run changes, all restored afterwards (see :mod:`simdist.patching`)."""
    rng = torch.get_rng_state()
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    hook = sys.excepthook
    gc_threshold = gc.get_threshold()
    affinity = _pin_to_one_cpu()
    torch.set_num_threads(1)
    # Thousands of live rank threads, groups and tensors make every full collection slow; freezing what
    # exists and collecting the young generation less often keeps collection off the hot path.
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)
    rank_signal, rank_getsignal = _rank_signals()
    patches: dict[str, Any] = {
        "os.environ": RankEnviron(os.environ, n, local_world),
        # torch.manual_seed also queues a lazy CUDA/XPU/MTIA seeding with a formatted stack trace per call (about a
        # millisecond on a CPU-only build): seed the CPU generator and the rank's simulated GPUs directly.
        "torch.manual_seed": _seed_cpu_only,
        "torch.random.manual_seed": _seed_cpu_only,
        "os._exit": _rank_exit,
        "signal.signal": rank_signal,
        "signal.getsignal": rank_getsignal,
        "time.sleep": _rank_sleep(ctx),
        "torch.cuda.synchronize": _rank_cuda_synchronize(ctx),
        "os.getpid": rank_getpid(),
    }
    clocks = rank_clocks(ctx.now)
    patches.update({f"time.{name}": clock for name, clock in clocks.items()})
    patches.update({f"time.{name}": fn for name, fn in rank_calendar(clocks["time"]).items()})
    # TF32 and matmul precision switches per rank: the cost model and the CPU's oneDNN matmuls read them
    precision = RankPrecision()
    ctx.baton.per_rank.append(precision)
    patches.update(precision.setters())
    patches["torch.compile"] = fusing_compile(torch.compile)
    # set now if tqdm is imported, else the moment rank code imports it
    patches["tqdm.std.tqdm.monitor_interval"] = OnImport(lambda _: 0)
    if ctx.time.host_runs_ahead or ctx.races.enabled:
        patches.update({f"torch.Tensor.{name}": _host_read(ctx, name) for name in HOST_READS})
    options = ctx.options
    if options.argv is not None:
        # each rank's own list is put in place as its thread takes the baton; the process's comes back at the end
        ctx.baton.per_rank.append(RankArgv(options.argv))
        patches["sys.argv"] = sys.argv
    streams: list[RankStream] = []
    if options.prefix_output or options.local_ranks_filter is not None:
        shown = options.local_ranks_filter
        streams = [
            RankStream(stream, options.prefix_output, lambda r: shown is None or r % local_world in shown)
            for stream in (sys.stdout, sys.stderr)
        ]
        patches.update({"sys.stdout": streams[0], "sys.stderr": streams[1]})
    processes = RankProcesses(streams)
    try:
        with replaced(_OWNER, patches), backend.running(ctx), rank_mains() as mains:
            ctx.baton.per_rank.append(mains)
            try:
                yield processes
            finally:
                processes.end()
    finally:
        gc.unfreeze()
        gc.set_threshold(*gc_threshold)
        precision.restore()
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        sys.excepthook = hook
        if affinity is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, affinity)


_real_exit = os._exit


def _rank_exit(code: int) -> None:
    """``os._exit`` during a run: in rank code it ends that rank (reported), never the whole process."""
    if current_rank_state() is None:
        _real_exit(code)
    raise RankExit(code)


def _rank_sleep(ctx: RunContext) -> Any:
    """``time.sleep`` that, in rank code, waits ``seconds`` of simulated time instead of holding every rank.

    A heartbeat or progress thread (``while True: time.sleep(1); ...``) then runs once per simulated second
    and a rank that sleeps lets the others run, as on real hardware.
    """
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        state = current_rank_state()
        if state is None:
            return real_sleep(seconds)
        seconds = float(seconds)
        if not seconds >= 0:  # NaN included
            raise ValueError("sleep length must be non-negative")
        ctx.settle()
        ctx.baton.sleep(seconds, f"rank {state.rank} in time.sleep({seconds:g})")
        return None

    return sleep


def _rank_cuda_synchronize(ctx: RunContext) -> Any:
    """``torch.cuda.synchronize`` that, in rank code, waits until the rank's simulated device is idle.

    Rank code written for GPUs synchronises before reading a clock; its simulated tensors live on the CPU,
    where torch's own call would fail on a CPU-only build or wait for an unrelated GPU.
    """
    real_sync = torch.cuda.synchronize

    def synchronize(device: Any = None) -> None:
        if current_rank_state() is None:
            return real_sync(device)
        ctx.synchronize()
        return None

    return synchronize


def _host_read(ctx: RunContext, name: str) -> Any:
    """Tensor method ``name`` as rank code calls it during a run: a read the race detector checks, then (on a
    GPU host, which runs ahead of its device) a wait until the device is idle, then the read itself."""
    method = getattr(torch.Tensor, name)
    races, ahead = ctx.races if ctx.races.enabled else None, ctx.time.host_runs_ahead

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if current_rank_state() is None:
            return method(self, *args, **kwargs)

        def value() -> Any:
            if ahead and not _on_host(self):
                ctx.synchronize()
            return method(self, *args, **kwargs)

        return direct_read(races, ctx.call_site, name, self, value) if races is not None else value()

    read.__name__, read.__qualname__, read.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return read


def _rank_signals() -> tuple[Any, Any]:
    """``signal.signal`` and ``signal.getsignal`` that keep one handler table per rank in rank code.

    In a real launch each rank's code runs in its process's main thread and may install handlers; here it runs in
    a rank thread, where Python refuses. Handlers are recorded per rank (no signal is simulated) and what the
    previous handler was is answered as in a process of its own.
    """
    real_signal, real_getsignal = signal.signal, signal.getsignal
    tables: dict[int, dict[int, Any]] = {}

    def rank_signal(signum: int, handler: Any) -> Any:
        state = current_rank_state()
        if state is None:
            return real_signal(signum, handler)
        if not callable(handler) and handler not in (signal.SIG_DFL, signal.SIG_IGN):
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
        signum = signal.Signals(signum)  # ValueError for an unknown signal, as signal.signal
        table = tables.setdefault(state.rank, {})
        previous = table.get(signum, real_getsignal(signum))
        table[signum] = handler
        return previous

    def rank_getsignal(signum: int) -> Any:
        state = current_rank_state()
        if state is None:
            return real_getsignal(signum)
        return tables.get(state.rank, {}).get(signal.Signals(signum), real_getsignal(signum))

    return rank_signal, rank_getsignal


def _seed_cpu_only(seed: int) -> torch.Generator:
    """``torch.manual_seed`` in rank code: the CPU generator, and the rank's simulated GPUs' where it has them."""
    generator = torch.default_generator.manual_seed(int(seed))
    seed_devices(int(seed))
    return generator


def _on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is host memory of a rank that uses its simulated GPU: reading it waits for nothing."""
    rank = cuda_state.rank()
    return rank is not None and rank.in_use


class RankEnviron(MutableMapping):
    """``os.environ`` as each rank thread sees it: torchrun's variables with that rank's values (those torchrun
    sets for a process of its own, less the paths of its agent's error files and store).

    A rank's writes and deletions stay in that rank's view (as they would in its own process) and never reach
    the real environment; code outside rank threads reads and writes the real environment. Swapping the
    mapping costs nothing per baton hand-off, where setting real variables at every hand-off would. Child
    processes started without an explicit ``env=`` inherit the real environment (pass ``env=os.environ.copy()``).
    """

    _DELETED = object()

    def __init__(self, real: MutableMapping[str, str], world_size: int, local_world: int) -> None:
        self._real = real
        self._fixed = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_WORLD_SIZE": str(-(-world_size // local_world)),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "simdist",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
        }
        self._local_world = local_world
        self._overrides: dict[int, dict[str, object]] = {}

    def _view(self) -> tuple[dict[str, object], int] | None:
        state = current_rank_state()
        if state is None:
            return None
        r = state.rank
        over = self._overrides.get(r)
        if over is None:
            over = self._overrides[r] = {
                **self._fixed,
                "RANK": str(r),
                "ROLE_RANK": str(r),
                "LOCAL_RANK": str(r % self._local_world),
                "GROUP_RANK": str(r // self._local_world),
            }
        return over, r

    def __getitem__(self, key: str) -> str:
        view = self._view()
        if view is not None and key in view[0]:
            value = view[0][key]
            if value is self._DELETED:
                raise KeyError(key)
            return value  # type: ignore[return-value]
        return self._real[key]

    def __setitem__(self, key: str, value: str) -> None:
        view = self._view()
        if view is None:
            self._real[key] = value
        else:
            view[0][key] = str(value)

    def __delitem__(self, key: str) -> None:
        view = self._view()
        if view is None:
            del self._real[key]
            return
        self[key]  # KeyError if this rank does not see it
        view[0][key] = self._DELETED

    def __iter__(self) -> Iterator[str]:
        view = self._view()
        if view is None:
            return iter(self._real)
        over = view[0]
        keys = dict.fromkeys([*self._real, *over])
        return iter([k for k in keys if over.get(k) is not self._DELETED])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def copy(self) -> dict[str, str]:
        """A plain dict of what this rank sees (``os.environ.copy()`` for subprocess environments)."""
        return dict(self.items())

    def __or__(self, other: Any) -> dict[str, str]:
        return {**self.copy(), **other}

    def __ror__(self, other: Any) -> dict[str, str]:
        return {**other, **self.copy()}


def _pin_to_one_cpu() -> set[int] | None:
    """Pin the process to one CPU: baton hand-offs between threads are ~4x cheaper on one core."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {_cpu_to_pin(before)})
        return before
    except OSError:
        return None


def _cpu_to_pin(allowed: set[int]) -> int:
    """The CPU the calling thread runs on now, where the OS says and allows it; else the lowest allowed.

    The scheduler has placed the thread on a CPU that other busy processes leave it; a fixed choice (the
    lowest) would stack every simulating process of the machine (test workers, scenario scripts, parallel
    explorations) on one core while the others idle.
    """
    cpu = _current_cpu()
    return cpu if cpu in allowed else min(allowed)


def _current_cpu() -> int | None:
    """The CPU the calling thread last ran on (Linux's ``/proc``), or None where the OS does not say."""
    try:
        with open("/proc/thread-self/stat", encoding="ascii") as stat:
            # fields after the command name (which may hold spaces) start at the state, field 3; CPU is field 39
            return int(stat.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None
