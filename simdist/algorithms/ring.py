"""Ring algorithms: every rank sends only to its successor, so a ring runs at the pace of its slowest hop."""

from __future__ import annotations

import numpy as np

from simdist.algorithms.schedule import Msg, MsgTable, msg, pipeline_chunks, split_offsets


def _around(n: int, off: list[int], step0: int, shift: int, red: bool) -> tuple[np.ndarray, ...]:
    """n-1 steps in which every rank r sends chunk ``(r - k - shift) % n`` to r+1 at its step k, as (n, n-1)
    arrays (rank by rank, as a run looks its sends up)."""
    r = np.arange(n, dtype=np.int64)[:, None].repeat(n - 1, axis=1)
    k = np.arange(n - 1, dtype=np.int64)[None, :].repeat(n, axis=0)
    c = (r - k - shift) % n
    bounds = np.asarray(off, dtype=np.int64)
    lo, hi = bounds[c], bounds[c + 1]
    return r, (r + 1) % n, k + step0, lo, hi, np.full(r.shape, red)


def _table(*parts: tuple[np.ndarray, ...]) -> MsgTable:
    """Parts of (n, steps) arrays joined step after step, rank by rank, as one schedule."""
    src, dst, step, lo, hi, red = (np.concatenate(cols, axis=1).ravel() for cols in zip(*parts))
    return MsgTable(src, dst, step, lo, hi, lo, hi, red)


def reduce_scatter(n: int, off: list[int], step0: int = 0) -> MsgTable:
    """After n-1 steps rank r holds the reduced chunk r (chunk boundaries ``off``)."""
    return _table(_around(n, off, step0, 1, True))


def all_gather(n: int, off: list[int], step0: int = 0) -> MsgTable:
    """Rank r starts with chunk r; after n-1 steps every rank has every chunk."""
    return _table(_around(n, off, step0, 0, False))


def all_reduce(n: int, numel: int) -> MsgTable:
    """Reduce-scatter then all-gather around the ring: 2(n-1) steps of m/n elements."""
    off = split_offsets(numel, n)
    return _table(_around(n, off, 0, 1, True), _around(n, off, n - 1, 0, False))


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
