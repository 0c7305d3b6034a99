"""``simdist.run``: execute a torch.distributed function on every rank of a simulated cluster."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import simpy
import torch.distributed as dist

from simdist.c10d import backend
from simdist.clock.baton import Baton, RankState, current_rank_state
from simdist.clock.perturbation import Perturbation
from simdist.clock.schedule import PerturbedEnvironment, TieChooser
from simdist.comm import symmetry, thread_world
from simdist.comm.context import RunContext
from simdist.comm.crashes import Crashes
from simdist.comm.races import Race, RaceCheckMode
from simdist.comm.thread_world import acting_as
from simdist.compute.cost import ComputeCostMode
from simdist.compute.devices import CPU, DeviceSpec, get_device
from simdist.compute.memory import CATEGORIES, Collections, MemoryStats, MemoryTracker, tracking_hooks
from simdist.compute.profile import Profile, ProfileReplay, ReplayStats
from simdist.cuda.meta_outputs import for_run as meta_outputs_for
from simdist.cuda.rank import RankCuda
from simdist.cuda.returns import to_host
from simdist.cudart.hazards import kernel_tracker
from simdist.cudart.install import emulated, rank_thread, refused
from simdist.cudart.state import device_work
from simdist.engine.process import run_context
from simdist.engine.rng import RankGenerators, derive_seed, per_rank_generators
from simdist.engine.threads import rank_threads
from simdist.errors import (
    RAISED_AS_TORCH,
    RaceWarning,
    RankError,
    RunArgumentError,
    SimdistError,
    SymmetryWarning,
    safe_str,
)
from simdist.faults.plan import check_world, counted_crashes, straggling, timed_crashes
from simdist.network.cluster import Cluster
from simdist.network.faulty import LinkFaults
from simdist.options import RunOptions
from simdist.ranks import ranges
from simdist.trace.trace import Trace
from simdist.uninitialised import FillMode

#: rank threads run the user's code, torch's autograd and NumPy; 16 MiB covers deep recursion in them
_STACK_BYTES = 16 * 1024 * 1024

#: one run at a time per process: torch.distributed's world and the "simdist" backend are process-wide
_RUN_LOCK = threading.Lock()

#: writes a run's HTML report to a path and returns it; installed by ``simdist.report``, a later layer that
#: imports this one (``import simdist`` always installs it)
_report_writer: Callable[..., Path] | None = None


def install_report_writer(writer: Callable[..., Path]) -> None:
    """Make ``writer(result, path, **options)`` what :meth:`RunResult.save_report` calls (options: ``real=``)."""
    global _report_writer
    _report_writer = writer


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
    #: per-rank live tensor bytes (peak, its time, breakdown by category), indexed by global rank; empty
    #: unless the run was made with ``memory=True``
    memory: list[MemoryStats] = dataclasses.field(default_factory=list)
    #: the findings ``race_waivers`` named (each with ``waived_by``), in the order found; not in ``races``
    waived_races: list[Race] = dataclasses.field(default_factory=list)
    #: the ``race_waivers`` that named no finding (each also warned as a :class:`RaceWarning`)
    unused_waivers: list[str] = dataclasses.field(default_factory=list)
    #: the cluster the run was made on, its seed and the qualified name of the function every rank ran
    cluster: Cluster | None = None
    seed: int | None = None
    program: str = ""
    #: (global rank, group name, sequence number) -> the call site of that rank's collective, as the trace's
    #: collective spans name them ("Process Group Name", "Seq"); not part of the trace or its hash
    call_sites: dict[tuple[int, str, int], str] = dataclasses.field(default_factory=dict)
    #: (global rank, span name, start, end) -> the call site of that rank's send or receive, as its "p2p" span
    #: in the trace has them; not part of the trace or its hash
    p2p_sites: dict[tuple[int, str, float, float], str] = dataclasses.field(default_factory=dict)
    #: with ``compute=simdist.profile(PATH)``: how many ops the profile timed, how many the model priced
    #: (which, and their share of compute time), summed over ranks; None otherwise
    profile: ReplayStats | None = None
    #: under torchrun's restarts (``run_script(..., max_restarts=N)``): how many times the job was restarted
    #: before this, its last attempt, and each failed attempt's error text, in order
    restarts: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    #: the ranks a ``symmetric=True`` run simulated (the others' returns are :class:`NotSimulated`, their finish
    #: times and memory their representative's); None when every rank ran
    simulated_ranks: list[int] | None = None

    def save_report(self, path: str | Path, *, real: Any = None) -> Path:
        """Write this run's self-contained HTML report (timeline, collectives, breakdown, memory, races) to ``path``.

        ``real`` (a real run's ``RealResult.timeline``, or the directory ``real`` recorded it to) adds that run's
        operations to the timeline and a table of predicted against measured time."""
        if _report_writer is None:
            raise SimdistError("no report writer is installed: import simdist (or simdist.report) before saving a report")
        if real is None:
            return _report_writer(self, Path(path))
        return _report_writer(self, Path(path), real=real)

    def race_summary(self) -> str:
        """One paragraph per distinct race (same kind and call sites), naming every rank it happened on."""
        groups: dict[tuple, list[Race]] = {}
        for r in self.races:
            groups.setdefault(r.key(), []).append(r)
        out = []
        for found in groups.values():
            ranks = sorted({r.rank for r in found})
            out.append(f"{found[0]}\n  on ranks {ranges(ranks)} ({len(found)} findings)")
        text = "\n\n".join(out) if out else "no races found"
        if self.waived_races:
            waivers = list(dict.fromkeys(t for r in self.waived_races for t in r.waived_by))
            text += f"\n({len(self.waived_races)} findings waived by race_waivers {waivers}; see RunResult.waived_races)"
        return text

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
    race_waivers: Sequence[str] | None = None,
    trace: str = "messages",
    compute: bool | Profile = True,
    copy_args: bool = True,
    watchdog: float | None = None,
    backend_name: str = "simdist",
    memory: bool = False,
    argv: Sequence[str] | None = None,
    default_group: bool = True,
    prefix_output: bool = False,
    local_ranks_filter: Sequence[int] | None = None,
    perturbation: Perturbation | None = None,
    faults: Sequence[Any] | None = None,
    symmetric: bool = False,
    tensors: str = "real",
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on every rank of ``cluster`` in simulated time.

    ``fn`` is ordinary torch.distributed code: the default process group (backend ``"simdist"``) is already
    initialised in each rank's thread (``default_group=False``: rank code initialises it, as under torchrun), and
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` read as under torchrun.
    ``progress`` picks the backend's progress semantics: ``"nccl"`` runs a group's collectives one after another
    on one stream per (rank, group); ``"gloo"`` runs them on ``gloo_threads`` threads per (rank, group),
    so independent async operations overlap and really interleave their reads and writes.
    ``races`` sets the in-flight buffer race detector: ``"error"`` raises :class:`RaceError` at the racing call,
    ``"warn"`` warns once per distinct race and records every finding in ``RunResult.races``, ``"off"`` checks
    nothing (fastest). The default is ``$SIMDIST_RACES`` if set, else ``"error"`` under pytest, else ``"warn"``.
    ``race_waivers`` lists known races by call site, ``"PATH[:LINE][:FUNCTION]"`` (e.g.
    ``"torch/distributed/pipelining/schedules.py:_warmup_p2p"``): a finding whose every side a waiver names
    neither raises nor warns and goes to ``RunResult.waived_races``; a waiver that names no finding of a run
    that completed is reported with a :class:`RaceWarning`.
    ``trace="collectives"`` skips recording individual messages (faster for thousands of ranks).
    ``compute=False`` charges no simulated time for tensor operations; ``compute=simdist.profile(PATH)``
    charges the durations a torch profiler trace of the program measured, matched by op, input shapes and
    occurrence, and the model's for ops it does not hold (``RunResult.profile`` counts them). ``cluster`` may
    also be a preset name or a cluster file path. ``backend_name`` is the backend name rank code sees
    (``"simdist"``, ``"gloo"`` or ``"nccl"``); it changes nothing else.
    ``memory=True`` accounts each rank's live tensor bytes (``RunResult.memory``, a "memory" counter track in
    the trace) and raises :class:`OutOfMemoryError` when a rank exceeds its device's ``memory_capacity``.
    ``args`` and ``kwargs`` are deep-copied for each rank, as each process of a real launch receives its own
    copy; ``copy_args=False`` hands every rank the same objects (for large read-only inputs).
    ``watchdog`` is the wall-clock seconds a rank may run without communicating or waiting before the run
    stops with :class:`WatchdogError` (default ``$SIMDIST_WATCHDOG``, else 60 under pytest, else 600;
    ``math.inf`` turns it off). ``argv`` is what ``sys.argv`` reads in rank code, each rank its own list (default:
    the process's). ``prefix_output=True`` starts each line rank code writes to ``sys.stdout``/``sys.stderr``
    with ``[rankN]:``, and ``local_ranks_filter`` shows only the output of those local ranks (as torchrun's options; an empty list, none).
    ``perturbation`` (a :class:`simdist.Perturbation`) draws the choices a run leaves open: the order of events
    due at the same simulated time, latency and compute jitter, ``then()`` callback order (see
    ``docs/explore.md``); None runs exactly the unperturbed run.
    ``faults`` lists what goes wrong during the run (``simdist.faults``: crashed ranks, stragglers, slow, flapping
    and failed links, delayed messages, lost nodes); a rank that crashed makes the run raise
    :class:`RankCrashError`. ``symmetric=True`` declares that every rank runs the same program on same-shaped
    data: a few sampled ranks run (``RunResult.simulated_ranks``), each seeing the whole world, and every
    collective takes the closed-form time of the whole group's schedule, its results written as if each rank
    not simulated held what the group's first simulated member holds; the other ranks' timelines are theirs
    (see ``docs/symmetry.md`` for when that is sound; :class:`SymmetryError` when the sampled ranks ran
    differently).
    ``tensors="fake"`` makes the run timing-only (GPU clusters): tensors on the simulated
    GPUs hold shapes and dtypes but no values, collectives are timed without moving data, ``memory=True`` accounts
    them by size, the race detector is off, and reading a value raises :class:`NoValuesError` (``docs/fake.md``).
    Runs from several Python threads execute one after another.
    Raises :class:`RankError` if a rank raised, or the diagnosis (mismatch, deadlock) that stopped the run.
    """
    state = current_rank_state()
    if state is not None:
        raise SimdistError(_nested_run_message(state))
    _check_arguments(fn, args, kwargs)
    options = RunOptions.from_keywords(
        seed=seed,
        progress=progress,
        gloo_threads=gloo_threads,
        races=races,
        race_waivers=race_waivers,
        trace=trace,
        compute=compute,
        copy_args=copy_args,
        watchdog=watchdog,
        backend_name=backend_name,
        memory=memory,
        argv=argv,
        default_group=default_group,
        prefix_output=prefix_output,
        local_ranks_filter=local_ranks_filter,
        faults=faults,
        symmetric=symmetric,
        tensors=tensors,
    ).resolved()
    if perturbation is not None and not isinstance(perturbation, Perturbation):
        raise RunArgumentError(
            f"perturbation must be a simdist.Perturbation (or None), got {type(perturbation).__name__} {perturbation!r:.60}"
        )
    with _RUN_LOCK:
        return _run(fn, cluster, args, kwargs or {}, options, perturbation)


@dataclass
class Observed:
    """What a perturbed run leaves besides its result, filled in even when the run raises (exploration reads it)."""

    #: the run's trace so far
    trace: Trace | None = None
    #: the option taken at each decision (a tie between several agents' events)
    decisions: list[int] = dataclasses.field(default_factory=list)
    #: the agents seen at decisions
    agents: int = 0
    #: each decision's simulated time (seconds) and its tied agents in insertion order
    ties: list[tuple[float, tuple[int, ...]]] = dataclasses.field(default_factory=list)


def run_observed(
    fn: Callable[..., Any],
    cluster: Cluster | str,
    options: RunOptions,
    perturbation: Perturbation,
    observed: Observed,
    chooser: TieChooser | None = None,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
) -> RunResult:
    """:func:`run` with validated ``options`` under ``perturbation``, its ties broken by ``chooser`` (default: the
    one ``perturbation.ties`` names), recording into ``observed``."""
    state = current_rank_state()
    if state is not None:
        raise SimdistError(_nested_run_message(state))
    _check_arguments(fn, args, kwargs)
    with _RUN_LOCK:
        return _run(fn, cluster, args, kwargs or {}, options.resolved(), perturbation, observed, chooser)


def _nested_run_message(state: RankState) -> str:
    """What a rank's call of :func:`run` is told: who called it, where, and what to do instead."""
    who = f"rank {state.rank}"
    if state.parent is not None and state.thread is not None:
        who += f" (its thread {state.thread.name!r})"
    ctx = backend.active()
    site = ctx.call_site() if ctx is not None else "<unknown>"
    return (
        f"{who} called simdist.run at {site}, inside a simulated run: runs cannot be nested (a rank is one "
        "process of the simulated job, and a Python process runs one simulation at a time); call simdist.run "
        "from plain Python outside rank code, one run after the other, or, to simulate a program as part of "
        "this run, call its function from the rank code instead"
    )


def _run(
    fn: Callable[..., Any],
    cluster: Cluster | str,
    args: tuple,
    kwargs: dict[str, Any],
    options: RunOptions,
    perturbation: Perturbation | None = None,
    observed: Observed | None = None,
    chooser: TieChooser | None = None,
) -> RunResult:
    """:func:`run` once the run lock is held."""
    if dist.is_initialized() and not backend.installed():
        raise RuntimeError(
            "simdist.run was called inside a process whose default process group is already initialised; "
            "call it from plain Python (not from a torchrun worker or another simdist rank)"
        )
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"simdist.run needs a simdist.Cluster (e.g. simdist.Cluster.preset('dgx-h100', world_size=16)) or a "
            f"preset name or cluster file path; got {type(cluster).__name__}"
        )
    n = cluster.world_size
    simulated: tuple[int, ...] | None = None
    if options.symmetric:
        symmetry.check_run(cluster, options, perturbation is not None)
        simulated = symmetry.sampled_ranks(n, cluster.ranks_per_node)
    running = range(n) if simulated is None else simulated
    device = cluster.device if isinstance(cluster.device, DeviceSpec) else get_device(cluster.device)
    if options.tensors == "fake" and not device.is_gpu:
        raise RunArgumentError(
            f'tensors="fake" times programs written for GPUs, and cluster {cluster.name!r} has no GPU model (its '
            f"device is {device.name!r}): run on a GPU cluster (e.g. simdist.Cluster.preset('dgx-h100', "
            "world_size=64)) with the program's tensors on \"cuda\""
        )
    if options.tensors == "fake":
        # some meta kernels (torch._decomp's addmm) import torch._dynamo on their first call: seconds of imports in
        # the middle of a rank's op, after which that rank's tensors were freed later than in any later run (its
        # peak memory and trace hash differed); imported before the run, every run is the same
        importlib.import_module("torch._dynamo")
    replay: ProfileReplay | None = (
        options.compute.replay(device) if isinstance(options.compute, Profile) else None
    )
    tr = Trace(options.trace)
    generators = RankGenerators(options.seed)
    env = simpy.Environment() if perturbation is None else PerturbedEnvironment(perturbation, chooser)
    if observed is not None:
        observed.trace = tr
        if isinstance(env, PerturbedEnvironment):  # filled as the run goes, so a run that raises keeps them too
            observed.decisions = env.decisions
            observed.ties = env.ties
    baton = Baton(
        env,
        n,
        lambda rank: target(rank),
        initial_rng_state=generators.torch_state,
        stack_size=_STACK_BYTES,
        watchdog=options.watchdog,
        simulated=simulated,
    )
    # GPU hosts run ahead of their devices under NCCL-like progress; CPU processes (a zero-cost device, or no
    # cost model) and gloo-like progress stay host-synchronous
    sim = RunContext(
        env,
        baton,
        cluster,
        tr,
        options,
        host_runs_ahead=options.compute and not device.is_zero_cost,
        simulated=None if simulated is None else frozenset(simulated),
    )
    store = sim.store
    local_world = _local_world_size(cluster)
    collections = Collections()
    trackers = (
        {
            r: MemoryTracker(
                r, device.memory_capacity, sim.time.device_now, sim.call_site, device.name, collections=collections
            )
            for r in running
        }
        if options.memory
        else {}
    )

    gpu = device.is_gpu
    sim.emulates_cuda = gpu
    # a symmetric run makes the simulated GPUs of its running ranks only: at 100,000 ranks the rest would cost seconds
    cuda: list[RankCuda | None] = [None] * n if gpu else []
    # what one rank's op on meta tensors returned, every rank's same op on the same shapes returns: one table
    meta_outputs = meta_outputs_for(options.tensors == "fake")
    for r in running if gpu else ():
        cuda[r] = RankCuda(
            r,
            functools.partial(_device_seed, options.seed, r),
            sim.synchronize_stream,
            trackers[r].device_memory_only if options.memory else None,
            device.host_link_bandwidth,
            device.launch_overhead,
            kernel_tracker(sim) if sim.races.enabled else None,
        )
        cuda[r].fake = options.tensors == "fake"
        cuda[r].meta_outputs = meta_outputs
        cuda[r].on_device = device_work

    # each rank counts its own occurrences of each op, as each process of a job would run the profiled step
    providers = [replay.provider() if replay is not None else None for _ in range(n)]

    def rank_mode(rank: int) -> Any:
        """The dispatch mode a thread of ``rank`` runs under: compute costs, with the race check and the memory
        accounting riding on it (one Python mode per op is what costs), and on a GPU cluster the simulated GPU's
        tensors unwrapped in it too."""
        races = RaceCheckMode(sim.races, rank, sim.call_site) if sim.races.enabled else None
        if gpu:
            tracker = trackers[rank] if options.memory else None
            mode = ComputeCostMode(
                device if options.compute else CPU,
                sim.charge,
                launch=sim.launch,
                launched=sim.charge,
                before=races.check if races is not None else None,
                after=tracker.after if tracker is not None else None,
                cuda=cuda[rank],
                reserve=tracker.reserve if tracker is not None else None,
                provider=providers[rank],
            )
            if tracker is not None:
                return _entered(tracker.entered(), rank_thread(), mode)
            return _entered(rank_thread(), mode)
        if options.memory:
            mode = ComputeCostMode(
                device if options.compute else CPU,
                sim.charge,
                launch=sim.launch,
                launched=sim.charge,
                before=races.check if races is not None else None,
                after=trackers[rank].after,
                provider=providers[rank],
            )
            return _entered(trackers[rank].entered(), mode)
        if replay is not None or (options.compute and not device.is_zero_cost):
            return ComputeCostMode(
                device,
                sim.charge,
                before=races.check if races is not None else None,
                launch=sim.launch,
                launched=sim.charge,
                provider=providers[rank],
            )
        return races if races is not None else FillMode()

    def target(rank: int) -> Any:
        if options.default_group:
            backend.init_default_group(rank, n, store)
        try:
            a, kw = _copy_for_rank(args, kwargs, rank) if options.copy_args else (args, kwargs)
            with rank_mode(rank):
                result = fn(*a, **kw)
            sim.synchronize()
            sim.settle()  # the rank ends when its host reaches its device's end: a crash before then lands
            return result
        finally:
            state = current_rank_state()
            state.finish_time = sim.time.finish_time(state)
            # A thread left behind stuck in C code gets here only after the run, when torch's group registry
            # is the process's own again: leave it alone.
            if not baton.is_abandoned(state):
                thread_world.forget_thread()
                shared.end_rank(rank)  # bound below, before any rank runs

    def in_rank(rank: int, body: Callable[[], Any]) -> Callable[[], Any]:
        def run_as_rank() -> Any:
            try:
                with acting_as(rank), rank_mode(rank):
                    result = body()
                sim.settle()
                return result
            finally:
                state = current_rank_state()
                state.finish_time = sim.time.finish_time(state)

        return run_as_rank

    crashes = _apply_faults(sim, cluster, options)
    baton.on_stall = sim.stall_report
    with run_context(sim, n, local_world) as shared, per_rank_generators(generators), rank_threads(baton, in_rank), (
        tracking_hooks() if options.memory else contextlib.nullcontext()
    ), collections.running() if options.memory else contextlib.nullcontext(), emulated(sim, device, local_world, cuda) if gpu else refused(sim):
        baton.run()
    closed = {r: t.close() for r, t in trackers.items()}
    if observed is not None and isinstance(env, PerturbedEnvironment):
        observed.decisions = env.decisions
        observed.agents = len(env.agents)
    if crashes is not None and crashes.dead:
        try:
            _raise_failure(baton)
        except SimdistError as failure:
            raise crashes.error(failure.__cause__ if isinstance(failure, RankError) else failure) from failure
        raise crashes.error(None)
    _raise_failure(baton)
    for t in trackers.values():
        for time, totals in t.samples:
            tr.counter(t.rank, "memory", time, dict(zip(CATEGORIES, totals)))
    if sim.symmetric_overlap is not None:
        warnings.warn(
            SymmetryWarning(
                f"symmetric=True: {sim.symmetric_overlap}. In the full run they share links, which slows both; a "
                "symmetric run times each as if alone, so its times are a lower bound (docs/symmetry.md); run one "
                "collective at a time (progress='nccl' on one group) for exact times"
            ),
            stacklevel=3,
        )
    unused = sim.races.unused_waivers()
    for text in unused:
        warnings.warn(
            RaceWarning(
                f"race waiver {text!r} named no race in this run: nothing it names raced, or its path, line or "
                "function differ from the sites the findings show; remove it or correct it"
            ),
            stacklevel=3,
        )
    # a rank, like a process, ends when its last non-daemon thread does
    finish_of = {r: max(s.finish_time for s in baton.process_threads(r)) for r in running}
    returns = {r: to_host(baton.ranks[r].result) if gpu else baton.ranks[r].result for r in running}
    if simulated is not None:
        symmetry.check_alike(tr, simulated)
    first = running[0]
    return RunResult(
        returns=[returns[r] if r in returns else symmetry.NotSimulated(r, first) for r in range(n)],
        sim_time=max(finish_of.values(), default=0.0),
        finish_times=[finish_of.get(r, finish_of[first]) for r in range(n)],
        trace=tr,
        messages=sim.network.messages,
        world_size=n,
        races=sim.races.races,
        memory=[closed.get(r, closed[first]) for r in range(n)] if closed else [],
        waived_races=sim.races.waived,
        unused_waivers=unused,
        cluster=cluster,
        seed=options.seed,
        program=getattr(fn, "__qualname__", type(fn).__name__),
        call_sites=sim.call_sites,
        p2p_sites=sim.p2p_sites,
        profile=replay.stats if replay is not None else None,
        simulated_ranks=None if simulated is None else list(simulated),
    )


def _apply_faults(sim: RunContext, cluster: Cluster, options: RunOptions) -> Crashes | None:
    """Put the run's faults in place (checked against ``cluster`` first): stragglers on the ranks' compute, link
    faults on the network, crashes on the clock. Returns the crashes (None: no rank crashes)."""
    faults = options.faults
    if not faults:
        return None
    check_world(faults, cluster.world_size, cluster.ranks_per_node, cluster.name)
    sim.time.slowdown = straggling(faults)
    sim.network.faults = LinkFaults(cluster, faults)
    if not timed_crashes(faults, cluster.ranks_per_node) and not counted_crashes(faults):
        return None
    crashes = sim.crashes = Crashes(sim, faults)
    crashes.schedule()
    return crashes


@contextlib.contextmanager
def _entered(*contexts: Any) -> Any:
    """Enter ``contexts`` in order (a rank's memory tracker, then its dispatch mode)."""
    if len(contexts) == 2:  # most ranks (a GPU rank, or memory accounting on the CPU): an ExitStack costs more
        with contexts[0], contexts[1]:
            yield
        return
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _device_seed(seed: int, rank: int, index: int) -> int:
    """The seed rank ``rank``'s simulated GPU ``index`` starts its generator from in a run of ``seed``."""
    return derive_seed(seed, rank, f"cuda:{index}")


def _check_arguments(fn: Any, args: Any, kwargs: Any) -> None:
    """Refuse what would fail inside every rank, or silently do something else than the caller meant."""
    if not callable(fn):
        raise RunArgumentError(f"simdist.run needs a function to run on every rank; got {type(fn).__name__} {fn!r:.60}")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        kind = "a generator function" if inspect.isgeneratorfunction(fn) else "an async function"
        raise RunArgumentError(
            f"{getattr(fn, '__qualname__', fn)!s} is {kind}: calling it returns an object without running its body "
            "(as it would in a real process); pass a plain function (wrap it, e.g. asyncio.run(...) inside one)"
        )
    if not isinstance(args, (tuple, list)):
        raise RunArgumentError(
            f"args must be a tuple of positional arguments, got {type(args).__name__}; for one argument write args=(x,)"
        )
    if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
        raise RunArgumentError(f"kwargs must be a dict of keyword arguments (str keys), got {type(kwargs).__name__}")


def _copy_for_rank(args: tuple, kwargs: dict[str, Any], rank: int) -> tuple[tuple, dict[str, Any]]:
    """A deep copy of the arguments for one rank, as a separate process would receive them."""
    if not args and not kwargs:
        return (), {}
    try:
        return copy.deepcopy((args, kwargs))
    except Exception as e:
        raise SimdistError(
            f"rank {rank}: could not copy the arguments of simdist.run for the rank "
            f"({type(e).__name__}: {safe_str(e)}). Each rank receives its own deep copy, as each process of a "
            f"real launch does; pass copy_args=False to share them (read-only inputs)"
        ) from e


def _local_world_size(cluster: Cluster) -> int:
    per_node = getattr(cluster, "ranks_per_node", None)
    return int(per_node) if per_node else cluster.world_size


def _raise_failure(baton: Baton) -> None:
    failure = baton.failure
    if failure is None:
        return
    # A diagnosis (mismatch, deadlock, race) is raised as it is; a timeout or a rejected argument is what torch
    # raises in the rank (rank code may catch it), so an uncaught one is that rank's failure, like any other.
    if isinstance(failure, SimdistError) and not isinstance(failure, RAISED_AS_TORCH):
        raise failure
    failed = [s for s in baton.ranks if s.exc is not None and s.exc is failure]
    if failed:
        state = failed[0]
        others = [s.rank for s in baton.ranks if s.exc is not None and s.traceback_text and s is not state]
        raise RankError(state.rank, failure, state.traceback_text, others) from failure
    raise failure


