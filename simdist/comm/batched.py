"""A collective's messages run in arrays, a group of simultaneous messages at a time: the same run, bit for bit.

One message at a time (:mod:`simdist.comm.messages` on a :class:`~simdist.comm.lane.Lane`) costs some ten Python
calls a message. A large ring all-reduce is millions of messages, most of them due in groups: every rank's
step-``k`` message arrives at the same simulated time. :class:`BatchedRun` keeps a schedule's messages in NumPy
arrays and handles such a group in a few dozen array operations, with the outcome of handling its messages one
after another in simpy's order:

- **Order.** Messages in flight wait in entries keyed as simpy would key them (arrival time, then the id of the
  event simpy would have scheduled, taken from simpy's own counter in send order). A group is every message due
  at the earliest time, before simpy's next event, taken in id order. What a message's arrival sends arrives
  later than now or, at the same time, under a larger id: after the whole group, where simpy would put it too.
- **Independence.** A group is handled at once only as far as its receivers are distinct ranks and none of them
  finishes its part; the rest goes one message at a time (a finishing rank completes its work, which schedules
  simpy events and may run callbacks). Distinct receivers write distinct ranks' buffers, and each sends only
  from its own, so landing every message before taking any snapshot reads and writes what the interleaved
  order does. Sends of a group whose routes share a link reserve it one after another: they are split where a
  link repeats, and each part reserves disjoint links, which is order-free.
- **Arithmetic.** Times are computed with the same float operations in the same order as
  :meth:`simdist.network.links.Network.send` (``start + bytes * inv_bw``, ``now + ((leave + lat) - now)``);
  data moves through the same reduction on the same values (torch's own, on gathered elements).

Where data moves, the buffers are addressed together as one NumPy view of the process's memory spanning them
(plain contiguous CPU buffers of one element type, each rank's memory apart from every other rank's); meta
buffers (timing-only runs) move nothing. A schedule that does not fit these conditions, or a run that may be
perturbed or faulty, keeps the one-message path (see :func:`batched_allowed`). A ring's steps, all of whose
messages arrive together, run in lockstep (:mod:`simdist.comm.lockstep`).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from simpy.core import NORMAL
from simpy.events import Event

from simdist.comm import lockstep
from simdist.comm.lane import proxy
from simdist.trace.trace import Message

if TYPE_CHECKING:
    from simdist.comm.messages import ScheduleRun

#: whether schedules may run batched at all (False: one message at a time, as a reference to compare)
ENABLED = True
#: schedules of fewer messages than this keep the one-message path (setting up arrays costs more)
MIN_MESSAGES = 4096
#: the dense tables of a batched schedule (ranks x steps counters) hold at most this many entries
MAX_TABLE = 1 << 26

_RAW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
#: the largest array NumPy makes, in bytes, a view's nominal size included: a window over memory that spans
#: buffers far apart in the address space (one in the heap, one mapped high) can exceed it (:class:`_Rows`)
_MAX_VIEW_BYTES = int(np.iinfo(np.intp).max)


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices of ranges ``[starts[i], starts[i] + counts[i])``, one after another."""
    k = len(counts)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    c = int(counts[0])
    if k == 1 or (counts == c).all():  # equal ranges (a ring's chunks): a broadcast sum
        if c == 1:
            return starts  # one index each: the starts themselves (callers only read what this returns)
        return (starts[:, None] + np.arange(c, dtype=np.int64)).ravel()
    ends = counts.cumsum()
    return (starts - (ends - counts)).repeat(counts) + np.arange(int(ends[-1]), dtype=np.int64)


class _Rows:
    """Rows of ``c`` elements of ``flat`` starting at any element, read and written by their starts as a sliding
    window view's rows are (``rows[starts]``, ``rows[starts] = values``), through element indices: for memory
    whose window NumPy refuses to make (its nominal size, rows times elements, over :data:`_MAX_VIEW_BYTES`)."""

    def __init__(self, flat: np.ndarray, c: int) -> None:
        self.flat, self.c = flat, c

    def _indices(self, starts: np.ndarray) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        return _expand(starts, np.full(len(starts), self.c, dtype=np.int64))

    def __getitem__(self, starts: np.ndarray) -> np.ndarray:
        return self.flat[self._indices(starts)].reshape(-1, self.c)

    def __setitem__(self, starts: np.ndarray, values: np.ndarray) -> None:
        self.flat[self._indices(starts)] = np.asarray(values).reshape(-1)


def _strided_runs(links: np.ndarray, most: int = 4) -> list[tuple[int, int, slice]] | None:
    """``links`` as at most ``most`` runs of evenly increasing values over disjoint ranges: (from, to, the slice
    of link ids), or None (a ring's links come as one or two such runs, rotated by the step)."""
    k = len(links)
    if k < 8:
        return None
    gaps = links[1:] - links[:-1]
    cuts = ((gaps[1:] != gaps[:-1]).nonzero()[0] + 1).tolist()  # where the gap changes
    if len(cuts) > 2 * most:
        return None
    runs, a, c = [], 0, 0
    while a < k:
        if len(runs) == most:
            return None
        b = a + 1
        gap = int(gaps[a]) if b < k else 1
        if gap > 0 and b < k:
            while c < len(cuts) and cuts[c] <= a:
                c += 1
            b = cuts[c] + 1 if c < len(cuts) else k
        else:
            gap = 1  # one link alone (the last, or one before a step down)
        first = int(links[a])
        runs.append((a, b, slice(first, first + (b - a) * gap, gap)))
        a = b
    spans = sorted((r[2].start, r[2].stop - r[2].step) for r in runs)  # each run's first and last link
    if any(spans[i][1] >= spans[i + 1][0] for i in range(len(spans) - 1)):
        return None  # runs that interleave might share a link
    return runs


def _first_repeat(values: np.ndarray) -> int:
    """The position of the first value that occurred before it (``len(values)``: none does)."""
    order = values.argsort(kind="stable")
    ordered = values[order]
    repeat = ordered[1:] == ordered[:-1]
    if not repeat.any():
        return len(values)
    return int(order[1:][repeat].min())


class Columns:
    """A schedule's messages as columns (group ranks, steps, element ranges, whether each reduces)."""

    def __init__(self, msgs: Sequence[Any]) -> None:
        table = getattr(msgs, "columns", None)
        if table is not None:  # a schedule built as arrays (simdist.algorithms.schedule.MsgTable)
            self.src, self.dst, self.step, self.slo, self.shi, self.dlo, self.dhi, self.red = table()
            return
        cols = list(zip(*msgs)) if len(msgs) else [()] * 8
        self.src, self.dst, self.step, self.slo, self.shi, self.dlo, self.dhi = (
            np.array(c, dtype=np.int64) for c in cols[:7]
        )
        self.red = np.array([k == "reduce" for k in cols[7]], dtype=bool)


def _raw_view(t: torch.Tensor) -> np.ndarray:
    """The elements of contiguous CPU tensor ``t`` as a flat NumPy array of integers of their size (the same
    memory; not ``Tensor.numpy``, which rank code's patches count as a read by the host)."""
    size = t.element_size()
    raw = (ctypes.c_byte * max(t.numel() * size, size)).from_address(t.data_ptr())
    return np.frombuffer(raw, dtype=_RAW[size])[: t.numel()]


class _Memory:
    """Every rank's buffers as element offsets into one NumPy view of the memory spanning them."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        t0 = dst[0]
        self.dtype = t0.dtype
        size = t0.element_size()
        ptrs = [b.data_ptr() for b in (*src, *dst)]
        base = min(ptrs)
        end = max(p + b.numel() * size for p, b in zip(ptrs, (*src, *dst)))
        raw = (ctypes.c_byte * max(end - base, size)).from_address(base)
        self.mem = np.frombuffer(raw, dtype=_RAW[size])
        self.src = np.array([(b.data_ptr() - base) // size for b in src], dtype=np.int64)
        self.dst = np.array([(b.data_ptr() - base) // size for b in dst], dtype=np.int64)
        #: the tensors, kept alive while the view is used
        self.keep = (src, dst)

    def tensor(self, raw: np.ndarray) -> torch.Tensor:
        """Raw elements as a tensor of the buffers' type (the same memory)."""
        return torch.from_numpy(raw).view(self.dtype)


def _memory_for(src: list[torch.Tensor | None], dst: list[torch.Tensor | None]) -> _Memory | None | str:
    """How the data of buffers ``src``/``dst`` moves in arrays: a :class:`_Memory`, None (meta buffers: no
    data), or the reason it cannot."""
    bufs = [*src, *dst]
    if any(b is None for b in bufs):
        return "a rank without a buffer"
    if all(b.is_meta for b in bufs):  # type: ignore[union-attr]
        return None
    dtype = bufs[0].dtype  # type: ignore[union-attr]
    size = bufs[0].element_size()  # type: ignore[union-attr]
    if size not in _RAW:
        return f"elements of {size} bytes"
    extents = []
    for r, b in enumerate([*src, *dst]):
        if type(b) is not torch.Tensor or b.device.type != "cpu" or b.dtype != dtype:
            return "buffers that are not plain CPU tensors of one type"
        if b.dim() != 1 or not b.is_contiguous() or b.data_ptr() % size:
            return "buffers that are not flat and aligned"
        start = b.data_ptr()
        extents.append((start, start + b.numel() * size, r % len(src)))
    extents.sort()
    end, owner = -1, -1  # the memory extents seen so far that overlap one another: where they end, whose
    for start, stop, r in extents:
        if start < end:
            if r != owner:
                return "two ranks' buffers sharing memory"
            end = max(end, stop)
        else:
            end, owner = stop, r
    return _Memory(src, dst)  # type: ignore[arg-type]


def batched_allowed(run: ScheduleRun, cols: Columns) -> str | None:
    """Why ``run`` cannot run batched (None: it can)."""
    if not ENABLED:
        return "disabled"
    if run.lane is None:
        return "no lane (a perturbed or faulty run)"
    if len(cols.src) < MIN_MESSAGES:
        return "a small schedule"
    if run.reduce_cost or run.local != (0.0, 0.0):
        return "gloo's model (reductions and copies on the rank's thread)"
    if run.order is not None and run.order.scale != 1:
        return "complex elements in gloo's order"
    if (cols.src == cols.dst).any():
        return "a rank sending to itself"
    n = run.n
    if n * (run.nsteps + 1) > MAX_TABLE:
        return "a schedule too large for its tables"
    return None


class _Static:
    """What a batched schedule's arrays hold that depends only on the schedule, its group and the network's routes
    (not on the buffers, nor on how far it has run): shared by the runs of one schedule in a simulation, as a
    training loop's all-reduce is the same every step. Read only."""

    def __init__(self, run: ScheduleRun, cols: Columns) -> None:
        n, S = run.n, run.nsteps  # n ranks, S steps
        self.n = n
        key = cols.src * (S + 1)
        key += cols.step
        if not (key[1:] >= key[:-1]).all():  # by sender, then step, then the schedule's order
            order = np.argsort(key, kind="stable")
            key = key[order]
            cols.src, cols.dst, cols.step, cols.slo, cols.shi, cols.dlo, cols.dhi, cols.red = (
                c[order]
                for c in (cols.src, cols.dst, cols.step, cols.slo, cols.shi, cols.dlo, cols.dhi, cols.red)
            )
        self.key = key
        self.src, self.dst, self.step, self.slo, self.dlo, self.red = (
            cols.src,
            cols.dst,
            cols.step,
            cols.slo,
            cols.dlo,
            cols.red,
        )
        self.count = cols.shi - cols.slo
        self.range_lo = self.range_hi = self.range_of = self.send_takes = self.bounds = None
        self.nested = False
        if run.order is not None:
            self._ranges(cols)
        #: per message: its bytes (as an integer, then as a float: exact), times its seconds per byte in _routes
        self.hold = np.multiply(self.count, run.itemsize, dtype=np.float64)
        self.cursor = np.searchsorted(self.key, np.arange(n, dtype=np.int64) * (S + 1))
        #: by (rank, step) flattened: how many messages come before the rank's messages of later steps
        self.send_end = np.bincount(self.key, minlength=n * (S + 1))
        np.cumsum(self.send_end, out=self.send_end)
        #: by (rank, step) flattened: how many messages the rank awaits at that step
        self.missing = np.bincount(cols.dst * (S + 1) + cols.step, minlength=n * (S + 1)).astype(np.int32)
        self.remaining = np.bincount(cols.dst, minlength=n).astype(np.int64)
        first = np.argmax(self.missing.reshape(n, S + 1) > 0, axis=1)
        self.first_missing = np.where(self.remaining > 0, first, S).astype(np.int64)
        self._routes(run)
        #: what every step holds where the steps are a ring's (see :mod:`simdist.comm.lockstep`), else None
        self.lockstep = lockstep.plan(
            n,
            S,
            self.src,
            self.dst,
            self.step,
            self.count,
            self.red,
            self.hold,
            self.link,
            self.lat,
            None if run.order is None else self.send_takes,
        )
        for value in self.__dict__.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False

    def _routes(self, run: ScheduleRun) -> None:
        """Each message's route: its one link where every route is one link (a ring's neighbours), else the
        number of its (sender, receiver) pair, whose row of link indices (padded with its first link) ``plinks``
        holds; its latency and how long it holds its links (one number each where all routes have the same)."""
        n = run.n
        pair = self.src * n
        pair += self.dst
        if n * n <= MAX_TABLE:
            mark = np.zeros(n * n, dtype=bool)
            mark[pair] = True
            pairs = np.flatnonzero(mark)

            def per_message(values: np.ndarray) -> np.ndarray:
                table = np.empty(n * n, dtype=values.dtype)
                table[pairs] = values
                return table[pair]

        else:
            pairs, inverse = np.unique(pair, return_inverse=True)

            def per_message(values: np.ndarray) -> np.ndarray:
                return values[inverse]

        g = run.global_ranks
        network = run.sim.network
        routes = [network._route(g[p // n], g[p % n]) for p in pairs.tolist()]
        width = max(len(r[0]) for r in routes)
        links = np.array([r[0] + (r[0][0],) * (width - len(r[0])) for r in routes], dtype=np.int64)
        self.plinks = links
        self.pcount = np.array([len(r[0]) for r in routes], dtype=np.int64)
        self.pvalid = np.arange(width)[None, :] < self.pcount[:, None]
        if run.pace is not None:
            lat, inv = run.pace
            plat = np.full(len(routes), lat, dtype=np.float64)
            pinv = np.full(len(routes), inv, dtype=np.float64)
        else:
            plat = np.array([r[2] for r in routes], dtype=np.float64)
            pinv = np.array([r[1] for r in routes], dtype=np.float64)
        one_lat, one_inv = bool((plat == plat[0]).all()), bool((pinv == pinv[0]).all())
        #: per message: its one link, where every route is one link; else None
        self.link = per_message(links[:, 0]) if width == 1 else None
        #: per message: the number of its pair (None where its one link says all: one link, latency and speed)
        self.pair = None if width == 1 and one_lat and one_inv else per_message(np.arange(len(pairs)))
        #: per message: its latency (one number where every route has the same: a uniform ring or switch), and how
        #: long it holds its links (bytes x seconds per byte, as Network.send)
        self.lat = float(plat[0]) if one_lat else plat[self.pair]
        self.hold *= float(pinv[0]) if one_inv else pinv[self.pair]

    def _ranges(self, cols: Columns) -> None:
        """Element ranges a reduction takes a rank's contribution in, numbered (gloo's order tracks them)."""
        red = cols.red
        if cols.dlo is cols.slo and cols.dhi is cols.shi:
            los, his = cols.slo[red], cols.shi[red]
        else:
            los = np.concatenate([cols.slo[red], cols.dlo[red]])
            his = np.concatenate([cols.shi[red], cols.dhi[red]])
        some = his > los  # an empty range takes nothing (and marks nothing a result depends on)
        if not some.all():
            los, his = los[some], his[some]
        top = int(his.max()) + 1 if len(his) else 0
        #: by element offset: the number of the range starting there (where a table that size is cheap)
        self.range_of: np.ndarray | None = None
        # offsets within one buffer, as dense as the ranges themselves: mark them (cheaper than sorting millions)
        if top <= max(1 << 16, 4 * len(los)):
            hi_of = np.zeros(top, dtype=np.int64)
            hi_of[los] = his  # any writer's: ranges that share a start but not an end are nested (below)
            u_lo = np.flatnonzero(hi_of)
            u_hi = hi_of[u_lo]
            clash = (his != hi_of[los]).any()
            self.range_of = np.zeros(top, dtype=np.int32)
            self.range_of[u_lo] = np.arange(len(u_lo))
        else:
            u_lo, first = np.unique(los, return_index=True)
            u_hi = his[first]
            clash = (his != u_hi[np.searchsorted(u_lo, los)]).any()
        #: whether ranges overlap partly (halving-doubling's halves, quarters, ...): then the numbered ranges are the
        #: segments between any two consecutive bounds of them, and a message's range one or more of those
        self.nested = bool(clash or (u_hi[:-1] > u_lo[1:]).any())
        if self.nested:
            bounds = np.unique(np.concatenate([los, his]))
            u_lo, u_hi = bounds[:-1], bounds[1:]
            if self.range_of is not None:  # every bound numbered, the last too (where the last segment ends)
                self.range_of[bounds] = np.arange(len(bounds))
        self.range_lo, self.range_hi = u_lo, u_hi
        #: the ranges' bounds, ascending (where they overlap partly): what numbers an offset without the table
        self.bounds = np.append(u_lo, u_hi[-1:]) if self.nested else None
        #: per message: whether its sender may take elements as it sends (a reduction's range: :meth:`_take` keeps
        #: those it has not taken before)
        self.send_takes = self.red & (self.count > 0)


def _static_for(run: ScheduleRun, cols: Columns) -> _Static:
    """The shared part of ``run``'s arrays: built, or found where this simulation ran the same schedule on the same
    group before (compared column by column, exactly)."""
    memo: dict = run.sim.network.__dict__.setdefault("_batched_static", {})
    key = (
        run.n,
        run.nsteps,
        len(cols.src),
        run.itemsize,
        run.pace,
        tuple(run.global_ranks),
        run.order is not None,
    )
    raw = (cols.src, cols.dst, cols.step, cols.slo, cols.shi, cols.dlo, cols.dhi, cols.red)
    known = memo.get(key)
    if known is not None and all(np.array_equal(a, b) for a, b in zip(known[0], raw)):
        return known[1]
    static = _Static(run, cols)
    memo.pop(key, None)
    while memo and sum(len(v[0][0]) for v in memo.values()) + len(cols.src) > MEMO_MESSAGES:
        memo.pop(next(iter(memo)))  # the schedule run longest ago
    memo[key] = (raw, static)
    return static


#: the messages of the schedules whose shared arrays a simulation keeps (the collectives a training step repeats;
#: some 150 bytes a message)
MEMO_MESSAGES = 1 << 23


class BatchedRun:
    """The arrays and the in-flight queue of one :class:`~simdist.comm.messages.ScheduleRun` run batched."""

    def __init__(self, run: ScheduleRun, cols: Columns, memory: _Memory | None) -> None:
        self.run = run
        self.env = run.sim.env
        self.network = run.sim.network
        self.memory = memory
        n, S = run.n, run.nsteps  # n ranks, S steps
        self.n, self.S = n, S
        static = _static_for(run, cols)
        self.__dict__.update(static.__dict__)
        # what a run changes, its own
        self.cursor = static.cursor.copy()
        self.missing = static.missing.copy()
        self.remaining = static.remaining.copy()
        self.first_missing = static.first_missing.copy()
        #: ``missing`` as a table: a rank's row, a step's column
        self._miss2d = self.missing.reshape(n, S + 1)
        #: the offsets of a whole step's payload rows, one per rank (shared by the entries that hold such rows)
        self._iota = np.arange(n)
        self._iota.flags.writeable = False
        #: the per-message columns a lockstep step reads, a step at a time (see :mod:`simdist.comm.lockstep`)
        self._step_rows: dict | None = None
        self._started = False
        #: the memory as rows of equal chunks, by chunk length (see :meth:`_window`)
        self._windows: dict[tuple[int, bool], np.ndarray | _Rows] = {}
        if memory is not None:  # per message: where its payload is read, and where it lands
            self.sat = memory.src[self.src]
            self.sat += self.slo
            self.wat = memory.dst[self.dst]
            self.wat += self.dlo
        self.order = run.order
        if self.order is not None:
            self.covered = np.zeros((self.n, len(self.range_lo)), dtype=bool)
            #: per rank: whether its taken ranges changed since the gloo result last heard of them
            self.dirty = np.zeros(self.n, dtype=bool)
            rows = self.order.rows
            self.rows = _raw_view(rows)
            self.row_width = rows.shape[1]
            if np.array_equal(memory.src, memory.dst):  # type: ignore[union-attr]  # in place: what is sent
                self.tat = self.sat
            else:
                self.tat = memory.dst[self.src]  # type: ignore[union-attr]  # what a reduction takes
                self.tat += self.slo
        #: in flight: heap of (arrival time, first event id, sequence, entry)
        self.heap: list[tuple[float, int, int, _Entry]] = []
        self._seq = itertools.count()
        self._listed = False
        self._proxy: Event | None = None
        self._proxy_key: tuple[float, int] = (float("inf"), 0)
        self._posted: dict[tuple[float, int], Event] = {}
        self.delivering = False
        self.record = run.sim.trace.record_messages
        self.streams = np.array(run.streams, dtype=object)
        #: global ranks by group rank (messages are traced by global rank)
        self.global_ranks = np.asarray(run.global_ranks, dtype=np.int64)

    # ------------------------------------------------------------------ the queue
    def _push(
        self, t: np.ndarray, eids: np.ndarray, mi: np.ndarray, start: np.ndarray, pay: Any, poff: Any, c: int
    ) -> None:
        """Queue messages ``mi`` (sent in this order, under ids ``eids``) to arrive at times ``t`` (payloads
        as :class:`_Entry` has them)."""
        if (t == t[0]).all():
            parts = [slice(None)]
        else:
            order = np.argsort(t, kind="stable")
            ts = t[order]
            cuts = np.flatnonzero(ts[1:] != ts[:-1]) + 1
            parts = np.split(order, cuts)
        for p in parts:
            e = _Entry(eids[p], mi[p], start[p], pay, poff[p] if poff is not None else None, c)
            tt = float(t[p][0]) if isinstance(p, slice) else float(t[p[0]])
            heappush(self.heap, (tt, int(e.eids[0]), next(self._seq), e))
        if not self._listed:
            self.env.__dict__.setdefault("lanes", []).append(self)
            self._listed = True
        if not self.delivering and self.heap[0][:2] < self._proxy_key:
            self._post(*self.heap[0][:2])

    def _queue(
        self, t: float, eids: np.ndarray, mi: np.ndarray, start: np.ndarray, pay: Any, poff: Any, c: int
    ) -> None:
        """Queue messages ``mi`` (sent in this order, under ids ``eids``) to arrive together at ``t``, while the
        queue delivers (:meth:`_push` for one arrival time)."""
        e = _Entry(eids, mi, start, pay, poff, c)
        heappush(self.heap, (t, int(eids[0]), next(self._seq), e))

    def next_after(self, now: float) -> float:
        """The earliest time after ``now`` (seconds) at which a message is due (infinity: none)."""
        return min((t for t, *_ in self.heap if t > now), default=float("inf"))

    def _post(self, t: float, eid: int) -> None:
        """Put an event standing for the message keyed ``(t, eid)`` into simpy's queue."""
        key = (t, eid)
        self._proxy, self._proxy_key = proxy(self.env, key, self._posted, self._run), key

    def _take_due(self, t: float, below: int | None) -> _Entry | None:
        """Remove and return the messages due at ``t`` with ids below ``below`` (None: all), in id order."""
        heap = self.heap
        got = []
        while heap and heap[0][0] == t:
            got.append(heappop(heap)[3])
        e = got[0] if len(got) == 1 else _Entry.merge(got)
        if below is not None:
            cut = int(np.searchsorted(e.eids, below))
            if cut < len(e.eids):
                rest = e.part(slice(cut, None))
                heappush(heap, (t, int(rest.eids[0]), next(self._seq), rest))
                if cut == 0:
                    return None
                e = e.part(slice(0, cut))
        return e

    def _run(self, ev: Event) -> None:
        """Deliver every message that comes before simpy's next event (the proxy ``ev`` has come up)."""
        del self._posted[ev._value]
        if ev is not self._proxy:
            return  # stale: an earlier message took its place
        self._proxy, self._proxy_key = None, (float("inf"), 0)
        env = self.env
        heap, queue = self.heap, env._queue
        self.delivering = True
        try:
            while heap:
                t = heap[0][0]
                below = None
                if queue:
                    qt, qp, qid, _ = queue[0]
                    if qt < t or (qt == t and qp < NORMAL):
                        break
                    if qt == t and qp == NORMAL:
                        below = qid
                e = self._take_due(t, below)
                if e is None:
                    break
                env._now = t
                if not self._deliver(e):
                    break
        finally:
            self.delivering = False
        if heap:
            self._post(heap[0][0], heap[0][1])
        elif self._listed:
            env.lanes.remove(self)  # type: ignore[attr-defined]
            self._listed = False

    # ------------------------------------------------------------------ messages
    def start(self) -> None:
        """Every rank issues what it can before any message has arrived, in rank order; a rank that receives
        nothing is then done, before the next rank issues anything (as one message at a time has it)."""
        self._started = True
        idle = np.flatnonzero(self.remaining == 0).tolist()
        at = 0
        for r in [*idle, self.n]:
            if r > at:
                self._send(self._advance(np.arange(at, r, dtype=np.int64)))
            if r < self.n:
                self._send(self._advance(np.array([r], dtype=np.int64)))
                self._finish(r)
            at = r + 1

    def _deliver(self, e: _Entry) -> bool:
        """Deliver the messages of ``e`` (due now, in id order); False if simpy's queue now has an event due
        before the rest (which are queued again)."""
        if self.lockstep is not None and lockstep.ENABLED and lockstep.deliver_step(self, e):
            return True
        k = len(e.mi)
        i = 0
        while i < k:
            dst = self.dst[e.mi[i:]] if k - i > 1 else None
            j = self._independent(dst) + i if dst is not None else i
            if j > i + 1:
                self._land(e.part(slice(i, j)), dst[: j - i])  # type: ignore[index]
                i = j
                continue
            self._land_one(e, i)  # the rank finishes: the work completes, simpy events follow
            i += 1
            if i < k:
                queue = self.env._queue
                if queue:
                    qt, qp, qid, _ = queue[0]
                    now = self.env._now
                    if qt < now or (qt == now and (qp < NORMAL or (qp == NORMAL and qid < e.eids[i]))):
                        rest = e.part(slice(i, None))
                        heappush(self.heap, (self.env._now, int(rest.eids[0]), next(self._seq), rest))
                        return False
        return True

    def _independent(self, dst: np.ndarray) -> int:
        """How many of the messages to receivers ``dst`` from the first may be delivered at once: distinct
        receivers, none of which finishes its part."""
        finishing = self.remaining[dst] == 1
        stop = int(finishing.argmax()) if finishing.any() else len(dst)
        if stop > 1:
            head = dst[:stop]
            if stop * 4 < self.n or np.bincount(head, minlength=self.n).max() > 1:  # else all distinct
                stop = _first_repeat(head)
        return stop

    def _land(self, e: _Entry, dst: np.ndarray) -> None:
        """Messages ``e`` (to receivers ``dst``: distinct, none finishing) arrive now: their data lands, their
        receivers go on."""
        mi = e.mi
        if self.memory is not None and e.pay is not None:
            self._land_data(mi, dst, e)
        if self.record:
            self._trace(mi, e.start)
        step = self.step[mi]
        key = dst * (self.S + 1)  # where each receiver counts its message
        key += step
        miss = self.missing
        miss[key] -= 1
        self.remaining[dst] -= 1
        fm = self.first_missing
        moved = (step == fm[dst]) & (miss[key] == 0)
        if moved.any():
            ranks = dst[moved]
            cand = fm[ranks] + 1
            row = ranks * (self.S + 1)
            while True:
                live = cand < self.S
                live[live] = miss[row[live] + cand[live]] == 0
                if not live.any():
                    break
                cand[live] += 1
            fm[ranks] = cand
            # only these may issue more: another rank's first missing step, so what it may send, is as before
            self._send(self._advance(ranks))

    def _land_one(self, e: _Entry, i: int) -> None:
        """Message ``i`` of ``e`` arrives now (:meth:`_land` for one message, without arrays)."""
        m = int(e.mi[i])
        d, step, c = int(self.dst[m]), int(self.step[m]), int(self.count[m])
        memory = self.memory
        if memory is not None and e.pay is not None and c:
            lo = int(self.dlo[m])
            at = int(memory.dst[d]) + lo
            p0 = int(e.poff[i])
            pay = e.pay[p0] if e.c else e.pay[p0 : p0 + c]
            mem = memory.mem
            if self.red[m]:
                if self.order is not None:
                    self._take(np.array([d]), np.array([lo]), np.array([at]), np.array([c]))
                self.run.reduce(memory.tensor(mem[at : at + c]), memory.tensor(pay))
            else:
                mem[at : at + c] = pay
        if self.record:
            self._trace(e.mi[i : i + 1], e.start[i : i + 1])
        miss = self.missing[d * (self.S + 1) : (d + 1) * (self.S + 1)]
        miss[step] -= 1
        self.remaining[d] -= 1
        fm = self.first_missing
        if step == fm[d] and miss[step] == 0:
            k = step + 1
            S = self.S
            while k < S and miss[k] == 0:
                k += 1
            fm[d] = k
        S = self.S  # _advance for one rank, without arrays
        end = int(self.send_end[d * (S + 1) + min(int(fm[d]), S - 1)])
        beg = int(self.cursor[d])
        if end > beg:
            self.cursor[d] = end
            self._send(np.arange(beg, end, dtype=np.int64))
        if self.remaining[d] == 0:
            self._finish(d)

    def _land_data(self, mi: np.ndarray, dst: np.ndarray, e: _Entry) -> None:
        memory = self.memory
        mem = memory.mem  # type: ignore[union-attr]
        count = self.count[mi]
        red = self.red[mi]
        reducing = int(np.count_nonzero(red))
        wat = self.wat[mi]
        if self.order is not None and reducing:
            if reducing == len(mi):
                self._take(dst, self.dlo[mi], wat, count)
            else:
                sel = mi[red]
                self._take(dst[red], self.dlo[sel], wat[red], count[red])
        if e.c:  # equal chunks: rows of the memory, read and written without element indices
            win = self._window(e.c)
            pay = e.pay[e.poff]
            if reducing == len(mi):
                acc = win[wat]
                self.run.reduce(memory.tensor(acc), memory.tensor(pay))  # type: ignore[union-attr]
                win[wat] = acc
            elif not reducing:
                win[wat] = pay
            else:
                rw = wat[red]
                acc = win[rw]
                self.run.reduce(memory.tensor(acc), memory.tensor(pay[red]))  # type: ignore[union-attr]
                win[rw] = acc
                win[wat[~red]] = pay[~red]
            return
        widx = _expand(wat, count)
        pidx = _expand(e.poff, count)
        if reducing == len(mi):
            acc = mem[widx]
            self.run.reduce(memory.tensor(acc), memory.tensor(e.pay[pidx]))  # type: ignore[union-attr]
            mem[widx] = acc
        elif not reducing:
            mem[widx] = e.pay[pidx]
        else:
            per = np.repeat(red, count)
            rw = widx[per]
            acc = mem[rw]
            self.run.reduce(memory.tensor(acc), memory.tensor(e.pay[pidx[per]]))  # type: ignore[union-attr]
            mem[rw] = acc
            mem[widx[~per]] = e.pay[pidx[~per]]

    def _window(self, c: int, rows: bool = False) -> np.ndarray | _Rows:
        """The memory (``rows``: gloo's result rows, flat) as overlapping rows of ``c`` elements, row ``i``
        starting at element ``i``: a message's chunk is the row at its offset."""
        key = (c, rows)
        win = self._windows.get(key)
        if win is None:
            flat = self.rows if rows else self.memory.mem  # type: ignore[union-attr]
            if (len(flat) - c + 1) * c * flat.itemsize > _MAX_VIEW_BYTES:
                win = self._windows[key] = _Rows(flat, c)
            else:
                win = self._windows[key] = sliding_window_view(flat, c, writeable=True)
        return win

    def _take(
        self,
        ranks: np.ndarray,
        lo: np.ndarray,
        at: np.ndarray,
        count: np.ndarray,
        rows: np.ndarray | None = None,
    ) -> None:
        """Gloo's order: ranks ``ranks``' elements ``[lo, lo + count)`` (at ``at`` in memory; ``rows``: those
        elements, read already, where the counts are equal and not 0) enter a reduction; keep those not taken
        before."""
        if rows is None:
            some = count > 0
            if not some.all():
                ranks, lo, at, count = ranks[some], lo[some], at[some], count[some]
        if self.nested:
            rid = self._segment(lo)
            parts = self._segment(lo + count) - rid
            if (parts != 1).any():
                self._take_segments(ranks, lo, at, rid, parts, rows)
                return
        else:
            rid = self.range_of[lo] if self.range_of is not None else np.searchsorted(self.range_lo, lo)
        fresh = ~self.covered[ranks, rid]
        taken = int(np.count_nonzero(fresh))
        if not taken:
            return
        if taken < len(fresh):
            ranks, rid, lo, at, count = ranks[fresh], rid[fresh], lo[fresh], at[fresh], count[fresh]
            if rows is not None:
                rows = rows[fresh]
        self.covered[ranks, rid] = True
        self.dirty[ranks] = True
        c = int(count[0])
        if rows is not None or (count == c).all():  # equal chunks: rows
            self._window(c, rows=True)[ranks * self.row_width + lo] = (
                rows if rows is not None else self._window(c)[at]
            )
        else:
            self.rows[_expand(ranks * self.row_width + lo, count)] = self.memory.mem[_expand(at, count)]  # type: ignore[union-attr]

    def _segment(self, offsets: np.ndarray) -> np.ndarray:
        """The numbers of the segments starting at ``offsets`` (or, at the last bound, how many there are), where
        the ranges overlap partly."""
        if self.range_of is not None:
            return self.range_of[offsets]
        return np.searchsorted(self.bounds, offsets)  # type: ignore[arg-type]

    def _take_segments(
        self,
        ranks: np.ndarray,
        lo: np.ndarray,
        at: np.ndarray,
        rid: np.ndarray,
        parts: np.ndarray,
        rows: np.ndarray | None,
    ) -> None:
        """:meth:`_take` where messages span several segments (``parts`` each, the first ``rid``): each segment
        not taken before from its rank is taken, from the memory at ``at`` or from the message's row of ``rows``."""
        piece = np.repeat(np.arange(len(rid)), parts)  # the message of each segment
        rid = _expand(rid, parts)
        ranks = ranks[piece]
        fresh = ~self.covered[ranks, rid]
        if not fresh.any():
            return
        piece, rid, ranks = piece[fresh], rid[fresh], ranks[fresh]
        self.covered[ranks, rid] = True
        self.dirty[ranks] = True
        seg_lo = self.range_lo[rid]
        count = self.range_hi[rid] - seg_lo
        within = seg_lo - lo[piece]  # where each segment starts in its message's elements
        if rows is None:
            values = self.memory.mem[_expand(at[piece] + within, count)]  # type: ignore[union-attr]
        else:
            values = rows.reshape(-1)[_expand(piece * rows.shape[1] + within, count)]
        self.rows[_expand(ranks * self.row_width + seg_lo, count)] = values

    def _sync_covered(self) -> None:
        """Tell the gloo result which element ranges of each rank it has taken (it checks them when it writes)."""
        for r in np.flatnonzero(self.dirty).tolist():
            sel = np.flatnonzero(self.covered[r])
            lo, hi = self.range_lo[sel], self.range_hi[sel]
            breaks = np.flatnonzero(lo[1:] > hi[:-1]) + 1
            starts = np.concatenate([[0], breaks])
            ends = np.concatenate([breaks, [len(lo)]]) - 1
            cov = self.order.covered[r]  # type: ignore[union-attr]
            cov.starts, cov.ends = lo[starts].tolist(), hi[ends].tolist()
        self.dirty[:] = False

    def _trace(self, mi: np.ndarray, start: np.ndarray) -> None:
        """Record messages ``mi`` (started at ``start``), arrived now, in order."""
        run, k = self.run, len(mi)
        streams = self.streams
        self.run.sim.trace.message_batch(
            map(
                Message,
                self.global_ranks[self.src[mi]].tolist(),
                self.global_ranks[self.dst[mi]].tolist(),
                streams[self.src[mi]].tolist(),
                streams[self.dst[mi]].tolist(),
                start.tolist(),
                itertools.repeat(self.env._now, k),
                (self.count[mi] * run.itemsize).tolist(),
                itertools.repeat(run.name, k),
            )
        )

    def _advance(self, ranks: np.ndarray) -> np.ndarray:
        """Ranks ``ranks`` (distinct) issue every step they may: the messages they send, in order."""
        S = self.S
        limit = np.minimum(self.first_missing[ranks], S - 1)
        end = self.send_end[ranks * (S + 1) + limit]
        beg = self.cursor[ranks]
        count = np.maximum(end - beg, 0)
        self.cursor[ranks] = beg + count
        return _expand(beg, count)

    def _send(self, mi: np.ndarray) -> None:
        """Messages ``mi`` leave now, in this order: their data is taken, their links reserved."""
        k = len(mi)
        if k == 0:
            return
        pay = poff = None
        c = 0
        memory = self.memory
        if memory is not None:
            count = self.count[mi]
            if self.order is not None:  # gloo's result reads the sender's result buffer
                takes = self.send_takes[mi]
                if takes.any():
                    sel = mi[takes]
                    self._take(self.src[sel], self.slo[sel], self.tat[sel], count[takes])
            c = int(count[0])
            if c and (count == c).all():  # equal chunks: one row each
                pay = self._window(c)[self.sat[mi]]
                poff = self._iota if k == self.n else np.arange(k)
            else:
                c = 0
                pay = memory.mem[_expand(self.sat[mi], count)]
                poff = count.cumsum() - count
        now = self.env._now
        start, t = self._reserve(now, mi)
        if type(now) is not float:  # simpy's clock starts at the integer 0: a start not delayed is that 0
            start = start.astype(object)
            start[start == now] = now
        eid0 = next(self.env._eid)
        self.env._eid = itertools.count(eid0 + k)
        self.network.messages += k
        self._push(t, np.arange(eid0, eid0 + k, dtype=np.int64), mi, start, pay, poff, c)

    def _reserve(self, now: float, mi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Reserve the links of messages ``mi`` in order; (when each starts to move, when it arrives)."""
        free = self.network._free_at
        hold = self.hold[mi]
        k = len(mi)
        if self.link is not None:
            links = self.link[mi]
            runs = _strided_runs(links)
            if runs is not None:  # runs of evenly spaced links: distinct, read and written as list slices
                start = np.empty(k)
                for a, b, sl in runs:
                    start[a:b] = free[sl]
                start = np.maximum(start, now)
                leave = start + hold
                values = leave.tolist()
                for a, b, sl in runs:
                    free[sl] = values[a:b]
                return start, now + ((leave + self._lat(mi)) - now)
            if k == 1 or _first_repeat(links) == k:  # one link each, all distinct: order-free
                ll = links.tolist()
                start = np.maximum(np.fromiter(map(free.__getitem__, ll), np.float64, k), now)
                leave = start + hold
                for i, v in zip(ll, leave.tolist()):
                    free[i] = v
                return start, now + ((leave + self._lat(mi)) - now)
        if self.pair is None:  # one link each
            links, valid = self.link[mi][:, None], np.ones((k, 1), dtype=bool)
        else:
            pair = self.pair[mi]
            links, valid = self.plinks[pair], self.pvalid[pair]
        start = np.empty(k)
        i = 0
        while i < k:
            j = k if i == 0 and k == 1 else self._disjoint(links[i:], valid[i:]) + i
            seg = links[i:j]
            fv = np.fromiter(map(free.__getitem__, seg.ravel().tolist()), np.float64, seg.size).reshape(
                seg.shape
            )
            s = np.maximum(fv.max(axis=1), now)
            leave = s + hold[i:j]
            v = valid[i:j]
            for li, lv in zip(seg[v].tolist(), np.broadcast_to(leave[:, None], seg.shape)[v].tolist()):
                free[li] = lv
            start[i:j] = s
            i = j
        leave = start + hold
        return start, now + ((leave + self._lat(mi)) - now)

    def _lat(self, mi: np.ndarray) -> np.ndarray | float:
        """The latencies of messages ``mi`` (one number where all routes have the same)."""
        lat = self.lat
        return lat if type(lat) is float else lat[mi]

    @staticmethod
    def _disjoint(links: np.ndarray, valid: np.ndarray) -> int:
        """How many of the routes ``links`` from the first use pairwise distinct links (at least one)."""
        if links.shape[1] == 1:
            return max(1, _first_repeat(links[:, 0]))
        flat = links[valid]
        owner = np.broadcast_to(np.arange(len(links))[:, None], links.shape)[valid]
        first = _first_repeat(flat)
        return len(links) if first == len(flat) else max(1, int(owner[first]))

    def _finish(self, r: int) -> None:
        """Rank ``r`` has sent and received everything."""
        run = self.run
        run.done[r] = True
        run.ranks_done += 1
        if run.ranks_done == self.n:
            run.lane.close()  # type: ignore[union-attr]
        if self.order is not None:
            self._sync_covered()
        run.on_rank_done(r)
        if run.ranks_done == self.n:  # nothing more moves: no cycle keeps the run's buffers alive
            run.next_step, run.first_missing = self.progress()
            run.batched = None
            self.memory = self.rows = None
            self._windows = {}

    def progress(self) -> tuple[list[int], list[int]]:
        """Each rank's next step to issue and first step still missing a message."""
        if not self._started:
            return [0] * self.n, self.first_missing.tolist()
        # every rank issued the steps up to its first missing one when that last moved (and at the start)
        return (np.minimum(self.first_missing, self.S - 1) + 1).tolist(), self.first_missing.tolist()


class _Entry:
    """Messages in flight due at one time, in id order: their ids, indices, start times and payloads. Payloads
    of ``c`` elements each (``c`` > 0: a ring's equal chunks) are rows of ``pay`` (``poff``: each message's row);
    else ``pay`` is flat and ``poff`` each message's first element."""

    __slots__ = ("c", "eids", "mi", "pay", "poff", "start")

    def __init__(
        self, eids: np.ndarray, mi: np.ndarray, start: np.ndarray, pay: Any, poff: Any, c: int = 0
    ) -> None:
        self.eids, self.mi, self.start, self.pay, self.poff, self.c = eids, mi, start, pay, poff, c

    def part(self, sel: slice) -> _Entry:
        return _Entry(
            self.eids[sel],
            self.mi[sel],
            self.start[sel],
            self.pay,
            None if self.poff is None else self.poff[sel],
            self.c,
        )

    def flat(self) -> tuple[Any, Any]:
        """(payloads, offsets) laid out flat."""
        return (self.pay.ravel(), self.poff * self.c) if self.c else (self.pay, self.poff)

    @staticmethod
    def merge(entries: list[_Entry]) -> _Entry:
        """One entry of several, in id order (payloads laid end to end)."""
        eids = np.concatenate([e.eids for e in entries])
        order = np.argsort(eids, kind="stable")
        mi = np.concatenate([e.mi for e in entries])[order]
        start = np.concatenate([e.start for e in entries])[order]
        if entries[0].pay is None:
            return _Entry(eids[order], mi, start, None, None)
        c = entries[0].c
        if any(e.c != c for e in entries):
            c = 0  # rows of different lengths: all flat
        offs, pays, base = [], [], 0
        for e in entries:
            pay, poff = (e.pay, e.poff) if c else e.flat()
            offs.append(poff + base)
            pays.append(pay)
            base += len(pay)  # rows, or elements
        return _Entry(eids[order], mi, start, np.concatenate(pays), np.concatenate(offs)[order], c)


def make(run: ScheduleRun, msgs: Sequence[Any]) -> BatchedRun | None:
    """``run``'s batched form, or None where it keeps the one-message path."""
    if not ENABLED or run.lane is None or len(msgs) < MIN_MESSAGES:
        return None
    cols = Columns(msgs)
    if batched_allowed(run, cols) is not None:
        return None
    memory = _memory_for(run.src_bufs, run.dst_bufs)
    if isinstance(memory, str):
        return None
    return BatchedRun(run, cols, memory)
