"""Collective algorithms as message schedules: who sends which element range to whom, at which step.

A schedule is data (like torch.distributed.pipelining's action lists): a list of :class:`Msg`. The executor
(:mod:`simdist.comm.executor`) turns it into timed transfers on the network. Ranks are group-local indices
0..n-1; element offsets index the flattened per-rank buffers. A rank issues its sends of step ``k`` as soon as
every message addressed to it with a step below ``k`` has arrived, so algorithms are asynchronous per rank,
as on real hardware, and their critical path gives the alpha-beta closed forms (Thakur, Rabenseifner &
Gropp 2005).

Each rank owns two flat buffers: ``src`` (read by its sends) and ``dst`` (written by arrivals). Every
algorithm except all-to-all uses one buffer for both.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: the algorithm names a cluster or a group may select
ALGORITHMS = ("ring", "tree", "direct", "rhd")

#: which algorithms implement which collective (first = preferred when several tie)
SUPPORTED: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "rhd", "direct"),
    "reduce_scatter": ("ring", "rhd", "direct"),
    "all_gather": ("ring", "rhd", "direct"),
    "broadcast": ("ring", "tree", "direct"),
    "reduce": ("ring", "tree", "direct"),
    "gather": ("tree", "direct"),
    "scatter": ("tree", "direct"),
    "all_to_all": ("direct",),
    "barrier": ("ring", "tree", "rhd", "direct"),
}

#: pipelined ring broadcast/reduce split a buffer into at most this many pieces; NCCL pipelines in
#: slices of a few hundred KiB, and more pieces than this only add simulated events, not insight
MAX_PIPELINE_CHUNKS = 32
PIPELINE_CHUNK_BYTES = 256 * 1024


class Msg(NamedTuple):
    """One message: ``src`` sends ``src_buf[slo:shi]`` to ``dst`` at its step ``step``.

    On arrival the payload is reduced into (``kind == "reduce"``) or copied to (``"copy"``)
    ``dst_buf[dlo:dhi]``.
    """

    src: int
    dst: int
    step: int
    slo: int
    shi: int
    dlo: int
    dhi: int
    kind: str


def split_offsets(numel: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` nearly equal pieces of ``numel`` elements (the first ``numel % parts`` are larger)."""
    base, rem = divmod(numel, parts)
    offs = [0]
    for i in range(parts):
        offs.append(offs[-1] + base + (1 if i < rem else 0))
    return offs


def pipeline_chunks(nbytes: int, numel: int) -> int:
    """Number of pieces a pipelined ring broadcast/reduce splits an ``nbytes`` buffer into."""
    want = max(1, math.ceil(nbytes / PIPELINE_CHUNK_BYTES))
    return max(1, min(MAX_PIPELINE_CHUNKS, want, numel))


def _m(src: int, dst: int, step: int, lo: int, hi: int, kind: str) -> Msg:
    return Msg(src, dst, step, lo, hi, lo, hi, kind)


# ----------------------------------------------------------------------------- ring
def ring_reduce_scatter(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Ring reduce-scatter: after n-1 steps rank r holds the reduced chunk r."""
    msgs = []
    for k in range(n - 1):
        for r in range(n):
            c = (r - k - 1) % n
            msgs.append(_m(r, (r + 1) % n, step0 + k, off[c], off[c + 1], "reduce"))
    return msgs


def ring_all_gather(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Ring all-gather: rank r starts with chunk r; after n-1 steps every rank has every chunk."""
    msgs = []
    for k in range(n - 1):
        for r in range(n):
            c = (r - k) % n
            msgs.append(_m(r, (r + 1) % n, step0 + k, off[c], off[c + 1], "copy"))
    return msgs


def ring_broadcast(n: int, numel: int, nbytes: int, root: int) -> list[Msg]:
    """Pipelined chain broadcast root -> root+1 -> ... in K pieces: (n-1) alpha + (n-2+K) beta m/K."""
    k_pieces = pipeline_chunks(nbytes, numel)
    off = split_offsets(numel, k_pieces)
    msgs = []
    for q in range(n - 1):  # position q along the chain sends piece c at step c + q
        src, dst = (root + q) % n, (root + q + 1) % n
        for c in range(k_pieces):
            msgs.append(_m(src, dst, c + q, off[c], off[c + 1], "copy"))
    return msgs


def ring_reduce(n: int, numel: int, nbytes: int, root: int) -> list[Msg]:
    """Pipelined chain reduce root+1 -> root+2 -> ... -> root in K pieces."""
    k_pieces = pipeline_chunks(nbytes, numel)
    off = split_offsets(numel, k_pieces)
    msgs = []
    for q in range(n - 1):
        src, dst = (root + 1 + q) % n, (root + 2 + q) % n
        for c in range(k_pieces):
            msgs.append(_m(src, dst, c + q, off[c], off[c + 1], "reduce"))
    return msgs


# ----------------------------------------------------------------------------- binomial tree
def _levels(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def tree_reduce(n: int, numel: int, root: int, step0: int = 0) -> list[Msg]:
    """Binomial-tree reduce of the whole buffer to ``root``: ceil(log2 n) steps of (alpha + beta*m)."""
    msgs = []
    for k in range(_levels(n)):
        d = 1 << k
        for v in range(d, n, 2 * d):
            msgs.append(_m((v + root) % n, (v - d + root) % n, step0 + k, 0, numel, "reduce"))
    return msgs


def tree_broadcast(n: int, numel: int, root: int, step0: int = 0) -> list[Msg]:
    """Binomial-tree broadcast of the whole buffer from ``root``: ceil(log2 n) steps."""
    msgs = []
    levels = _levels(n)
    for k in range(levels):
        d = 1 << (levels - 1 - k)
        for v in range(0, n, 2 * d):
            if v + d < n:
                msgs.append(_m((v + root) % n, (v + d + root) % n, step0 + k, 0, numel, "copy"))
    return msgs


def tree_gather(n: int, off: list[int]) -> list[Msg]:
    """Binomial gather in relative-rank order: the buffer holds chunk v of relative rank v (root = 0)."""
    msgs = []
    for k in range(_levels(n)):
        d = 1 << k
        for v in range(d, n, 2 * d):
            hi = min(v + d, n)
            msgs.append(_m(v, v - d, k, off[v], off[hi], "copy"))
    return msgs


def tree_scatter(n: int, off: list[int]) -> list[Msg]:
    """Binomial scatter in relative-rank order (root = 0 holds every chunk)."""
    msgs = []
    levels = _levels(n)
    for k in range(levels):
        d = 1 << (levels - 1 - k)
        for v in range(0, n, 2 * d):
            if v + d < n:
                hi = min(v + 2 * d, n)
                msgs.append(_m(v, v + d, k, off[v + d], off[hi], "copy"))
    return msgs


# ----------------------------------------------------------------------------- recursive halving/doubling
def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def rhd_reduce_scatter(p: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Recursive halving over a power-of-two group: rank r ends holding the reduced chunk r."""
    msgs = []
    levels = p.bit_length() - 1
    for r in range(p):
        lo, hi = 0, p
        for i in range(levels):
            d = p >> (i + 1)
            mid = (lo + hi) // 2
            if r & d:
                send, lo = (lo, mid), mid
            else:
                send, hi = (mid, hi), mid
            msgs.append(_m(r, r ^ d, step0 + i, off[send[0]], off[send[1]], "reduce"))
    return msgs


def rhd_all_gather(p: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Recursive doubling over a power-of-two group: rank r starts with chunk r."""
    msgs = []
    levels = p.bit_length() - 1
    for i in range(levels):
        d = 1 << i
        for r in range(p):
            base = r & ~(d - 1)
            msgs.append(_m(r, r ^ d, step0 + i, off[base], off[base + d], "copy"))
    return msgs


def rhd_all_reduce(n: int, numel: int) -> list[Msg]:
    """Rabenseifner all-reduce; a non-power-of-two group first folds its extra ranks into partners."""
    p = _pow2_floor(n)
    extra = n - p
    levels = p.bit_length() - 1
    off = split_offsets(numel, p)
    msgs = [_m(p + e, e, 0, 0, numel, "reduce") for e in range(extra)]
    s0 = 1 if extra else 0
    msgs += rhd_reduce_scatter(p, off, s0)
    msgs += rhd_all_gather(p, off, s0 + levels)
    msgs += [_m(e, p + e, s0 + 2 * levels, 0, numel, "copy") for e in range(extra)]
    return msgs


# ----------------------------------------------------------------------------- direct
def direct_reduce_scatter(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Every rank sends chunk j straight to rank j, which reduces it."""
    return [_m(r, j, step0, off[j], off[j + 1], "reduce") for r in range(n) for j in range(n) if j != r]


def direct_all_gather(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Every rank sends its chunk straight to every other rank."""
    return [_m(r, j, step0, off[r], off[r + 1], "copy") for r in range(n) for j in range(n) if j != r]


# ----------------------------------------------------------------------------- dispatch
def build(
    collective: str,
    algorithm: str,
    n: int,
    numel: int,
    itemsize: int,
    root: int = 0,
    split: list[int] | None = None,
    recv_split: list[int] | None = None,
) -> list[Msg]:
    """The schedule of ``collective`` with ``algorithm`` on ``n`` ranks for ``numel`` elements per buffer.

    For reduce-scatter, all-gather, gather and scatter ``numel`` is the size of the whole (n-chunk) buffer.
    For all-to-all, ``split[r][j]``/``recv_split`` give element counts (see :func:`all_to_all_direct`).
    """
    if algorithm not in SUPPORTED[collective]:
        raise ValueError(
            f"algorithm {algorithm!r} does not implement {collective}; choose one of {SUPPORTED[collective]}"
        )
    if n == 1:
        return []
    nbytes = numel * itemsize
    if collective in ("all_reduce", "barrier"):
        off = split_offsets(numel, n)
        if algorithm == "ring":
            return ring_reduce_scatter(n, off) + ring_all_gather(n, off, n - 1)
        if algorithm == "tree":
            return tree_reduce(n, numel, 0) + tree_broadcast(n, numel, 0, _levels(n))
        if algorithm == "rhd":
            return rhd_all_reduce(n, numel)
        return direct_reduce_scatter(n, off) + direct_all_gather(n, off, 1)
    if collective in ("reduce_scatter", "all_gather"):
        off = split_offsets(numel, n)
        if algorithm == "rhd" and n & (n - 1):
            algorithm = "ring"  # recursive halving/doubling needs a power of two; see effective_algorithm
        fns = {
            ("reduce_scatter", "ring"): ring_reduce_scatter,
            ("reduce_scatter", "rhd"): rhd_reduce_scatter,
            ("reduce_scatter", "direct"): direct_reduce_scatter,
            ("all_gather", "ring"): ring_all_gather,
            ("all_gather", "rhd"): rhd_all_gather,
            ("all_gather", "direct"): direct_all_gather,
        }
        return fns[(collective, algorithm)](n, off)
    if collective == "broadcast":
        if algorithm == "ring":
            return ring_broadcast(n, numel, nbytes, root)
        if algorithm == "tree":
            return tree_broadcast(n, numel, root)
        return [_m(root, j, 0, 0, numel, "copy") for j in range(n) if j != root]
    if collective == "reduce":
        if algorithm == "ring":
            return ring_reduce(n, numel, nbytes, root)
        if algorithm == "tree":
            return tree_reduce(n, numel, root)
        return [_m(j, root, 0, 0, numel, "reduce") for j in range(n) if j != root]
    off = split_offsets(numel, n)
    if collective == "gather":  # buffers in relative-rank order; the caller rotates
        if algorithm == "tree":
            return tree_gather(n, off)
        return [_m(v, 0, 0, off[v], off[v + 1], "copy") for v in range(1, n)]
    if collective == "scatter":
        if algorithm == "tree":
            return tree_scatter(n, off)
        return [_m(0, v, 0, off[v], off[v + 1], "copy") for v in range(1, n)]
    assert collective == "all_to_all" and split is not None and recv_split is not None
    return all_to_all_direct(n, split, recv_split)


def all_to_all_direct(n: int, split: list[list[int]], recv_split: list[list[int]]) -> list[Msg]:
    """Pairwise exchange: rank r's input block j goes to rank j's output block r.

    ``split[r]`` are rank r's input block sizes (elements), ``recv_split[j]`` rank j's output block sizes.
    Self-blocks are copied locally by the caller.
    """
    msgs = []
    in_off = [split_offsets_from_sizes(s) for s in split]
    out_off = [split_offsets_from_sizes(s) for s in recv_split]
    for r in range(n):
        for j in range(n):
            if j != r:
                msgs.append(
                    Msg(r, j, 0, in_off[r][j], in_off[r][j + 1], out_off[j][r], out_off[j][r + 1], "copy")
                )
    return msgs


def split_offsets_from_sizes(sizes: list[int]) -> list[int]:
    """Prefix sums ``[0, s0, s0+s1, ...]``."""
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


def effective_algorithm(collective: str, algorithm: str, n: int) -> str:
    """The algorithm that really runs (recursive halving/doubling falls back to ring off powers of two)."""
    if collective in ("reduce_scatter", "all_gather") and algorithm == "rhd" and n & (n - 1):
        return "ring"
    return algorithm


def estimate(
    collective: str, algorithm: str, n: int, nbytes: int, alpha: float, beta: float, numel: int | None = None
) -> float:
    """Closed-form alpha-beta time (seconds) of an uncontended run; ``beta`` is seconds per byte.

    Used to pick an algorithm under ``"auto"`` and by the tests as the oracle for simulated times.
    """
    if n == 1:
        return 0.0
    lg = _levels(n)
    m = nbytes
    frac = (n - 1) / n
    if collective in ("all_reduce", "barrier"):
        if algorithm == "ring":
            return 2 * (n - 1) * alpha + 2 * frac * m * beta
        if algorithm == "tree":
            return 2 * lg * (alpha + m * beta)
        if algorithm == "rhd":
            p = _pow2_floor(n)
            fold = 2 * (alpha + m * beta) if p != n else 0.0
            return 2 * (p.bit_length() - 1) * alpha + 2 * (p - 1) / p * m * beta + fold
        return 2 * alpha + 2 * frac * m * beta  # direct: n-1 chunks of m/n leave each NIC per phase
    if collective in ("reduce_scatter", "all_gather"):
        algorithm = effective_algorithm(collective, algorithm, n)
        if algorithm == "ring":
            return (n - 1) * alpha + frac * m * beta
        if algorithm == "rhd":
            return lg * alpha + frac * m * beta
        return alpha + frac * m * beta
    if collective in ("broadcast", "reduce"):
        if algorithm == "ring":
            # a chain of n-1 links carrying K pieces back to back: the latency is paid once per hop and
            # the last piece leaves the root after K piece-times, then crosses n-2 more links
            k = pipeline_chunks(m, numel if numel is not None else max(1, m))
            return (n - 1) * alpha + (n - 2 + k) * m / k * beta
        if algorithm == "tree":
            return lg * (alpha + m * beta)
        return alpha + (n - 1) * m * beta
    if collective in ("gather", "scatter"):
        if algorithm == "tree":
            return lg * alpha + frac * m * beta
        return alpha + frac * m * beta
    return alpha + frac * m * beta  # all_to_all, direct


def choose(
    collective: str, n: int, nbytes: int, near: tuple[float, float], far: tuple[float, float]
) -> str:
    """The supported algorithm with the smallest closed-form estimate (ties: order of :data:`SUPPORTED`).

    ``near`` is the slowest (alpha, beta) between ring neighbours, ``far`` between the farthest-apart ranks:
    ring algorithms only talk to neighbours (and run at the pace of the slowest hop), the others across the
    group.
    """
    best, best_t = None, math.inf
    for algo in SUPPORTED[collective]:
        if algo == "direct" and collective in ("all_reduce", "barrier", "reduce_scatter", "all_gather") and n > 2:
            # every rank sends to every other at once: the links into each rank are contended in a way the
            # closed form does not see (and it is n^2 messages); the other algorithms are never far behind
            continue
        alpha, beta = near if algo == "ring" else far
        t = estimate(collective, algo, n, nbytes, alpha, beta)
        if t < best_t * (1 - 1e-9):
            best, best_t = algo, t
    assert best is not None
    return best
