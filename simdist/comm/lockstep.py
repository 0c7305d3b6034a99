"""A ring's steps run in lockstep: a whole step of a batched schedule handled in a handful of array operations.

A ring schedule sends, at every step, one message from each rank to the same neighbour, of equal chunks over
links of one latency and speed. When all ``n`` messages of one step ``k`` are due together (every rank sent its
step-``k`` message, none has arrived yet), the state of the whole schedule is known without looking: every rank
awaits exactly that message, has sent everything before its step ``k + 1`` and sends exactly its step-``k + 1``
message once it lands. :func:`deliver_step` then does what :meth:`simdist.comm.batched.BatchedRun._land` does for
such a group with the counters moved as whole columns, and the sends' times as one number where every link of
the step is free by now (each message then starts now and arrives after the same float operations as
:meth:`simdist.network.links.Network.send`'s). Anything else (a step's messages split over several groups, a
rank finishing its part, a link still busy) goes the general way.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the batched run owns its plan; this module never imports it at run time
    from simdist.comm.batched import BatchedRun

#: whether ring steps may run in lockstep (False: every group the general way, as a reference to compare)
ENABLED = True


class LockstepPlan:
    """What a schedule fit for lockstep steps holds for all of them (see :func:`plan`). Read only."""

    def __init__(
        self,
        n: int,
        steps: int,
        chunk: int,
        to: np.ndarray,
        link_set: list[slice] | list[int],
        reduces: np.ndarray,
        send_takes: np.ndarray | None,
        by_rank: tuple[int, int] | None = None,
    ) -> None:
        #: ranks, steps, and the chunk length of every message (0 where they differ, or are all empty)
        self.n, self.steps, self.chunk = n, steps, chunk
        #: by rank: the rank it sends to at every step
        self.to = to
        #: a step's chunk lengths, one per message
        self.counts = np.full(n, chunk, dtype=np.int64)
        #: the links every step uses (the same at every step): one slice of the network's link list, or their ids
        self.link_set = link_set
        #: per step: whether its messages reduce into their receivers (else they copy)
        self.reduces = reduces.tolist()
        #: per step: whether any of its senders takes elements for gloo's order as it sends (None: no order)
        self.send_takes = None if send_takes is None else send_takes.tolist()
        #: (first, gap) where rank ``r`` sends on link ``first + gap * r`` (a ring's links in rank order), else None
        self.by_rank = by_rank
        #: 0 to n - 1: a part's first ``m`` of them number its payload rows
        self.iota = np.arange(n, dtype=np.int64)
        self.iota.flags.writeable = False


def plan(
    n: int,
    S: int,
    src: np.ndarray,
    dst: np.ndarray,
    step: np.ndarray,
    count: np.ndarray,
    red: np.ndarray,
    hold: np.ndarray,
    link: np.ndarray | None,
    lat: Any,
    send_takes: np.ndarray | None,
) -> LockstepPlan | None:
    """The lockstep plan of a batched schedule's messages (sorted by sender, then step), or None where its steps
    are not a ring's: one message per rank and step, to the same receiver at every step, distinct receivers at
    each step, equal chunks, each over one link of one latency, held for one time."""
    if not ENABLED or link is None or type(lat) is not float or S < 2 or len(src) != n * S:
        return None
    shape = (n, S)
    if (
        not (step.reshape(shape) == np.arange(S)).all()
        or not (src.reshape(shape) == np.arange(n)[:, None]).all()
    ):
        return None  # so rank r's step-k message is message r * S + k
    to = dst.reshape(shape)
    first = to[:, 0]
    if not (to == first[:, None]).all() or len(np.unique(first)) != n:
        return None
    c = int(count[0])
    if not (count == c).all() or not (hold == hold[0]).all():
        c = 0  # chunks of several lengths: only a step's parts go in lockstep, never a whole step at once
    reduces = red.reshape(shape)
    if not (reduces == reduces[0]).all():
        return None
    # a one-link route leaves its sender: distinct senders use distinct links, and every step the same ones
    link_of = link.reshape(shape)[:, 0]
    ids = np.sort(link_of)
    gap = int(ids[1] - ids[0]) if n > 1 else 1
    even = (
        gap > 0 and (ids == ids[0] + gap * np.arange(n)).all()
    )  # a ring's links: read and written as a slice
    link_set = [slice(int(ids[0]), int(ids[-1]) + 1, gap)] if even else ids.tolist()
    by_rank = (int(ids[0]), gap) if even and (link_of == ids).all() else None
    takes = None if send_takes is None else send_takes.reshape(shape).any(axis=0)
    return LockstepPlan(n, S, c, first.copy(), link_set, reduces[0], takes, by_rank)


#: how many steps of a per-message column a :class:`StepRows` copies at a time
BLOCK = 64


class StepRows:
    """A per-message column (rank ``r``'s step-``k`` message at ``r * steps + k``) read a step at a time: each step's
    values by rank, copied from the column a block of steps at a time (a step's own values lie a rank's whole row
    apart: reading them one step at a time misses the cache at every rank)."""

    def __init__(self, column: np.ndarray, n: int, steps: int) -> None:
        self.table = column.reshape(n, steps)
        self.first = 0
        self.block = self.table[:, :0].T

    def __getitem__(self, k: int) -> np.ndarray:
        """Step ``k``'s values, by rank."""
        b = k - self.first
        if not 0 <= b < len(self.block):
            self.first, b = k, 0
            self.block = np.ascontiguousarray(self.table[:, k : k + BLOCK].T)
        return self.block[b]


def _rows(br: BatchedRun) -> dict[str, StepRows]:
    """The columns a lockstep step reads, a step at a time (made at the first lockstep step of ``br``)."""
    rows = br._step_rows
    if rows is None:
        p = br.lockstep
        rows = br._step_rows = {}
        made: dict[int, StepRows] = {}  # one reader for columns that are one array (a ring's dlo and slo)
        for name in ("wat", "sat", "dlo", "slo", "tat", "count"):
            column = getattr(br, name, None)
            if column is not None:
                rows[name] = made.setdefault(id(column), StepRows(column, p.n, p.steps))
    return rows


def deliver_step(br: BatchedRun, e: Any) -> bool:
    """Deliver entry ``e`` of ``br`` as one lockstep step, or part of one, if it is (False: nothing done, go the
    general way)."""
    p = br.lockstep
    mi = e.mi
    n, S = p.n, p.steps
    now = br.env._now
    if type(now) is not float:
        return False
    k = int(mi[0]) % S
    if k >= S - 1 or not (mi % S == k).all():  # the last step finishes ranks: one at a time
        return False
    memory = br.memory
    moving = memory is not None and e.pay is not None
    if len(mi) != n or not p.chunk or (moving and e.c != p.chunk):
        return _deliver_part(br, e, k, now)
    snd = mi // S
    dst = p.to[snd]
    landed = None
    if moving:
        pay = e.pay if e.poff is br._iota else e.pay[e.poff]
        landed = _land_rows(br, k, snd, dst, p.chunk, pay, p.counts)
    if br.record:
        br._trace(mi, e.start)
    # every rank had awaited this step's message alone: it now awaits its next step's, which it may send
    br._miss2d[:, k] = 0
    br.remaining -= 1
    br.first_missing.fill(k + 1)
    br.cursor += 1
    _send_step(br, dst, k + 1, now, landed)
    return True


def _land_rows(
    br: BatchedRun,
    k: int,
    snd: np.ndarray,
    dst: np.ndarray,
    c: int,
    pay: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Step ``k``'s chunks of ``c`` elements from senders ``snd`` (payload rows ``pay``) land in receivers ``dst``:
    reduced into their elements or copied over them, their offsets read a step at a time; (where they landed, the
    rows now there). ``counts``: ``c`` per message."""
    rows = _rows(br)
    wat = rows["wat"][k][snd]
    win = br._window(c)
    if not br.lockstep.reduces[k]:
        win[wat] = pay
        return wat, pay
    acc = win[wat]
    if br.order is not None:  # the receivers' elements before the reduction: what gloo's result takes
        br._take(dst, rows["dlo"][k][snd], wat, counts, acc)
    memory = br.memory
    br.run.reduce(memory.tensor(acc), memory.tensor(pay))  # type: ignore[union-attr]
    win[wat] = acc
    return wat, acc


def _deliver_part(br: BatchedRun, e: Any, k: int, now: float) -> bool:
    """Deliver entry ``e``: some of step ``k``'s messages (``k`` not the last step), where each receiver awaits
    exactly its message of that step and has sent everything up to it (so, once it lands, sends exactly its
    step-``k + 1`` message). A ring's chunks of two lengths arrive as two such parts of a step (elements that
    do not divide by the ranks). What :meth:`BatchedRun._land` does for the entry, without working out which
    receivers move on and what they may send."""
    p = br.lockstep
    S = p.steps
    mi = e.mi
    snd = mi // S
    dst = p.to[snd]
    # a rank that has every message before step k has sent its step-k message (a ring's rank sends step j once
    # step j - 1's message is in), and none after it: it sends step k + 1 once step k's lands, which this is
    if not (br.first_missing[dst] == k).all():
        return False
    memory = br.memory
    landed = None
    c = e.c
    if memory is not None and e.pay is not None:
        if c:  # equal chunks: rows, their offsets read a step at a time
            landed = _land_rows(br, k, snd, dst, c, e.pay[e.poff], np.full(len(mi), c, dtype=np.int64))
        elif _rows(br)["count"][k][snd].any():  # chunks of several lengths in one part (else nothing moves)
            br._land_data(mi, dst, e)
    if br.record:
        br._trace(mi, e.start)
    br._miss2d[dst, k] = 0
    br.remaining[dst] -= 1
    br.first_missing[dst] = k + 1
    br.cursor[dst] += 1
    step_k = dst * S
    step_k += k + 1
    _send_part(br, dst, step_k, k + 1, now, landed, c)
    return True


def _send_part(
    br: BatchedRun,
    snd: np.ndarray,
    mi: np.ndarray,
    k: int,
    now: float,
    landed: tuple[np.ndarray, np.ndarray] | None,
    c: int,
) -> None:
    """Ranks ``snd`` send their step-``k`` messages ``mi`` now, in this order: :meth:`BatchedRun._send` where
    their chunks are equal, each forwarding the ``c`` elements step ``k - 1`` has just written (``landed``: where,
    and the rows) without reading them again, or all empty."""
    p = br.lockstep
    m = len(mi)
    memory = br.memory
    rows = _rows(br)
    count = rows["count"][k][snd]
    pay = poff = None
    if memory is None:
        c = 0
    elif landed is not None and (count == c).all() and np.array_equal(sat := rows["sat"][k][snd], landed[0]):
        pay, poff = landed[1], p.iota[:m]
        if br.order is not None and p.reduces[k]:  # every message reduces and carries elements: may take
            if p.reduces[k - 1] and br.tat is br.sat:
                pass  # in place, it sends what it has just reduced into, which gloo's result took then
            elif br.tat is br.sat:
                br._take(snd, rows["slo"][k][snd], sat, count, pay)
            else:
                br._take(snd, rows["slo"][k][snd], rows["tat"][k][snd], count)
    elif not count.any():  # empty chunks: nothing to read, nothing any reduction takes
        pay, poff, c = memory.mem[:0], np.zeros(m, dtype=np.int64), 0
    else:
        br._send(mi)
        return
    env = br.env
    eid0 = next(env._eid)
    env._eid = itertools.count(eid0 + m)
    br.network.messages += m
    eids = np.arange(eid0, eid0 + m, dtype=np.int64)
    free = br.network._free_at
    spans = _spans(br, snd)
    if spans is not None and max(max(free[sl]) for sl in spans) <= now:  # every link free: all start now
        leave = now + float(br.hold[mi[0]])  # equal chunks: one hold
        for sl in spans:
            free[sl] = [leave] * len(range(sl.start, sl.stop, sl.step))
        br._queue(now + ((leave + br.lat) - now), eids, mi, np.full(m, now), pay, poff, c)
        return
    start, t = br._reserve(now, mi)
    br._push(t, eids, mi, start, pay, poff, c)


def _spans(br: BatchedRun, snd: np.ndarray) -> list[slice] | None:
    """The links of senders ``snd`` (distinct, in any order) as slices of the network's link list, where they are
    a run of consecutive ranks (wrapping around after the last) sending on links in rank order; else None."""
    p = br.lockstep
    if p.by_rank is None:
        return None
    m, n = len(snd), p.n
    lo, hi = int(snd.min()), int(snd.max())
    if hi - lo == m - 1:  # m distinct ranks from lo to hi: all of them
        ranges = [(lo, hi + 1)]
    elif lo == 0 and hi == n - 1:  # perhaps the ranks from a to the last, then from the first to b
        mark = br.__dict__.get("_mark")
        if mark is None:
            mark = br._mark = np.zeros(n, dtype=bool)  # a mark per rank, the run's own scratch
        mark.fill(False)
        mark[snd] = True
        b = int(mark.argmin())  # the first rank not among them
        a = n - (m - b)
        if mark[b:a].any():  # else the m - b ranks from b on are all at a and after
            return None
        ranges = [(a, n), (0, b)]
    else:
        return None
    first, gap = p.by_rank
    return [slice(first + gap * a, first + gap * b, gap) for a, b in ranges]


def links_free(links: list[slice] | list[int], free: list[float], now: float) -> bool:
    """Whether every link of ``links`` (slices of ``free`` or ids) is free by ``now`` (``free``: when each link is
    free, seconds)."""
    if type(links[0]) is slice:
        return max(max(free[sl]) for sl in links) <= now  # type: ignore[call-overload]
    return max(map(free.__getitem__, links)) <= now  # type: ignore[arg-type]


def _send_step(
    br: BatchedRun, snd: np.ndarray, k: int, now: float, landed: tuple[np.ndarray, np.ndarray] | None = None
) -> None:
    """Ranks ``snd`` (every rank, in this order) send their step-``k`` messages now: :meth:`BatchedRun._send`
    for a ring's step. ``landed``: where step ``k - 1`` wrote, one offset per sender in this order, and the rows
    it wrote there."""
    p = br.lockstep
    n = p.n
    mi = snd * p.steps
    mi += k
    memory = br.memory
    free = br.network._free_at
    links = p.link_set
    if not links_free(links, free, now):
        br._send(mi)  # a link still busy (other traffic on it): each message its own start
        return
    pay = poff = None
    if memory is not None:
        rows = _rows(br)
        sat = rows["sat"][k][snd]
        forward = landed is not None and np.array_equal(sat, landed[0])
        # each forwards the chunk it has just received (a ring's): the rows written, not read again
        pay = landed[1] if forward else br._window(p.chunk)[sat]  # type: ignore[index]
        poff = br._iota
        if p.send_takes is not None and p.send_takes[k]:  # every message reduces: every sender may take
            if forward and p.reduces[k - 1] and br.tat is br.sat:
                pass  # in place, it sends what it has just reduced into, which gloo's result took then
            elif br.tat is br.sat:  # in place: what it takes is what it sends
                br._take(snd, rows["slo"][k][snd], sat, p.counts, pay)
            else:
                br._take(snd, rows["slo"][k][snd], rows["tat"][k][snd], p.counts)
    leave = now + float(br.hold[mi[0]])
    t = now + ((leave + br.lat) - now)  # Network.send's arithmetic, the same for every message
    if type(links[0]) is slice:
        for sl in links:
            free[sl] = [leave] * len(range(sl.start, sl.stop, sl.step))  # type: ignore[union-attr]
    else:
        for i in links:
            free[i] = leave  # type: ignore[index]
    env = br.env
    eid0 = next(env._eid)
    env._eid = itertools.count(eid0 + n)
    br.network.messages += n
    c = p.chunk if memory is not None else 0
    br._queue(t, np.arange(eid0, eid0 + n, dtype=np.int64), mi, np.full(n, now), pay, poff, c)
