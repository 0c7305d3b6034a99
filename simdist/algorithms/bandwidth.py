"""Bus bandwidth as nccl-tests reports it: the algorithm bandwidth times a factor per collective."""

from __future__ import annotations


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``n`` ranks: all-reduce 2(n-1)/n; all-gather, reduce-scatter,
    all-to-all, gather, scatter (n-1)/n; the rest 1 (so one rank moves no bus bytes in the first two kinds)."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0
