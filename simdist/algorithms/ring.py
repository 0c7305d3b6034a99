"""Ring algorithms: every rank sends only to its successor, so a ring runs at the pace of its slowest hop."""

from __future__ import annotations

from simdist.algorithms.schedule import Msg, msg, pipeline_chunks, split_offsets


def reduce_scatter(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """After n-1 steps rank r holds the reduced chunk r (chunk boundaries ``off``)."""
    msgs = []
    for k in range(n - 1):
        for r in range(n):
            c = (r - k - 1) % n
            msgs.append(msg(r, (r + 1) % n, step0 + k, off[c], off[c + 1], "reduce"))
    return msgs


def all_gather(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Rank r starts with chunk r; after n-1 steps every rank has every chunk."""
    msgs = []
    for k in range(n - 1):
        for r in range(n):
            c = (r - k) % n
            msgs.append(msg(r, (r + 1) % n, step0 + k, off[c], off[c + 1], "copy"))
    return msgs


def all_reduce(n: int, numel: int) -> list[Msg]:
    """Reduce-scatter then all-gather around the ring: 2(n-1) steps of m/n elements."""
    off = split_offsets(numel, n)
    return reduce_scatter(n, off) + all_gather(n, off, n - 1)


def broadcast(n: int, numel: int, nbytes: int, root: int) -> list[Msg]:
    """Pipelined chain root -> root+1 -> ... in K pieces: (n-1) alpha + (n-2+K) beta m/K."""
    k_pieces = pipeline_chunks(nbytes, numel)
    off = split_offsets(numel, k_pieces)
    msgs = []
    for q in range(n - 1):  # position q along the chain sends piece c at step c + q
        src, dst = (root + q) % n, (root + q + 1) % n
        for c in range(k_pieces):
            msgs.append(msg(src, dst, c + q, off[c], off[c + 1], "copy"))
    return msgs


def reduce(n: int, numel: int, nbytes: int, root: int) -> list[Msg]:
    """Pipelined chain root+1 -> root+2 -> ... -> root in K pieces."""
    k_pieces = pipeline_chunks(nbytes, numel)
    off = split_offsets(numel, k_pieces)
    msgs = []
    for q in range(n - 1):
        src, dst = (root + 1 + q) % n, (root + 2 + q) % n
        for c in range(k_pieces):
            msgs.append(msg(src, dst, c + q, off[c], off[c + 1], "reduce"))
    return msgs
