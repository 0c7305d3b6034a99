"""Collective times read from a real run's timeline (``real.run(..., timeline=DIR)``)."""

from __future__ import annotations

from collections import defaultdict

from simdist.calibrate.samples import Sample
from simdist_base.timeline import CommRecord, Timeline

#: the timeline's op names -> (simdist's collective, whether ``nbytes`` is one rank's chunk of the buffer)
OPS = {
    "all_reduce": ("all_reduce", False),
    "allreduce": ("all_reduce", False),
    "broadcast": ("broadcast", False),
    "reduce": ("reduce", False),
    "all_gather": ("all_gather", True),
    "all_gather_into_tensor": ("all_gather", True),
    "reduce_scatter": ("reduce_scatter", False),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "all_to_all_single": ("all_to_all", False),
}


def samples(timeline: Timeline, source: str = "timeline") -> list[Sample]:
    """One sample per collective call all of whose ranks recorded its end.

    A call's time runs from the moment its last rank issued it to the moment its last rank saw it complete:
    what the collective itself took, without the time its early ranks waited for the late ones.
    """
    calls: dict[tuple[str, int], list[CommRecord]] = defaultdict(list)
    for rank in timeline.ranks:
        seen: dict[str, int] = defaultdict(int)
        for rec in timeline.records[rank]:
            if rec.op not in OPS:
                continue
            # the n-th collective of a group on one rank is the n-th on every other rank of the group
            key = (rec.group, seen[rec.group])
            seen[rec.group] += 1
            calls[key].append(rec)
    out = []
    for key in sorted(calls, key=lambda k: (k[0], k[1])):
        recs = calls[key]
        n = len(recs[0].group_ranks)
        if len(recs) != n or any(r.end is None for r in recs) or len({r.op for r in recs}) != 1:
            continue
        collective, chunk = OPS[recs[0].op]
        start = max(r.start for r in recs)
        end = max(r.end for r in recs if r.end is not None)
        nbytes = recs[0].nbytes * (n if chunk else 1)
        out.append(Sample(collective, nbytes, n, end - start, f"{source}: {key[0]} call {key[1]} ({recs[0].site})",
                          len({timeline.hosts.get(r.rank, "") for r in recs})))  # fmt: skip
    return out
