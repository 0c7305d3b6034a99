"""Binomial-tree algorithms: ceil(log2 n) steps, each moving the whole buffer (or a growing part of it)."""

from __future__ import annotations

import math

from simdist.algorithms.schedule import Msg, msg


def levels(n: int) -> int:
    """ceil(log2 n): the depth of a binomial tree over ``n`` ranks (0 for one rank)."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def reduce(n: int, numel: int, root: int, step0: int = 0) -> list[Msg]:
    """The whole buffer reduced to ``root``: ceil(log2 n) steps of (alpha + beta*m)."""
    msgs = []
    for k in range(levels(n)):
        d = 1 << k
        for v in range(d, n, 2 * d):
            msgs.append(msg((v + root) % n, (v - d + root) % n, step0 + k, 0, numel, "reduce"))
    return msgs


def broadcast(n: int, numel: int, root: int, step0: int = 0) -> list[Msg]:
    """The whole buffer sent from ``root``: ceil(log2 n) steps."""
    msgs = []
    depth = levels(n)
    for k in range(depth):
        d = 1 << (depth - 1 - k)
        for v in range(0, n, 2 * d):
            if v + d < n:
                msgs.append(msg((v + root) % n, (v + d + root) % n, step0 + k, 0, numel, "copy"))
    return msgs


def all_reduce(n: int, numel: int) -> list[Msg]:
    """Reduce to rank 0, then broadcast from it."""
    return reduce(n, numel, 0) + broadcast(n, numel, 0, levels(n))


def gather(n: int, off: list[int]) -> list[Msg]:
    """Binomial gather in relative-rank order: the buffer holds chunk v of relative rank v (root = 0)."""
    msgs = []
    for k in range(levels(n)):
        d = 1 << k
        for v in range(d, n, 2 * d):
            hi = min(v + d, n)
            msgs.append(msg(v, v - d, k, off[v], off[hi], "copy"))
    return msgs


def scatter(n: int, off: list[int]) -> list[Msg]:
    """Binomial scatter in relative-rank order (root = 0 holds every chunk)."""
    msgs = []
    depth = levels(n)
    for k in range(depth):
        d = 1 << (depth - 1 - k)
        for v in range(0, n, 2 * d):
            if v + d < n:
                hi = min(v + 2 * d, n)
                msgs.append(msg(v, v + d, k, off[v + d], off[hi], "copy"))
    return msgs
