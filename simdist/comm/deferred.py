"""The data a burst of a collective's messages moves, recorded in order and applied at once, bit for bit.

While a :class:`~simdist.comm.lane.Lane` delivers messages one after another, no rank runs and nothing else
reads the buffers, so the data need only be right when the burst ends or hands over to other code. Each
message's data movement is recorded instead of done: its snapshot of the sender's elements, the receiver's
reduction or copy, and the elements a gloo-ordered result takes. :meth:`DeferredData.flush` then applies
them. A few operations are replayed one by one, exactly as they were recorded. Many are applied in levels,
each level a handful of gathers and scatters over all the touched buffers laid end to end, its reads before
its writes: a read goes at the level just after its range's last recorded write (so it sees that write and
no later one), and a write at the first level at which its payload has been read and its range's last write
is done (so it comes after that write and after every read of the range that preceded it in the record). Every element then goes through
the same operations on the same values as one by one, so the results are the same bits; levels are used only
where that argument holds: plain CPU buffers of one real element type, none sharing memory with another, and
on each buffer element ranges that are equal or disjoint (the ranges then name the data they depend on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from simdist.comm.ordering import GlooResult

#: fewer recorded operations than this are replayed one by one (levels cost a few gathers each)
BATCH_MIN_OPS = 64
#: touched buffers of more bytes than this in all are replayed one by one (levels copy them end to end once)
BATCH_MAX_BYTES = 256 * 1024 * 1024
#: operations of more elements than this on average are replayed one by one: levels gather and scatter element
#: by element through index arrays, which costs more than a slice's copy once a slice is a few hundred elements
BATCH_MAX_MEAN_ELEMENTS = 128

# a recorded operation: (what, buffer, lo, hi, slot or rank): SNAP takes buffer[lo:hi] into payload ``slot``,
# TAKE copies it into the gloo result's row of rank ``slot``, REDUCE / COPY land payload ``slot`` there
SNAP, TAKE, REDUCE, COPY = 0, 1, 2, 3


def _plain(bufs: list[torch.Tensor]) -> bool:
    """Whether ``bufs`` may be applied in levels: plain CPU tensors of one real type, no two sharing memory."""
    if not bufs:
        return False
    dtype = bufs[0].dtype
    extents = []
    for b in bufs:
        if type(b) is not torch.Tensor or b.device.type != "cpu" or b.dtype != dtype or b.is_complex():
            return False
        if b.dim() != 1 or not b.is_contiguous():
            return False
        start = b.data_ptr()
        extents.append((start, start + b.numel() * b.element_size()))
    extents.sort()
    return all(extents[i][1] <= extents[i + 1][0] for i in range(len(extents) - 1))


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The element indices of ranges ``[starts[i], starts[i] + counts[i])``, one after another."""
    if len(counts) == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]), dtype=np.int64)


class DeferredData:
    """Recorded data movement of one collective's messages over buffers ``bufs`` (flat 1-D tensors)."""

    def __init__(
        self,
        bufs: list[torch.Tensor],
        reduce: Callable[[torch.Tensor, torch.Tensor], object],
        order: GlooResult | None,
    ) -> None:
        self.bufs = bufs
        self.reduce = reduce
        self.order = order
        self.levels_allowed = _plain(bufs) and (order is None or order.scale == 1)
        #: the record, five integers an operation: (what, buffer, lo, hi, slot or rank)
        self.ops: list[int] = []
        #: (rank, lo, hi) the gloo result has taken already (taking them again takes nothing)
        self._taken: set[tuple[int, int, int]] = set()
        #: payloads by slot: each a box ``[tensor, slot]``, its tensor None until the flush takes it
        self.payloads: list[list] = []

    def box(self, tensor: torch.Tensor | None = None) -> list:
        """A payload's box: holding ``tensor`` (taken before the burst), or empty, to be recorded now."""
        box = [tensor, len(self.payloads)]
        self.payloads.append(box)
        return box

    def slot(self, box: list) -> int:
        """The slot of payload ``box`` in this burst's record (one taken earlier is carried in as it is)."""
        if box[0] is not None:
            box = self.box(box[0])
        return box[1]

    def snap(self, b: int, lo: int, hi: int, slot: int) -> None:
        """Record: payload ``slot`` is buffer ``b``'s ``[lo, hi)`` as it is now."""
        self.ops += (SNAP, b, lo, hi, slot)

    def take(self, r: int, b: int, lo: int, hi: int) -> None:
        """Record the gloo result's capture of rank ``r``'s (buffer ``b``) elements ``[lo, hi)`` now."""
        key = (r, lo, hi)
        if key in self._taken:
            return
        self._taken.add(key)
        order = self.order
        assert order is not None and order.rows is not None, (
            "a message reduced after every rank's part had completed"
        )
        for a, z in order.covered[r].take(lo, hi):
            self.ops += (TAKE, b, a, z, r)

    def land(self, kind: int, b: int, lo: int, hi: int, slot: int) -> None:
        """Record: payload ``slot`` is reduced into (REDUCE) or copied to (COPY) buffer ``b``'s ``[lo, hi)``."""
        self.ops += (kind, b, lo, hi, slot)

    def flush(self) -> None:
        """Apply everything recorded, and forget it."""
        ops, payloads = self.ops, self.payloads
        if not ops:
            self.payloads = []
            return
        self.ops, self.payloads = [], []
        if (
            len(ops) >= 5 * BATCH_MIN_OPS
            and self.levels_allowed
            and sum(ops[3::5]) - sum(ops[2::5]) <= BATCH_MAX_MEAN_ELEMENTS * (len(ops) // 5)
            and self._in_levels(ops, payloads)
        ):
            return
        self._one_by_one(ops, payloads)

    def _one_by_one(self, ops: list[int], payloads: list[list]) -> None:
        """Replay ``ops`` in their order (what the messages would have done as they went)."""
        bufs, reduce = self.bufs, self.reduce
        for what, b, lo, hi, slot in zip(*[iter(ops)] * 5):
            if what == SNAP:
                payloads[slot][0] = bufs[b][lo:hi].clone()
            elif what == TAKE:
                self.order.row[slot][lo:hi].copy_(bufs[b][lo:hi])  # type: ignore[union-attr]
            elif what == REDUCE:
                reduce(bufs[b][lo:hi], payloads[slot][0])
            else:
                bufs[b][lo:hi].copy_(payloads[slot][0])

    def _in_levels(self, ops: list[int], payloads: list[list]) -> bool:
        """Apply ``ops`` level by level; False (nothing done) where a buffer's ranges overlap partly."""
        bufs = self.bufs
        # per (buffer, lo): [hi, the level just after its last write]
        state: dict[tuple[int, int], list[int]] = {}
        slot_level = [0] * len(payloads)
        slot_start = [-1] * len(payloads)
        pos = 0
        levels = []
        for what, b, lo, hi, slot in zip(*[iter(ops)] * 5):
            key = (b, lo)
            st = state.get(key)
            if st is None:
                st = state[key] = [hi, 0]
            elif st[0] != hi:
                return False
            if what <= TAKE:
                level = st[1]
                if what == SNAP:
                    slot_level[slot] = level
                    slot_start[slot] = pos
                    pos += hi - lo
            else:
                if slot_start[slot] < 0:  # taken before the burst
                    slot_start[slot] = pos
                    pos += hi - lo
                level = max(slot_level[slot], st[1])
                st[1] = level + 1
            levels.append(level)
        per_buffer: dict[int, list[int]] = {}
        for b, lo in state:
            per_buffer.setdefault(b, []).append(lo)
        for b, los in per_buffer.items():  # equal or disjoint ranges on each buffer
            los.sort()
            if any(state[(b, los[i])][0] > los[i + 1] for i in range(len(los) - 1)):
                return False
        touched: dict[int, int] = {}  # buffer -> its offset in the work tensor
        width = 0
        for b in sorted(per_buffer):
            touched[b] = width
            width += bufs[b].numel()
        if width * bufs[0].element_size() > BATCH_MAX_BYTES:
            return False
        self._apply(ops, levels, payloads, touched, pos, slot_start)
        return True

    def _apply(
        self,
        ops: list[int],
        levels: list[int],
        payloads: list[list],
        touched: dict[int, int],
        pos: int,
        slot_start: list[int],
    ) -> None:
        """Run ``ops`` at their ``levels`` on the touched buffers laid end to end."""
        bufs = self.bufs
        work = torch.cat([bufs[b] for b in touched])
        carried = torch.empty(pos, dtype=work.dtype)
        for slot, (t, _) in enumerate(payloads):
            if t is not None:  # taken before the burst
                carried[slot_start[slot] : slot_start[slot] + t.numel()].copy_(t)
        arr = np.array(ops, dtype=np.int64).reshape(-1, 5)
        lv = np.array(levels, dtype=np.int64)
        what, b, lo, hi, slot = arr.T
        base = np.array([touched.get(i, 0) for i in range(len(bufs))], dtype=np.int64)
        at = base[b] + lo
        count = hi - lo
        starts = np.array(slot_start, dtype=np.int64)
        takes = what == TAKE
        pay_at = np.empty_like(lo)
        if takes.any():
            pay_at[takes] = slot[takes] * self.order.rows.shape[1] + lo[takes]  # type: ignore[union-attr]
        pay_at[~takes] = starts[slot[~takes]]
        nlevels = int(lv.max()) + 1
        groups = []
        for kind in (SNAP, TAKE, REDUCE, COPY):
            sel = np.nonzero(what == kind)[0]
            sel = sel[np.argsort(lv[sel], kind="stable")]
            cnt = count[sel]
            w_idx = torch.from_numpy(_expand(at[sel], cnt))
            p_idx = torch.from_numpy(_expand(pay_at[sel], cnt))
            bounds = np.concatenate([[0], np.cumsum(cnt)])[np.searchsorted(lv[sel], np.arange(nlevels + 1))]
            groups.append((w_idx, p_idx, bounds.tolist()))
        rows = self.order.rows.view(-1) if self.order is not None and self.order.rows is not None else None
        (sw, sp, sb), (tw, tp, tb), (rw, rp, rb), (cw, cp, cb) = groups
        reduce = self.reduce
        for k in range(nlevels):
            if sb[k] < sb[k + 1]:
                carried[sp[sb[k] : sb[k + 1]]] = work[sw[sb[k] : sb[k + 1]]]
            if tb[k] < tb[k + 1]:
                rows[tp[tb[k] : tb[k + 1]]] = work[tw[tb[k] : tb[k + 1]]]  # type: ignore[index]
            if rb[k] < rb[k + 1]:
                idx = rw[rb[k] : rb[k + 1]]
                acc = work[idx]
                reduce(acc, carried[rp[rb[k] : rb[k + 1]]])
                work[idx] = acc
            if cb[k] < cb[k + 1]:
                work[cw[cb[k] : cb[k + 1]]] = carried[cp[cb[k] : cb[k + 1]]]
        for b, off in touched.items():
            bufs[b].copy_(work[off : off + bufs[b].numel()])
        # payloads still in flight keep their data for a later burst
        snaps = what == SNAP
        size = np.zeros(len(payloads), dtype=np.int64)
        size[slot[snaps]] = count[snaps]
        landed = np.zeros(len(payloads), dtype=bool)
        landed[slot[(what == REDUCE) | (what == COPY)]] = True
        for s in slot[snaps][~landed[slot[snaps]]].tolist():
            payloads[s][0] = carried[slot_start[s] : slot_start[s] + int(size[s])]
