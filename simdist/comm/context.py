"""What the communication layer of one simulated run shares: clock, network, groups, queues, races, trace."""

from __future__ import annotations

import sys
from typing import Any

import simpy
import torch.distributed as dist

from simdist.clock.baton import Baton, current_rank_state
from simdist.clock.ranktime import RankTime
from simdist.clock.sites import Site, caller_site, torch_scope
from simdist.comm.callbacks import IDLE, FutureCallbacks
from simdist.comm.crashes import Crashes
from simdist.comm.group import GroupState
from simdist.comm.p2p import P2P
from simdist.comm.races import RaceDetector
from simdist.comm.selection import AlgorithmSelector
from simdist.comm.waivers import parse_waivers
from simdist.errors import DeadlockError
from simdist.layers import LIBRARY_FILES, NOT_CALL_SITES
from simdist.network.cluster import Cluster
from simdist.network.links import Network
from simdist.options import RunOptions
from simdist.ranks import by_text, format_ranks
from simdist.trace.trace import Trace, side_stream_name

#: ops that copy a value from the device to the host (``.item()``, ``bool(t)``, printing): the host waits for
#: its compute stream there, as a CUDA host does
HOST_READS = frozenset({"aten::_local_scalar_dense"})


class RunContext:
    """Everything one run's communication shares: clock, cluster, network, groups, point-to-point queues,
    the race detector and the trace. Process groups, works and messages reach each other through it."""

    def __init__(
        self,
        env: simpy.Environment,
        baton: Baton,
        cluster: Cluster,
        trace: Trace,
        options: RunOptions,
        host_runs_ahead: bool = False,
        simulated: frozenset[int] | None = None,
    ) -> None:
        progress = options.progress
        #: the global ranks whose threads run in a symmetric run (the others stand as their copies); None: every rank
        self.simulated = simulated
        #: a symmetric run's collectives not yet over: (start, end, group), to find the ones that overlap
        self.symmetric_running: list[tuple[float, float, GroupState]] = []
        #: the first overlap of two collectives that share ranks in a symmetric run (None: none), warned after it
        self.symmetric_overlap: str | None = None
        #: the run's options (its defaults resolved by the runner)
        self.options = options
        self.env = env
        self.baton = baton
        self.time = RankTime(env, baton, host_runs_ahead and progress == "nccl")
        self.cluster = cluster
        self.world_size = cluster.world_size
        self.progress = progress
        #: collectives that can run at once per (rank, group): one stream, or the gloo thread pool
        self.slots = 1 if progress == "nccl" else options.gloo_threads
        self.trace = trace
        #: (global rank, group name, sequence number) -> the call site of each collective, for reports; kept out
        #: of the trace so that a trace's hash does not depend on where the program's files live
        self.call_sites: dict[tuple[int, str, int], str] = {}
        #: (global rank, span name, start, end) -> the call site of each point-to-point send or receive span
        self.p2p_sites: dict[tuple[int, str, float, float], str] = {}
        self.races = RaceDetector(options.races or "off", progress, self.now)
        self.races.waive(parse_waivers(options.race_waivers))
        self.network = Network(env, cluster)
        self.p2p = P2P(self)
        self.selector = AlgorithmSelector(cluster, symmetric=simulated is not None)
        self.groups: dict[object, GroupState] = {}
        #: the default timeout (simulated seconds) of groups created without one; None: no timeout
        self.default_timeout: float | None = None
        #: the rendezvous store every rank's default group is created with
        self.store = dist.HashStore()
        #: where callbacks chained to the ranks' futures run
        self.callbacks = FutureCallbacks(env, baton)
        #: the backend name rank code sees (``dist.get_backend()``): "simdist", "gloo" or "nccl"
        self.backend_name = options.backend_name
        #: whether rank code sees simulated CUDA devices (the cluster's device is a GPU model)
        self.emulates_cuda = False
        perturbation = getattr(env, "perturbation", None)
        if perturbation is not None and perturbation.compute:
            self._jitter = perturbation.compute
            self._rng = perturbation.rng("compute")
            self.charge = self._charge_perturbed  # type: ignore[method-assign]
        #: the run's crash faults and the ranks they killed (None: no rank crashes in this run)
        self.crashes: Crashes | None = None

    # ------------------------------------------------------------------ groups
    def group_state(self, key: object, name: str, global_ranks: list[int], timeout: float | None) -> GroupState:
        """The shared state of a group, created by the first member rank that builds it."""
        st = self.groups.get(key)
        if st is None:
            members = (
                None
                if self.simulated is None
                else [i for i, g in enumerate(global_ranks) if g in self.simulated]
            )
            st = self.groups[key] = GroupState(name, global_ranks, len(self.groups), self.slots, members)
            st.timeout = timeout
        return st

    # ------------------------------------------------------------------ rank time
    def charge(self, seconds: float, name: str, launch: float = 0.0) -> None:
        """Add ``seconds`` of compute to the calling rank's compute stream (settled at its next sync point), after
        its host spent ``launch`` seconds launching it (see :meth:`launch`)."""
        span = self.time.charge(seconds, launch)
        if span is not None:
            if span[3]:
                self.trace.span(span[0], side_stream_name(span[3]), name, span[1], span[2])
            else:
                self.trace.compute(span[0], name, span[1], span[2])
            if name in HOST_READS:
                self.synchronize_stream()

    def _charge_perturbed(self, seconds: float, name: str, launch: float = 0.0) -> None:
        """:meth:`charge` in a perturbed run: ``seconds`` stretched by the run's compute jitter."""
        if seconds > 0 and current_rank_state() is not None:
            seconds *= 1.0 + self._jitter * self._rng.random()
        RunContext.charge(self, seconds, name, launch)

    def launch(self, seconds: float) -> None:
        """The calling rank's host spends ``seconds`` launching a kernel (see ``RankTime.launch``)."""
        self.time.launch(seconds)

    def settle(self) -> None:
        """Bring the calling rank's host up to date with the compute it waits for (see ``RankTime.settle``)."""
        self.time.settle()

    def issue_time(self) -> float:
        """When an operation the calling rank issues now may start on its stream (see ``RankTime.issue_time``)."""
        return self.time.issue_time()

    def synchronize(self) -> None:
        """Wait on the calling rank's host until every stream of its device is idle."""
        self.time.synchronize()
        state = current_rank_state()
        if state is not None and self.races.enabled:
            self.races.host_synchronized(state.rank)

    def synchronize_stream(self) -> None:
        """Wait on the calling rank's host until its thread's current stream is idle (a blocking copy, a value read
        to the host)."""
        self.time.synchronize_stream()
        state = current_rank_state()
        if state is not None and self.races.enabled:
            self.races.stream_waited(state.rank, None, self.races.clock(state.rank, state.stream, self.now()))

    def now(self) -> float:
        """The calling rank's current simulated time (seconds), pending compute included."""
        return self.time.now()

    def let_time_pass(self, event: Any, description: str) -> None:
        """A rank polled an operation that is not done: let simulated time move on (see ``RankTime``)."""
        self.time.let_time_pass(event, description)

    # ------------------------------------------------------------------ diagnosis
    def call_site(self) -> Site:
        """The call site of the operation being issued: the user's line, after torch's or a strategy's when one of
        them issued it."""
        return caller_site(NOT_CALL_SITES, LIBRARY_FILES)

    def who_is_missing(self, work: Any) -> str:
        """Text naming the ranks that have not joined ``work``'s collective (and, once it runs, its progress)."""
        st = getattr(work, "group_state", None)
        if st is None:
            return ""
        missing = st.missing_ranks(work.seq)
        if missing:
            crashed = f" {self.crashes.note(missing)}" if self.crashes is not None else ""
            return f"Not issued by {format_ranks(missing)}.{crashed}"
        running = getattr(work, "messages", None)
        crashed = ""
        if self.crashes is not None and self.crashes.dead:
            crashed = " " + self.crashes.note([st.global_ranks[r] for r in st.members])
        if running is None:
            return "Every rank issued it." + crashed
        return f"Every rank issued it; it was still running.{crashed} Its schedule:\n" + running.progress()

    def stall_report(self) -> DeadlockError:
        """The error raised when every unfinished rank is blocked and nothing is scheduled.

        Collectives some ranks never joined come first; ranks in the same state share one line, so the report
        names every rank at any world size.
        """
        lines = [f"deadlock at simulated time {self.env.now:.9g} s: every unfinished rank is blocked and nothing is scheduled."]
        for st in self.groups.values():
            for seq, inst in sorted(st.instances.items()):
                if len(inst.calls) < st.expected:
                    joined = [st.global_ranks[r] for r in inst.calls]
                    c = next(iter(inst.calls.values()))
                    lines.append(
                        f"  group {st.name or 'default'} {c.op} #{seq}: never issued by "
                        f"{format_ranks(st.missing_ranks(seq))}; issued by {format_ranks(joined)}"
                    )
        states = []
        frames = sys._current_frames()
        for s in self.baton.ranks:
            prefix = f"rank {s.rank} "
            what = ("crashed" if s.crashed else "finished") if s.finished else (s.waiting_on or "blocked")
            if self.simulated is not None and s.rank not in self.simulated:
                what = "not simulated (a symmetric run: they stand as copies of the simulated ranks)"
            # which step of torch's own loop (a schedule's action) the rank is blocked in
            scope = "" if s.finished or s.thread is None else torch_scope(frames.get(s.thread.ident))
            states.append((s.rank, what.removeprefix(prefix) + (f"; blocked in torch's {scope}" if scope else "")))
        lines += [f"  {format_ranks(ranks)}: {what}" for ranks, what in by_text(states)]
        for s in self.baton.children:
            if not s.finished and s.waiting_on != IDLE:
                name = s.thread.name if s.thread is not None else "thread"
                lines.append(f"  rank {s.rank}, its thread {name!r}: {s.waiting_on or 'blocked'}")
        pend = self.p2p.pending_descriptions()
        if pend:
            lines.append("  unmatched point-to-point operations:")
            lines += [f"    {p}" for p in pend]
        return DeadlockError("\n".join(lines))
