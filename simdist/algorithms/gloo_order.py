"""gloo's reduction order: which rank's value is added to which partial sum, for every element.

ProcessGroupGloo reduces on the CPU with one algorithm, gloo's ring (``gloo/allreduce.cc`` and
``gloo/reduce.cc``): the buffer is cut into ``n`` blocks, and block ``b`` starts at rank ``b - 1`` and travels
down the ring (rank ``r`` receives from ``r + 1`` and sends to ``r - 1``), each rank applying
``fn(its own value, what arrived)``, until it ends, complete, at rank ``b``. So an element of block ``b`` is
``x[b] + (x[b+1] + (... + (x[b-2] + x[b-1])))``, indices modulo ``n``. Which block an element falls in follows
from gloo's segments: the buffer is cut into ``S`` segments of ``ceil(numel / S)`` elements, ``S / n`` to a
block, with ``S`` the smallest multiple of ``n`` that is at least ``2n`` and at least the number of 1 MiB
segments the buffer needs (the reduce caps segments at ``ceil(numel / 2n)`` elements first).

torch runs every reducing collective on it (torch 2.13, checked against real gloo processes bit for bit):
``all_reduce`` and ``all_reduce_coalesced`` (the tensors flattened into one buffer) as one all-reduce;
``reduce`` as gloo's reduce; ``reduce_scatter_tensor`` as an all-reduce of the whole input, of which rank
``r`` keeps chunk ``r``; ``reduce_scatter`` as one all-reduce per input of the list, rank ``r`` keeping the
result of input ``r``; ``reduce_scatter_tensor`` of several tensors at once as one all-reduce per tensor.
Complex tensors are reduced as their real views. The elements ``fn`` combines are ``(own, arrived)``: for
SUM, AVG and PRODUCT that only fixes the order of the rounding, and for MIN and MAX it decides what a NaN or
a signed zero gives (``std::min(a, b)`` is ``b < a ? b : a``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: gloo's ``kMaxSegmentSize``: the largest send or receive its ring algorithms issue, in bytes
MAX_SEGMENT_BYTES = 1 << 20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(value: int, multiple: int) -> int:
    return _cdiv(value, multiple) * multiple


def all_reduce_block(n: int, numel: int, itemsize: int) -> int:
    """Elements per block of gloo's ring all-reduce of ``numel`` elements of ``itemsize`` bytes on ``n`` ranks."""
    max_segment = itemsize * max(1, MAX_SEGMENT_BYTES // itemsize)
    segments = _round_up(max(_cdiv(numel * itemsize, max_segment), 2 * n), n)
    return segments // n * _cdiv(numel, segments)


def reduce_block(n: int, numel: int, itemsize: int) -> int:
    """Elements per block of gloo's ring reduce of ``numel`` elements of ``itemsize`` bytes on ``n`` ranks."""
    segment = max(1, min(_cdiv(numel, 2 * n), MAX_SEGMENT_BYTES // itemsize))
    segments = _round_up(max(_cdiv(numel, segment), 2 * n), n)
    return segments // n * segment


@dataclass(frozen=True)
class Span:
    """Elements ``[lo, hi)`` of a rank's flat buffer are elements ``[base, base + hi - lo)`` of one gloo ring
    whose blocks hold ``block`` elements each (counted in real elements: a complex tensor's real view)."""

    lo: int
    hi: int
    base: int
    block: int


def chain(n: int, block_index: int) -> list[int]:
    """The ranks whose values block ``block_index`` adds, first to last: ``b-1, b-2, ..., b`` modulo ``n``."""
    return [(block_index - k) % n for k in range(1, n + 1)]


#: gloo's ``fn(out=acc, a=own, b=acc)`` done in place on ``acc``: ``step(acc, own)``
Step = Callable[[torch.Tensor, torch.Tensor], object]


def ring_reduce(rows: torch.Tensor, span: Span, step: Step) -> torch.Tensor:
    """The elements of ``span`` reduced in gloo's order; ``rows[q]`` is rank q's flat contribution.

    ``rows`` is one contiguous ``(n, numel)`` tensor, so the blocks a span covers entirely are reduced
    together: at step ``k`` block ``b`` takes rank ``(b - k) % n``, and those rows' blocks lie at a constant
    stride (``numel + block``) in memory until the rank index wraps around, two strided views per step.
    """
    n = rows.shape[0]
    out = torch.empty(span.hi - span.lo, dtype=rows.dtype, device=rows.device)
    g_lo, g_hi, blk = span.base, span.base + span.hi - span.lo, span.block
    if g_hi <= g_lo:
        return out
    first, last = g_lo // blk, (g_hi - 1) // blk  # the blocks the span touches
    full_lo = first if g_lo % blk == 0 else first + 1
    full_hi = last + 1 if g_hi % blk == 0 else last  # blocks full_lo..full_hi-1 lie entirely inside it
    for b in [b for b in dict.fromkeys((first, last)) if not full_lo <= b < full_hi]:  # partial blocks
        a, z = max(g_lo, b * blk), min(g_hi, (b + 1) * blk)
        order = chain(n, b)
        dst = out[a - g_lo : z - g_lo]
        lo, hi = span.lo + a - g_lo, span.lo + z - g_lo
        dst.copy_(rows[order[0], lo:hi])
        for q in order[1:]:
            step(dst, rows[q, lo:hi])
    if full_hi > full_lo:
        count = full_hi - full_lo
        lo = span.lo + full_lo * blk - g_lo  # buffer element where block full_lo starts
        acc = out[lo - span.lo : lo - span.lo + count * blk].view(count, blk)
        for k in range(1, n + 1):
            for c0, c1, view in _diagonal(rows, lo, blk, count, (full_lo - k) % n):
                if k == 1:
                    acc[c0:c1].copy_(view)
                else:
                    step(acc[c0:c1], view)
    return out


def _diagonal(
    rows: torch.Tensor, lo: int, blk: int, count: int, r0: int
) -> list[tuple[int, int, torch.Tensor]]:
    """Block ``c`` (``0 <= c < count``, starting at element ``lo``) of rank ``(r0 + c) % n``, as at most two
    strided views ``(c0, c1, view)`` of blocks ``c0..c1-1``: one until the rank index wraps, one after."""
    n, numel = rows.shape
    assert count <= n, f"{count} blocks in a ring of {n} ranks"  # gloo's ring has one block per rank
    split = min(count, n - r0)
    parts = [(0, split, r0), (split, count, 0)]
    return [
        (
            c0,
            c1,
            rows.as_strided(
                (c1 - c0, blk), (numel + blk, 1), rows.storage_offset() + r * numel + lo + c0 * blk
            ),
        )
        for c0, c1, r in parts
        if c1 > c0
    ]


def real_elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` (flat) as the elements gloo reduces: its real view for a complex tensor."""
    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t
