"""The state of one simulated run shared by the engine, the backend and the network."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import simpy

import simdist
from simdist.comm import algorithms
from simdist.comm.group import GroupState
from simdist.comm.p2p import P2P
from simdist.comm.races import RaceDetector
from simdist.engine.baton import Baton, caller_site, current_rank_state
from simdist.errors import DeadlockError
from simdist.network.links import Network
from simdist.trace.trace import Trace

#: frames in these directories are simdist's or torch's own, never the user's call site
_PKG = os.path.dirname(os.path.abspath(simdist.__file__))
_SKIP = tuple(
    os.path.join(_PKG, d) for d in ("engine", "comm", "network", "compute", "trace")
) + (
    os.path.dirname(os.path.abspath(__import__("torch").__file__)),
    os.path.abspath(__import__("typing_extensions").__file__).rsplit(".", 1)[0],
    os.path.dirname(os.path.abspath(__import__("contextlib").__file__)) + os.sep + "contextlib",
)

#: backend progress semantics: "nccl" runs a group's collectives one after another on one stream per
#: (rank, group); "gloo" runs them on a pool of worker threads per (rank, group), so independent async
#: operations overlap (ProcessGroupGloo's default pool has 2 threads)
PROGRESS_MODES = ("nccl", "gloo")


class Simulation:
    """Everything one run shares: clock, cluster, network, groups, point-to-point queues and the trace."""

    def __init__(
        self,
        cluster: Any,
        world_size: int,
        seed: int,
        progress: str,
        trace: Trace,
        device: Any,
        gloo_threads: int = 2,
        races: str = "off",
    ) -> None:
        if progress not in PROGRESS_MODES:
            raise ValueError(f"progress must be one of {PROGRESS_MODES}, got {progress!r}")
        if isinstance(gloo_threads, bool) or not isinstance(gloo_threads, int) or gloo_threads < 1:
            raise ValueError(f"gloo_threads must be a positive int (worker threads per process group), got {gloo_threads!r}")
        self.env = simpy.Environment()
        self.cluster = cluster
        self.world_size = world_size
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.progress = progress
        #: collectives that can run at once per (rank, group): one stream, or the gloo worker pool
        self.slots = 1 if progress == "nccl" else gloo_threads
        self.trace = trace
        self.device = device
        self.races = RaceDetector(races, progress, self.now)
        self.network = Network(self.env, cluster)
        self.p2p = P2P(self)
        self.groups: dict[object, GroupState] = {}
        self.baton: Baton | None = None
        self.default_timeout: float | None = None
        #: the rendezvous store every rank's default group is created with
        self.store: Any = None
        self._alpha_beta: dict[int, tuple] = {}

    # ------------------------------------------------------------------ groups
    def group_state(self, key: object, name: str, global_ranks: list[int], timeout: float | None) -> GroupState:
        """The shared state of a group, created by the first member rank that builds it."""
        st = self.groups.get(key)
        if st is None:
            st = self.groups[key] = GroupState(self, name, global_ranks, len(self.groups), self.slots)
            st.timeout = timeout
        return st

    def algorithm_for(self, st: GroupState, collective: str, nbytes: int) -> str:
        """The algorithm a collective runs with: the group's choice, else the cluster's, else the cheapest."""
        choice = st.algorithms.get(collective) or self.cluster.algorithms.get(collective) or "auto"
        if choice != "auto":
            if choice not in algorithms.SUPPORTED[collective]:
                raise ValueError(
                    f"algorithm {choice!r} does not implement {collective}; "
                    f"choose one of {algorithms.SUPPORTED[collective]} or 'auto'"
                )
            return choice
        near, far = self._group_alpha_beta(st)
        return algorithms.choose(collective, st.size, nbytes, near, far)

    def _group_alpha_beta(self, st: GroupState) -> tuple[tuple[float, float], tuple[float, float]]:
        """(alpha, beta) between ring neighbours and between the group's farthest-apart ranks."""
        key = st.index
        ab = self._alpha_beta.get(key)
        if ab is None:
            if st.size < 2:
                ab = ((0.0, 0.0), (0.0, 0.0))
            else:
                g = st.global_ranks
                c = self.cluster
                n = st.size
                # a ring moves at the pace of its slowest hop (e.g. the one crossing nodes)
                near = (
                    max(c.path_latency(g[i], g[(i + 1) % n]) for i in range(n)),
                    max(1.0 / c.path_bandwidth(g[i], g[(i + 1) % n]) for i in range(n)),
                )
                far = (c.path_latency(g[0], g[n // 2]), 1.0 / c.path_bandwidth(g[0], g[n // 2]))
                ab = (near, far)
            self._alpha_beta[key] = ab
        return ab

    # ------------------------------------------------------------------ compute time
    def charge(self, seconds: float, name: str) -> None:
        """Add ``seconds`` of compute to the calling rank's compute stream (settled at its next sync point)."""
        state = current_rank_state()
        if state is None or seconds <= 0:
            return
        start = self.env.now + state.pending
        state.pending += seconds
        self.trace.compute(state.rank, name, start, start + seconds)

    def settle(self) -> None:
        """Advance simulated time over the calling rank's pending compute."""
        state = current_rank_state()
        if state is not None and state.pending > 0:
            pending, state.pending = state.pending, 0.0
            self.baton.sleep(pending, f"rank {state.rank} computing")

    def let_time_pass(self, event: Any, description: str) -> None:
        """A rank polled an operation that is not done: move it on to the next simulated time at which
        something is scheduled (whatever is due earlier, other ranks' polls included, runs first).

        If nothing is scheduled after now, the operation can only complete by waiting, so the rank waits for
        it (and the run reports a deadlock if it never can) instead of polling forever.
        """
        now = self.env.now
        later = min((item[0] for item in self.env._queue if item[0] > now), default=float("inf"))
        if later == float("inf"):
            self.baton.block(event, description)
        else:
            self.baton.block(self.env.timeout(later - now), description)

    def now(self) -> float:
        """The calling rank's current simulated time (seconds), pending compute included."""
        state = current_rank_state()
        return self.env.now + (state.pending if state is not None else 0.0)

    # ------------------------------------------------------------------ diagnosis
    def call_site(self) -> str:
        """The user's call site of the operation being issued."""
        return caller_site(_SKIP)

    def who_is_missing(self, work: Any) -> str:
        """Text naming the ranks that have not joined ``work``'s collective."""
        st = getattr(work, "group_state", None)
        if st is None:
            return ""
        missing = st.missing_ranks(work.seq)
        return f"Ranks that have not issued it: {missing}." if missing else "Every rank issued it."

    def stall_report(self) -> DeadlockError:
        """The error raised when every unfinished rank is blocked and nothing is scheduled."""
        lines = [f"deadlock at simulated time {self.env.now:.9g} s: every unfinished rank is blocked and nothing is scheduled."]
        assert self.baton is not None
        for s in self.baton.ranks:
            if s.finished:
                lines.append(f"  rank {s.rank}: finished")
            else:
                lines.append(f"  rank {s.rank}: {s.waiting_on or 'blocked'}")
        for st in self.groups.values():
            for seq, inst in sorted(st.instances.items()):
                if len(inst.calls) < st.size:
                    joined = sorted(st.global_ranks[r] for r in inst.calls)
                    c = next(iter(inst.calls.values()))
                    lines.append(
                        f"  group {st.name or 'default'} {c.op} #{seq}: issued by ranks {joined}, "
                        f"never by {st.missing_ranks(seq)}"
                    )
        pend = self.p2p.pending_descriptions()
        if pend:
            lines.append("  unmatched point-to-point operations:")
            lines += [f"    {p}" for p in pend]
        return DeadlockError("\n".join(lines))
