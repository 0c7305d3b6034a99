"""Ring algorithms: every rank sends only to its successor, so a ring runs at the pace of its slowest hop."""

from __future__ import annotations

import numpy as np

from simdist.algorithms.schedule import Msg, MsgTable, msg, pipeline_chunks, split_offsets


def _rings(n: int, off: list[int], step0: int, blocks: list[tuple[int, bool]]) -> MsgTable:
    """Rings of n-1 steps one after another, as one schedule listed rank by rank (as a run looks its sends up):
    in block ``b`` (``shift``, whether it reduces) every rank r sends chunk ``(r - k - shift) % n`` (boundaries
    ``off``) to r+1 at its step ``step0 + b(n-1) + k``."""
    w = n - 1
    width = w * len(blocks)
    r = np.arange(n, dtype=np.int64)[:, None]
    k = np.arange(w, dtype=np.int64)[None, :]
    chunk = np.empty((n, width), dtype=np.int64)
    red = np.empty((n, width), dtype=bool)
    for b, (shift, reduces) in enumerate(blocks):
        np.remainder(r - k - shift, n, out=chunk[:, b * w : (b + 1) * w])
        red[:, b * w : (b + 1) * w] = reduces
    bounds = np.asarray(off, dtype=np.int64)
    lo, hi = bounds[:-1][chunk].ravel(), bounds[1:][chunk].ravel()
    ranks = np.arange(n, dtype=np.int64)
    src, dst = ranks.repeat(width), ((ranks + 1) % n).repeat(width)
    step = np.tile(np.arange(step0, step0 + width, dtype=np.int64), n)
    return MsgTable(src, dst, step, lo, hi, lo, hi, red.ravel())


def reduce_scatter(n: int, off: list[int], step0: int = 0) -> MsgTable:
    """After n-1 steps rank r holds the reduced chunk r (chunk boundaries ``off``)."""
    return _rings(n, off, step0, [(1, True)])


def all_gather(n: int, off: list[int], step0: int = 0) -> MsgTable:
    """Rank r starts with chunk r; after n-1 steps every rank has every chunk."""
    return _rings(n, off, step0, [(0, False)])


def all_reduce(n: int, numel: int) -> MsgTable:
    """Reduce-scatter then all-gather around the ring: 2(n-1) steps of m/n elements."""
    return _rings(n, split_offsets(numel, n), 0, [(1, True), (0, False)])


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
