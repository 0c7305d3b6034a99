"""``simdist.run``: execute a torch.distributed function on every rank of a simulated cluster."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from simdist.comm.races import Race, RaceCheckMode, checking_direct_reads
from simdist.compute.cost import ComputeCostMode
from simdist.compute.devices import DeviceSpec, get_device
from simdist.engine import world
from simdist.engine.baton import Baton, current_rank_state
from simdist.engine.sim import Simulation
from simdist.errors import RankError, SimdistError
from simdist.trace.trace import Trace

#: rank threads run the user's code, torch's autograd and NumPy; 16 MiB covers deep recursion in them
_STACK_BYTES = 16 * 1024 * 1024


@dataclass
class RunResult:
    """What a simulated run produced."""

    #: each rank's return value, indexed by global rank
    returns: list[Any]
    #: simulated seconds until the last rank finished
    sim_time: float
    #: per-rank simulated finish times (seconds)
    finish_times: list[float]
    trace: Trace
    #: messages the network carried
    messages: int
    world_size: int
    #: every in-flight buffer race the detector found (empty with ``races="off"``), in the order found
    races: list[Race] = dataclasses.field(default_factory=list)

    def race_summary(self) -> str:
        """One paragraph per distinct race (same kind and call sites), naming every rank it happened on."""
        groups: dict[tuple, list[Race]] = {}
        for r in self.races:
            groups.setdefault(r.key(), []).append(r)
        out = []
        for found in groups.values():
            ranks = sorted({r.rank for r in found})
            out.append(f"{found[0]}\n  on ranks {_ranges(ranks)} ({len(found)} findings)")
        return "\n\n".join(out) if out else "no races found"

    @functools.cached_property
    def trace_hash(self) -> str:
        """SHA-256 of the trace: identical for identical (program, cluster, seed, options)."""
        return self.trace.hash()


def run(
    fn: Callable[..., Any],
    cluster: Any,
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    progress: str = "nccl",
    gloo_threads: int = 2,
    races: str | None = None,
    trace: str = "messages",
    compute: bool = True,
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on every rank of ``cluster`` in simulated time.

    ``fn`` is ordinary torch.distributed code: the default process group (backend ``"simdist"``) is already
    initialised in each rank's thread, and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` read as under torchrun.
    ``progress`` picks the backend's progress semantics: ``"nccl"`` runs a group's collectives one after another
    on one stream per (rank, group); ``"gloo"`` runs them on ``gloo_threads`` worker threads per (rank, group),
    so independent async operations overlap and really interleave their reads and writes.
    ``races`` sets the in-flight buffer race detector: ``"error"`` raises :class:`RaceError` at the racing call,
    ``"warn"`` warns once per distinct race and records every finding in ``RunResult.races``, ``"off"`` checks
    nothing (fastest). The default is ``$SIMDIST_RACES`` if set, else ``"error"`` under pytest, else ``"warn"``.
    ``trace="collectives"`` skips recording individual messages (faster for thousands of ranks).
    ``compute=False`` charges no simulated time for tensor operations. ``cluster`` may also be a preset name
    or a cluster file path.
    Raises :class:`RankError` if a rank raised, or the diagnosis (mismatch, deadlock) that stopped the run.
    """
    if dist.is_initialized() and not world.installed():
        raise RuntimeError(
            "simdist.run was called inside a process whose default process group is already initialised; "
            "call it from plain Python (not from a torchrun worker or another simdist rank)"
        )
    if world.installed():
        raise RuntimeError("simdist.run cannot be nested inside another simulated run")
    if isinstance(cluster, str):
        from simdist.network.presets import load_cluster

        cluster = load_cluster(cluster)
    if not hasattr(cluster, "world_size") or not hasattr(cluster, "route"):
        raise TypeError(
            f"simdist.run needs a simdist.Cluster (e.g. simdist.Cluster.preset('dgx-h100', world_size=16)) or a "
            f"preset name or cluster file path; got {type(cluster).__name__}"
        )
    n = cluster.world_size
    device = cluster.device if isinstance(cluster.device, DeviceSpec) else get_device(cluster.device)
    tr = Trace(trace)
    sim = Simulation(cluster, n, seed, progress, tr, device, gloo_threads, default_race_mode() if races is None else races)
    kwargs = kwargs or {}
    gen = torch.Generator().manual_seed(seed)
    initial_rng = gen.get_state()
    store = sim.store = dist.HashStore()
    local_world = _local_world_size(cluster)

    def target(rank: int) -> Any:
        world.init_default_group(rank, n, store)
        try:
            races = RaceCheckMode(sim.races, rank, sim.call_site) if sim.races.enabled else None
            if compute and not device.is_zero_cost:  # one dispatch mode per rank: the race check rides on it
                mode = ComputeCostMode(device, sim.charge, before=races.check if races is not None else None)
            else:
                mode = races
            with mode if mode is not None else contextlib.nullcontext():
                result = fn(*args, **kwargs)
            sim.settle()
            return result
        finally:
            state = current_rank_state()
            state.finish_time = sim.env.now + state.pending
            world.forget_thread_world()

    baton = Baton(sim.env, n, target, initial_rng_state=initial_rng, stack_size=_STACK_BYTES)
    sim.baton = baton
    baton.on_stall = sim.stall_report
    with _run_context(sim, baton, n, local_world), (
        checking_direct_reads(sim.races, sim.call_site) if sim.races.enabled else contextlib.nullcontext()
    ):
        baton.run()
    _raise_failure(baton)
    finish = [s.finish_time for s in baton.ranks]
    return RunResult(
        returns=[s.result for s in baton.ranks],
        sim_time=max(finish, default=0.0),
        finish_times=finish,
        trace=tr,
        messages=sim.network.messages,
        world_size=n,
        races=sim.races.races,
    )


def default_race_mode() -> str:
    """``$SIMDIST_RACES`` if set, else ``"error"`` inside a pytest test, else ``"warn"``."""
    mode = os.environ.get("SIMDIST_RACES")
    if mode:
        return mode
    return "error" if "PYTEST_CURRENT_TEST" in os.environ else "warn"


def _ranges(ranks: list[int]) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]``."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def _local_world_size(cluster: Any) -> int:
    per_node = getattr(cluster, "ranks_per_node", None)
    return int(per_node) if per_node else cluster.world_size


def _raise_failure(baton: Baton) -> None:
    failure = baton.failure
    if failure is None:
        return
    if isinstance(failure, SimdistError):
        raise failure
    failed = [s for s in baton.ranks if s.exc is not None and s.exc is failure]
    if failed:
        state = failed[0]
        others = [s.rank for s in baton.ranks if s.exc is not None and s.traceback_text and s is not state]
        raise RankError(state.rank, failure, state.traceback_text, others) from failure
    raise failure


@contextlib.contextmanager
def _run_context(sim: Simulation, baton: Baton, n: int, local_world: int) -> Iterator[None]:
    """Process-wide state a run changes, all restored afterwards."""
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    hook = sys.excepthook
    gc_threshold = gc.get_threshold()
    affinity = _pin_to_one_cpu()
    torch.set_num_threads(1)
    real_environ = os.environ
    os.environ = RankEnviron(real_environ, n, local_world)  # type: ignore[assignment]  # noqa: B003
    # Thousands of live rank threads, groups and tensors make every full collection slow; freezing what
    # exists and collecting the young generation less often keeps collection off the hot path.
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)
    # Simulated ranks hold CPU tensors only. torch.manual_seed also queues a lazy CUDA/XPU/MTIA seeding with
    # a formatted stack trace per call (about a millisecond on a CPU-only build): seed the CPU generator only.
    seed_fns = (torch.manual_seed, torch.random.manual_seed)
    torch.manual_seed = torch.random.manual_seed = _seed_cpu_only
    world.install(sim)
    try:
        yield
    finally:
        world.uninstall()
        torch.manual_seed, torch.random.manual_seed = seed_fns
        os.environ = real_environ  # noqa: B003
        gc.unfreeze()
        gc.set_threshold(*gc_threshold)
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
        sys.excepthook = hook
        if affinity is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, affinity)


def _seed_cpu_only(seed: int) -> torch.Generator:
    """``torch.manual_seed`` for CPU-only simulated ranks."""
    return torch.default_generator.manual_seed(int(seed))


class RankEnviron(MutableMapping):
    """``os.environ`` as each rank thread sees it: torchrun's variables with that rank's values.

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
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
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
        os.sched_setaffinity(0, {min(before)})
        return before
    except OSError:
        return None
