"""What each collective is, declared once: one :class:`Collective` record per collective.

The algorithm registry (:mod:`simdist.algorithms.registry`) says how a collective can run; this record says
what it is, whatever runs it: whether it has a root, whether each rank's buffer is one chunk per rank,
whether it takes a reduce op, its bus-bandwidth factor as nccl-tests reports it, and how much memory
``simdist bench`` needs to run it. The bench, run reports and the documentation read these records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: nccl-tests' bus-bandwidth factors (its ``*GetBw`` functions), by the formula documentation prints
BUS_FORMULAS: dict[str, Callable[[int], float]] = {
    "2(n-1)/n": lambda n: 2 * (n - 1) / n,
    "(n-1)/n": lambda n: (n - 1) / n,
    "1": lambda n: 1.0,
}


@dataclass(frozen=True)
class Collective:
    """One collective: what every algorithm of it computes, whatever the schedule."""

    name: str
    #: what every rank holds afterwards, as documentation prints it
    summary: str
    #: one rank (torch's ``src`` or ``dst``) sends or receives on behalf of the group
    rooted: bool
    #: each rank's buffer is ``n`` chunks, one per rank (torch's ``*_list`` argument), so its element count
    #: is a multiple of the group size
    chunked: bool
    #: takes a reduce op (torch's ``op`` argument)
    reduces: bool
    #: nccl-tests' bus-bandwidth factor: busbw = algbw x this formula in the group size n (a key of
    #: :data:`BUS_FORMULAS`); it makes busbw comparable with the links' bandwidth whatever the collective
    bus: Literal["2(n-1)/n", "(n-1)/n", "1"]
    #: peak resident bytes of a ``simdist bench`` run per byte of one rank's buffer, all ranks together,
    #: measured on 16 ranks x 16 MiB and rounded up (all_to_all 6.5, reduce 3.3, reduce_scatter 2.6,
    #: broadcast 2.3, all_reduce and all_gather 1.6): inputs, outputs, expected values and in-flight message
    #: copies all count; None for a collective without a buffer to sweep
    memory_factor: int | None

    def bus_factor(self, n: int) -> float:
        """nccl-tests' bus-bandwidth factor on ``n`` ranks (0 on one rank for the ``(n-1)/n`` kinds)."""
        return BUS_FORMULAS[self.bus](n)


COLLECTIVE_RECORDS: tuple[Collective, ...] = (
    Collective("all_reduce", "every rank: the reduction of every rank's buffer", rooted=False, chunked=False,
               reduces=True, bus="2(n-1)/n", memory_factor=3),
    Collective("reduce_scatter", "rank r: chunk r of the reduction of every rank's buffer", rooted=False,
               chunked=True, reduces=True, bus="(n-1)/n", memory_factor=4),
    Collective("all_gather", "every rank: every rank's chunk, in rank order", rooted=False, chunked=True,
               reduces=False, bus="(n-1)/n", memory_factor=3),
    Collective("broadcast", "every rank: the root's buffer", rooted=True, chunked=False, reduces=False,
               bus="1", memory_factor=4),
    Collective("reduce", "the root: the reduction of every rank's buffer", rooted=True, chunked=False,
               reduces=True, bus="1", memory_factor=5),
    Collective("gather", "the root: every rank's chunk, in rank order", rooted=True, chunked=True,
               reduces=False, bus="(n-1)/n", memory_factor=2),
    Collective("scatter", "rank r: chunk r of the root's buffer", rooted=True, chunked=True, reduces=False,
               bus="(n-1)/n", memory_factor=2),
    Collective("all_to_all", "rank r: chunk r of every rank's buffer, in rank order", rooted=False,
               chunked=True, reduces=False, bus="(n-1)/n", memory_factor=8),
    # NCCL's barrier is a one-element all-reduce; it runs the all-reduce algorithms but has no buffer of the
    # user's, no reduce op to choose and nothing for the bench to sweep
    Collective("barrier", "nothing: every rank waits until every rank has entered", rooted=False,
               chunked=False, reduces=False, bus="1", memory_factor=None),
)  # fmt: skip
"""Every collective, in the order the registry declares their algorithms."""
