"""A process group's shared state: matching collectives across ranks, checking they agree, and ordering them.

Every rank numbers the collectives it issues on a group; call number ``k`` of every rank forms one
:class:`Instance`. When all ranks have joined it, their calls are compared (op, shapes, dtypes, reduce op,
root): any difference is a :class:`CollectiveMismatchError` naming every rank's call and call site.

Progress: each (rank, group) pair has ``slots`` places where its collectives run, taken in issue order. With one
slot (NCCL-like progress) that is the group's stream: an instance starts once every rank has joined it and
every rank's previous instance on that group has finished. With several (gloo-like progress: ProcessGroupGloo
runs each async operation on one of a pool of threads, two by default) independent operations run
concurrently, each reading and writing its buffers at the simulated times of its own messages.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simdist.algorithms.nccl import Enabled
from simdist.comm.ops import OpSpec
from simdist.comm.work import SimWork
from simdist.errors import CollectiveMismatchError
from simdist.ranks import by_text, format_ranks


@dataclass
class Call:
    """One rank's call of a collective."""

    spec: OpSpec
    rank: int  # group rank
    site: str
    work: SimWork
    #: the spec's signature when the call was issued
    signature: tuple = ()
    #: simulated time (seconds) from which the rank's stream may run it: when its compute stream reaches the
    #: issue point (see ``RankTime.issue_time``)
    ready_at: float = 0.0

    @property
    def op(self) -> str:
        """The op's name (``all_reduce``, ``all_gather_into_tensor``, ...)."""
        return self.spec.name

    def describe(self) -> str:
        """``all_reduce(shape=(4,), dtype=float32, op=sum)`` style text."""
        inner = ", ".join(f"{k}={v}" for k, v in self.signature)
        return f"{self.op}({inner})"


@dataclass
class Instance:
    """Call number ``seq`` on a group, across all its ranks."""

    seq: int
    calls: dict[int, Call] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    started: bool = False
    done_ranks: set[int] = field(default_factory=set)
    #: the slot (the stream, or one of the gloo threads) each group rank runs it on
    slot: dict[int, int] = field(default_factory=dict)


class GroupState:
    """Shared by the ``SimProcessGroup`` objects of one group on every member rank."""

    def __init__(
        self, name: str, global_ranks: list[int], index: int, slots: int = 1, members: list[int] | None = None
    ) -> None:
        self.name = name
        self.global_ranks = global_ranks
        self.size = len(global_ranks)
        #: the group ranks whose threads run, ascending: every rank, or a symmetric run's simulated ones (an
        #: instance starts once they have joined, and runs for the whole group)
        self.members = list(range(self.size)) if members is None else members
        self.expected = len(self.members)
        self.index = index
        self.stream = f"comm:{name}" if name else "comm"
        #: the backend name the group presents (``"simdist"``, ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``):
        #: it decides whose reduction order results follow (:mod:`simdist.comm.ordering`)
        self.backend_name = "simdist"
        self.algorithms: dict[str, str] = {}
        #: the NCCL algorithms and protocols the group's ``NCCL_ALGO``/``NCCL_PROTO`` leave (read when it is
        #: created, as NCCL reads them when a communicator is made; None: all)
        self.nccl_enabled: Enabled | None = None
        self.timeout: float | None = None
        self._seq = [0] * self.size
        self.slots = slots
        #: per group rank: free slot numbers (ascending) and calls waiting for one, in issue order
        self._free: list[list[int]] = [list(range(slots)) for _ in range(self.size)]
        self._queue: list[deque[tuple[Instance, Callable[[Instance], None]]]] = [deque() for _ in range(self.size)]
        self.instances: dict[int, Instance] = {}
        #: ``monitored_barrier`` calls (:mod:`simdist.comm.monitored`): each rank's count, and the open rounds
        self.monitored_seq = [0] * self.size
        self.monitored_rounds: dict[int, Any] = {}

    def next_seq(self, rank: int) -> int:
        """The number the group's next collective from group rank ``rank`` will have (0 for its first)."""
        return self._seq[rank]

    def join(self, call: Call, start: Callable[[Instance], None]) -> None:
        """Register ``call``; ``start(instance)`` runs once every rank has joined and has a free slot for it."""
        r = call.rank
        seq = self._seq[r]
        self._seq[r] += 1
        inst = self.instances.get(seq)
        if inst is None:
            inst = self.instances[seq] = Instance(seq)
        inst.calls[r] = call
        if len(inst.calls) == self.expected:
            self._check(inst)
        self._queue[r].append((inst, start))
        self._dispatch(r)

    def _dispatch(self, r: int) -> None:
        queue, free = self._queue[r], self._free[r]
        while queue and free:
            inst, start = queue.popleft()
            inst.slot[r] = free.pop(0)
            self._mark_ready(inst, r, start)

    def _mark_ready(self, inst: Instance, r: int, start: Callable[[Instance], None]) -> None:
        inst.ready.add(r)
        if len(inst.ready) == self.expected and len(inst.calls) == self.expected and not inst.started:
            inst.started = True
            start(inst)

    def rank_done(self, inst: Instance, r: int) -> None:
        """Rank ``r``'s part of ``inst`` finished: release its slot."""
        inst.done_ranks.add(r)
        if len(inst.done_ranks) == self.expected:
            self.instances.pop(inst.seq, None)
        bisect.insort(self._free[r], inst.slot[r])
        self._dispatch(r)

    def stream_of(self, inst: Instance, r: int) -> str:
        """The trace stream (Chrome ``tid``) rank ``r`` runs ``inst`` on."""
        return self.stream if self.slots == 1 else f"{self.stream}:thread{inst.slot[r]}"

    def _check(self, inst: Instance) -> None:
        calls = [inst.calls[r] for r in self.members]
        first = calls[0]
        if all(c.op == first.op and c.signature == first.signature for c in calls):
            return
        lines = [f"collective #{inst.seq} on group {self.name or 'default'} does not match across ranks:"]
        issued = by_text((self.global_ranks[c.rank], f"{c.describe()} at {c.site}") for c in calls)
        for ranks, text in issued:
            lines.append(f"  {format_ranks(ranks)}: {text}")
        lines.append("Every rank of a group must issue the same collectives, with the same shapes, dtypes,")
        lines.append("reduce op and root, in the same order.")
        raise CollectiveMismatchError("\n".join(lines))

    def shares_ranks(self, other: GroupState) -> bool:
        """Whether this group and ``other`` have a global rank in common."""
        if other is self:
            return True
        mine = self.__dict__.get("_rank_set")
        if mine is None:
            mine = self._rank_set = frozenset(self.global_ranks)
        return not mine.isdisjoint(other.global_ranks)

    def group_rank(self, global_rank: int) -> int:
        """The group rank of a member's global rank."""
        ranks = self.__dict__.get("_rank_of")
        if ranks is None:
            ranks = self._rank_of = {g: i for i, g in enumerate(self.global_ranks)}
        return ranks[global_rank]

    def missing_ranks(self, seq: int) -> list[int]:
        """Global ranks that have not yet issued call ``seq``."""
        inst = self.instances.get(seq)
        joined = set(inst.calls) if inst else set()
        return [self.global_ranks[r] for r in self.members if r not in joined]
