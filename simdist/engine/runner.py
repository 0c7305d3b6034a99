"""``simdist.run``: execute a torch.distributed function on every rank of a simulated cluster."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import simpy
import torch
import torch.distributed as dist

from simdist.clock.baton import Baton, current_rank_state
from simdist.comm import backend, thread_world
from simdist.comm.context import RunContext
from simdist.comm.races import Race, RaceCheckMode, checking_direct_reads
from simdist.compute.cost import ComputeCostMode
from simdist.compute.devices import DeviceSpec, get_device
from simdist.engine.process import run_context
from simdist.errors import RankError, SimdistError, SimTimeoutError
from simdist.network.cluster import Cluster
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
    cluster: Cluster | str,
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    progress: str = "nccl",
    gloo_threads: int = 2,
    races: str | None = None,
    trace: str = "messages",
    compute: bool = True,
    backend_name: str = "simdist",
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on every rank of ``cluster`` in simulated time.

    ``fn`` is ordinary torch.distributed code: the default process group (backend ``"simdist"``) is already
    initialised in each rank's thread, and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` read as under torchrun.
    ``progress`` picks the backend's progress semantics: ``"nccl"`` runs a group's collectives one after another
    on one stream per (rank, group); ``"gloo"`` runs them on ``gloo_threads`` threads per (rank, group),
    so independent async operations overlap and really interleave their reads and writes.
    ``races`` sets the in-flight buffer race detector: ``"error"`` raises :class:`RaceError` at the racing call,
    ``"warn"`` warns once per distinct race and records every finding in ``RunResult.races``, ``"off"`` checks
    nothing (fastest). The default is ``$SIMDIST_RACES`` if set, else ``"error"`` under pytest, else ``"warn"``.
    ``trace="collectives"`` skips recording individual messages (faster for thousands of ranks).
    ``compute=False`` charges no simulated time for tensor operations. ``cluster`` may also be a preset name
    or a cluster file path. ``backend_name`` is the backend name rank code sees (``"simdist"``, ``"gloo"`` or ``"nccl"``).
    Raises :class:`RankError` if a rank raised, or the diagnosis (mismatch, deadlock) that stopped the run.
    """
    if dist.is_initialized() and not backend.installed():
        raise RuntimeError(
            "simdist.run was called inside a process whose default process group is already initialised; "
            "call it from plain Python (not from a torchrun worker or another simdist rank)"
        )
    if backend.installed():
        raise RuntimeError("simdist.run cannot be nested inside another simulated run")
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"simdist.run needs a simdist.Cluster (e.g. simdist.Cluster.preset('dgx-h100', world_size=16)) or a "
            f"preset name or cluster file path; got {type(cluster).__name__}"
        )
    n = cluster.world_size
    device = cluster.device if isinstance(cluster.device, DeviceSpec) else get_device(cluster.device)
    tr = Trace(trace)
    kwargs = kwargs or {}
    initial_rng = torch.Generator().manual_seed(seed).get_state()
    env = simpy.Environment()
    baton = Baton(env, n, lambda rank: target(rank), initial_rng_state=initial_rng, stack_size=_STACK_BYTES)
    sim = RunContext(env, baton, cluster, tr, progress, gloo_threads, default_race_mode() if races is None else races)
    sim.backend_name = backend.check_backend_name(backend_name)
    store = sim.store = dist.HashStore()
    local_world = _local_world_size(cluster)

    def target(rank: int) -> Any:
        backend.init_default_group(rank, n, store)
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
            thread_world.forget_thread()

    baton.on_stall = sim.stall_report
    with run_context(sim, n, local_world), (
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


def _local_world_size(cluster: Cluster) -> int:
    per_node = getattr(cluster, "ranks_per_node", None)
    return int(per_node) if per_node else cluster.world_size


def _raise_failure(baton: Baton) -> None:
    failure = baton.failure
    if failure is None:
        return
    # A diagnosis (mismatch, deadlock, race) is raised as it is; a timeout is what torch raises in the rank
    # (rank code may catch it), so an uncaught one is that rank's failure, like any other exception.
    if isinstance(failure, SimdistError) and not isinstance(failure, SimTimeoutError):
        raise failure
    failed = [s for s in baton.ranks if s.exc is not None and s.exc is failure]
    if failed:
        state = failed[0]
        others = [s.rank for s in baton.ranks if s.exc is not None and s.traceback_text and s is not state]
        raise RankError(state.rank, failure, state.traceback_text, others) from failure
    raise failure


