"""Symmetric runs: a few ranks simulated op by op stand for a whole world of ranks running the same program.

Data-parallel ranks run the same ops on same-shaped tensors and meet in collectives that treat them alike, so
each rank's timeline is every other rank's. A run made with ``symmetric=True`` starts threads for a few sampled
ranks only (:func:`sampled_ranks`); each sees its own rank and the whole world's size, matches its collectives
with the other sampled ranks, and waits for each the closed-form time of the whole group's schedule
(``AlgorithmSelector.seconds``). What the full run would show is then the sampled ranks' timelines, copied to
the ranks that were not simulated. That holds under the conditions docs/symmetry.md states; this module refuses
the runs that break the ones it can see before the run (:func:`check_run`) and compares the sampled ranks'
timelines after it (:func:`check_alike`).
"""

from __future__ import annotations

from dataclasses import dataclass

from simdist.errors import SymmetryError
from simdist.network.cluster import Cluster
from simdist.options import RunOptions
from simdist.trace.trace import Span, Trace


def sampled_ranks(world_size: int, ranks_per_node: int | None) -> tuple[int, ...]:
    """The ranks a symmetric run simulates: the first two, the middle one, the last, and on a cluster of nodes the
    last rank of the first node and the first of the second (both ends of each kind of hop), ascending."""
    picks = {0, 1, world_size // 2, world_size - 1}
    if ranks_per_node is not None and ranks_per_node < world_size:
        picks |= {ranks_per_node - 1, ranks_per_node}
    return tuple(sorted(r for r in picks if 0 <= r < world_size))


def check_run(cluster: Cluster, options: RunOptions, perturbed: bool) -> None:
    """Refuse a symmetric run whose ranks are not alike before it starts: faults or a perturbation that single out
    ranks, gloo's per-rank reduction model, or a cluster whose ring hops differ under message timing."""
    if options.faults:
        raise SymmetryError(
            "symmetric=True cannot be combined with faults: a fault strikes particular ranks, links or nodes, so the "
            "ranks no longer run alike; run the faults without symmetric=True"
        )
    if perturbed:
        raise SymmetryError(
            "symmetric=True cannot be combined with a perturbation: it reorders and stretches events rank by rank; "
            "explore without symmetric=True"
        )
    if cluster.collective_model == "gloo":
        raise SymmetryError(
            f"cluster {cluster.name!r}: symmetric=True does not support collective_model='gloo' (each rank adds "
            "received messages on its own thread, one after another, which has no closed form); use "
            "collective_model='alpha-beta' or 'nccl'"
        )
    if cluster.collective_model == "alpha-beta":
        check_hops(cluster, f"under collective_model={cluster.collective_model!r}")
    # NCCL's model times a call as one figure for the whole communicator; a call it does not time (a group that
    # presents gloo, an algorithm NCCL does not run) is checked where it runs (simdist.comm.launch)


def check_hops(cluster: Cluster, why: str) -> None:
    """Refuse ``cluster`` for a symmetric run's message-timed collectives unless the hops of its ranks' ring around
    the sampled ranks cost alike; ``why`` says what times them by their messages."""
    n = cluster.world_size
    hops = sorted({(r, (r + 1) % n) for r in sampled_ranks(n, cluster.ranks_per_node)})
    prices = {hop: (cluster.path_latency(*hop), cluster.path_bandwidth(*hop)) for hop in hops}
    first = prices[hops[0]]
    for hop, price in prices.items():
        if price != first:
            raise SymmetryError(
                f"cluster {cluster.name!r}: symmetric=True needs every hop of the ranks' ring to cost the same {why}, "
                f"but {hops[0][0]} -> {hops[0][1]} has latency {first[0]:.6g} s and bandwidth {first[1]:.6g} B/s "
                f"while {hop[0]} -> {hop[1]} has {price[0]:.6g} s and {price[1]:.6g} B/s (ranks at different places "
                "in the topology finish collectives at different times); use a switch or ring cluster, "
                "collective_model='nccl' (one time per call), or run without symmetric=True"
            )


@dataclass(frozen=True)
class NotSimulated:
    """What ``RunResult.returns`` holds for a rank a symmetric run did not simulate: its function never ran."""

    rank: int
    #: the simulated rank whose timeline stands for this one's
    representative: int

    def __repr__(self) -> str:
        return (
            f"<rank {self.rank} not simulated (symmetric run): its timeline is rank {self.representative}'s>"
        )


def check_alike(trace: Trace, simulated: tuple[int, ...]) -> None:
    """Raise :class:`SymmetryError` unless every simulated rank's spans (stream, name, start, end) are the first
    simulated rank's: a rank that ran other ops, or the same ops at other times, breaks the symmetry. Of the
    ranks that differ, the one named is the one whose timeline parts from the first rank's first in simulated
    time, and of those one that ran another op over one that ran the same op at another time: a rank that
    waited in a collective for a rank that differs, or did not wait for it, differs as a consequence."""
    timelines: dict[int, list[Span]] = {r: [] for r in simulated}
    for span in trace.spans:
        timelines[span.rank].append(span)
    base_rank = simulated[0]
    base = timelines[base_rank]
    first: tuple[float, bool, int, int, Span | None, Span | None] | None = None
    for r in simulated[1:]:
        other = timelines[r]
        for i in range(max(len(base), len(other))):
            a = base[i] if i < len(base) else None
            b = other[i] if i < len(other) else None
            if a is None or b is None or _key(a) != _key(b):
                when = base[i - 1].end if i else 0.0  # the timelines agree until then
                only_times = a is not None and b is not None and _key(a)[:2] == _key(b)[:2]
                if first is None or (when, only_times) < first[:2]:
                    first = (when, only_times, r, i, a, b)
                break
    if first is not None:
        _, _, r, i, a, b = first
        raise SymmetryError(
            f"symmetric=True, but rank {r} did not run as rank {base_rank} did: span #{i} of rank "
            f"{base_rank} is {_describe(a)}, of rank {r} {_describe(b)}. A symmetric run needs every rank to "
            "run the same ops on same-shaped tensors at the same times (no rank-dependent control flow, no "
            "work only some ranks do, such as logging on rank 0); run without symmetric=True"
        )


def _key(span: Span) -> tuple[str, str, float, float]:
    # ranks of different groups of one shape (each node's, each replica's) run alike on streams named for their
    # group: compare the kind of stream, not its group's name
    stream = "comm" if span.stream.startswith("comm") else span.stream
    return stream, span.name, span.start, span.end


def _describe(span: Span | None) -> str:
    if span is None:
        return "missing (it has fewer spans)"
    return f"{span.name} on stream {span.stream} from {span.start:.9g} s to {span.end:.9g} s"
