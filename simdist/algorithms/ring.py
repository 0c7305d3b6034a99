"""Ring algorithms: every rank sends only to its successor, so a ring runs at the pace of its slowest hop."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from simdist.algorithms.schedule import Msg, MsgTable, msg, pipeline_chunks, split_offsets


def _rings(n: int, off: list[int], step0: int, blocks: list[tuple[int, bool]]) -> MsgTable:
    """Rings of n-1 steps one after another, as one schedule listed rank by rank (as a run looks its sends up):
    in block ``b`` (``shift``, whether it reduces) every rank r sends chunk ``(r - k - shift) % n`` (boundaries
    ``off``) to r+1 at its step ``step0 + b(n-1) + k``."""
    w = n - 1
    width = w * len(blocks)
    bounds = np.asarray(off, dtype=np.int64)
    cols = [np.empty((n, width), dtype=np.int64) for _ in range(5)]
    src, dst, step, lo, hi = cols
    red = np.empty((n, width), dtype=bool)
    src[...] = np.arange(n, dtype=np.int64)[:, None]
    dst[...] = ((np.arange(n, dtype=np.int64) + 1) % n)[:, None]
    step[...] = np.arange(step0, step0 + width, dtype=np.int64)
    for edge, out in ((bounds[:-1], lo), (bounds[1:], hi)):
        # chunk (r - k - shift) % n's edge is ``ext[2n - shift + r - k]`` of the edges repeated three times: read
        # as a window of the reversed copy, row r of a block is a slice (copied, not gathered per element)
        windows = sliding_window_view(np.tile(edge, 3)[::-1], w)  # windows[i, k] = ext[3n - 1 - i - k]
        for b, (shift, _) in enumerate(blocks):
            top = n - 1 + shift  # the window of rank 0 (3n - 1 - top = 2n - shift)
            out[:, b * w : (b + 1) * w] = windows[top - n + 1 : top + 1][::-1]
    for b, (_, reduces) in enumerate(blocks):
        red[:, b * w : (b + 1) * w] = reduces
    lo, hi = lo.ravel(), hi.ravel()  # the same arrays as source and destination ranges (read, never written)
    return MsgTable(src.ravel(), dst.ravel(), step.ravel(), lo, hi, lo, hi, red.ravel())


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
