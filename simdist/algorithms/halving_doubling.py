"""Recursive halving and doubling (Rabenseifner): log2 p steps whose messages halve (or double) in size."""

from __future__ import annotations

from simdist.algorithms.schedule import Msg, msg, split_offsets


def pow2_floor(n: int) -> int:
    """The largest power of two that is at most ``n``."""
    return 1 << (n.bit_length() - 1)


def reduce_scatter(p: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Recursive halving over a power-of-two group: rank r ends holding the reduced chunk r."""
    msgs = []
    depth = p.bit_length() - 1
    for r in range(p):
        lo, hi = 0, p
        for i in range(depth):
            d = p >> (i + 1)
            mid = (lo + hi) // 2
            if r & d:
                send, lo = (lo, mid), mid
            else:
                send, hi = (mid, hi), mid
            msgs.append(msg(r, r ^ d, step0 + i, off[send[0]], off[send[1]], "reduce"))
    return msgs


def all_gather(p: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Recursive doubling over a power-of-two group: rank r starts with chunk r."""
    msgs = []
    depth = p.bit_length() - 1
    for i in range(depth):
        d = 1 << i
        for r in range(p):
            base = r & ~(d - 1)
            msgs.append(msg(r, r ^ d, step0 + i, off[base], off[base + d], "copy"))
    return msgs


def all_reduce(n: int, numel: int) -> list[Msg]:
    """Rabenseifner all-reduce; a non-power-of-two group first folds its extra ranks into partners."""
    p = pow2_floor(n)
    extra = n - p
    depth = p.bit_length() - 1
    off = split_offsets(numel, p)
    msgs = [msg(p + e, e, 0, 0, numel, "reduce") for e in range(extra)]
    s0 = 1 if extra else 0
    msgs += reduce_scatter(p, off, s0)
    msgs += all_gather(p, off, s0 + depth)
    msgs += [msg(e, p + e, s0 + 2 * depth, 0, numel, "copy") for e in range(extra)]
    return msgs
