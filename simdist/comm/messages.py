"""Runs a collective's message schedule (:mod:`simdist.algorithms`) on the network with real data.

Each message's payload is a snapshot of the sender's buffer taken when the message leaves, and it is reduced
into or copied to the receiver's buffer when it arrives, at the simulated times the network computes. A
rank issues its sends of step ``k`` once every message addressed to it with a smaller step has arrived.
When the result is to be in gloo's order, each reduce message also hands the elements it reads to a
:class:`~simdist.comm.ordering.GlooResult` (the sender's when it leaves, the receiver's as it arrives).

Where nothing can reorder or retime them (no exploration perturbation, no link faults), a schedule's messages
skip simpy's queue: they wait in a queue of the schedule's own (:class:`~simdist.comm.lane.Lane`) under the
very keys simpy would give them, and a single simpy event stands for that queue's head. Every message is
then processed at the same point among all the run's events as through simpy, with the same reservations,
data and trace, at a fraction of the cost (see docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from simpy.core import NORMAL
from simpy.events import Event

from simdist.algorithms import Msg, format_schedule, reduce_ops
from simdist.algorithms.schedule import steps
from simdist.comm import batched
from simdist.comm.batched import BatchedRun
from simdist.comm.deferred import COPY, REDUCE, SNAP, DeferredData
from simdist.comm.lane import Lane, lane_allowed
from simdist.comm.ordering import GlooResult
from simdist.errors import LinkFailureError
from simdist.ranks import format_ranks
from simdist.trace.trace import Message

if TYPE_CHECKING:  # annotations only: the run's context imports the machinery, not the other way
    from simdist.comm.context import RunContext


class ScheduleRun:
    """One collective's schedule running across the ranks of a group.

    ``src_bufs[r]``/``dst_bufs[r]`` are flat 1-D tensors of group rank ``r``; ``global_ranks[r]`` its global
    rank for routing; ``streams[r]`` the trace stream rank ``r`` runs it on. ``on_rank_done(r)`` is called (in simulated time) once rank ``r`` has issued all its
    sends and received all its messages. ``order``, when given, is shown every element a reduce message reads; ``pace``, when given, times every message (see
    :meth:`simdist.network.links.Network.send`). ``reduce_cost`` (seconds per byte) is what the receiver of a reduce
    message spends adding it into its buffer before it goes on, one message after another on each rank (gloo
    reduces on the rank's own thread); 0 makes a reduction free. ``local`` (seconds) is what each rank spends on its
    own before its first message and after its last (the copies torch's ProcessGroupGloo makes around some
    collectives).
    """

    def __init__(
        self,
        sim: RunContext,
        msgs: Sequence[Msg],
        n: int,
        src_bufs: list[torch.Tensor | None],
        dst_bufs: list[torch.Tensor | None],
        reduce_op: str,
        global_ranks: list[int],
        on_rank_done: Callable[[int], None],
        streams: list[str],
        name: str,
        order: GlooResult | None = None,
        pace: tuple[float, float] | None = None,
        reduce_cost: float = 0.0,
        local: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.sim = sim
        self.reduce_cost = reduce_cost
        self.local = local
        #: when each rank's last reduction ends (``reduce_cost`` > 0 only)
        self.reducing_until = [0.0] * n
        #: (latency s, seconds per byte) every message is sent at, or None for the links' own
        self.pace = pace
        self.order = order
        self.n = n
        self.src_bufs = src_bufs
        self.dst_bufs = dst_bufs
        self.global_ranks = global_ranks
        self.on_rank_done = on_rank_done
        self.streams = streams
        self.name = name
        dtype = next((b.dtype for b in dst_bufs if b is not None), torch.float32)
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.reduce = reduce_ops.reduce_op(reduce_op).combiner(dtype)
        self.nsteps = steps(msgs)
        self.msgs = msgs
        self.done = [False] * n
        self.ranks_done = 0
        network = sim.network
        #: the schedule's own queue of messages in flight, or None where they go through the network and simpy
        self.lane: Lane | None = None
        #: the data a lane's burst moves, applied when it ends (None: moved as each message goes)
        self.deferred: DeferredData | None = None
        #: the schedule run in arrays, a group of simultaneous messages at a time (None: one at a time)
        self.batched: BatchedRun | None = None
        if lane_allowed(sim.env, network):
            self._free_at = network._free_at
            self._routes = network._routes
            self.lane = Lane(sim.env, self._deliver, self._settle)
            self.batched = batched.make(self, msgs)
            if self.batched is None:
                self.deferred = self._deferred(order)
        if self.batched is None:
            self._tables(msgs)

    def _tables(self, msgs: Sequence[Msg]) -> None:
        """Each rank's sends by step and the messages it still awaits, for the one-message path."""
        n, nsteps = self.n, self.nsteps
        self.sends: list[list[list[Msg]]] = [[[] for _ in range(nsteps)] for _ in range(n)]
        self.missing: list[list[int]] = [[0] * (nsteps + 1) for _ in range(n)]
        for m in msgs:
            self.sends[m.src][m.step].append(m)
            self.missing[m.dst][m.step] += 1
        self.next_step = [0] * n
        self.first_missing = [0] * n
        for r in range(n):
            self._skip_complete(r)

    def _deferred(self, order: GlooResult | None) -> DeferredData | None:
        """The record of a lane's data movement over this schedule's buffers, where every rank has both."""
        if any(b is None for b in self.src_bufs) or any(b is None for b in self.dst_bufs):
            return None
        if order is not None and order.scale != 1:
            return None
        bufs: list[torch.Tensor] = []
        index: dict[int, int] = {}
        for b in [*self.dst_bufs, *self.src_bufs]:
            if id(b) not in index:
                index[id(b)] = len(bufs)
                bufs.append(b)  # type: ignore[arg-type]
        self._src_at = [index[id(b)] for b in self.src_bufs]
        self._dst_at = [index[id(b)] for b in self.dst_bufs]
        return DeferredData(bufs, self.reduce, order)

    def _settle(self) -> None:
        """A burst of the lane's deliveries ends: its data lands."""
        if self.deferred is not None:
            self.deferred.flush()

    def _skip_complete(self, r: int) -> None:
        miss = self.missing[r]
        k = self.first_missing[r]
        while k < self.nsteps and miss[k] == 0:
            k += 1
        self.first_missing[r] = k

    def progress(self) -> str:
        """The schedule with the steps each rank has not finished yet marked (for timeout messages)."""
        next_step, first_missing = (
            self.batched.progress() if self.batched is not None else (self.next_step, self.first_missing)
        )
        done = [min(next_step[r], first_missing[r]) for r in range(self.n)]
        return format_schedule(self.msgs, self.n, done=done)

    def start(self) -> None:
        """Begin at the current simulated time (every rank is ready), once each rank has made its own copies."""
        before = self.local[0]
        if before:
            env = self.sim.env
            self.reducing_until = [env.now + before] * self.n
            env.timeout(before).callbacks.append(lambda _ev: self._start_ranks())
        else:
            self._start_ranks()

    def _start_ranks(self) -> None:
        if self.batched is not None:
            self.batched.start()
            return
        for r in range(self.n):
            self._advance(r)

    def _finish(self, r: int) -> None:
        """Rank ``r`` has sent and received everything: done once it has made its copies after."""
        if self.deferred is not None:
            self.deferred.flush()  # what runs next may read the buffers
        after = self.local[1]
        if after:
            self.sim.env.timeout(after).callbacks.append(lambda _ev: self.on_rank_done(r))
        else:
            self.on_rank_done(r)

    # The two methods below run once per message: they are written for speed (no closures, few calls).
    def _advance(self, r: int) -> None:
        sends = self.sends[r]
        step = self.next_step[r]
        nsteps = self.nsteps
        while step < nsteps and step <= self.first_missing[r]:
            for m in sends[step]:
                self._send(m)
            step += 1
        self.next_step[r] = step
        if step >= nsteps and self.first_missing[r] >= nsteps and not self.done[r]:
            self.done[r] = True
            self.ranks_done += 1
            if self.ranks_done == self.n and self.lane is not None:
                self.lane.close()  # every message has arrived
            self._finish(r)

    def _send(self, m: Msg) -> None:
        count = m.shi - m.slo
        deferred = self.deferred
        if deferred is not None and self.lane.delivering:  # type: ignore[union-attr]
            if self.order is not None and m.kind == "reduce":
                deferred.take(m.src, self._dst_at[m.src], m.slo, m.shi)
            box = None
            if count:
                box = deferred.box()
                deferred.ops += (
                    SNAP,
                    self._src_at[m.src],
                    m.slo,
                    m.shi,
                    box[1],
                )  # DeferredData.snap, inlined
            self._send_on_lane(m, count * self.itemsize, box)
            return
        buf = self.src_bufs[m.src]
        if self.order is not None and m.kind == "reduce":
            self.order.capture(m.src, m.slo, m.shi)
        payload = buf[m.slo : m.shi].clone() if count and buf is not None else None
        if self.lane is not None:
            boxed = payload if deferred is None or payload is None else [payload, -1]  # see DeferredData.box
            self._send_on_lane(m, count * self.itemsize, boxed)
            return
        try:
            self.sim.network.send(
                self.global_ranks[m.src],
                self.global_ranks[m.dst],
                count * self.itemsize,
                self._arrive,
                (m, payload),
                self.pace,
            )
        except LinkFailureError as e:
            raise LinkFailureError(
                f"{self.name.split(':', 1)[-1]} on global {format_ranks(self.global_ranks)} cannot send its step "
                f"{m.step} message from rank {self.global_ranks[m.src]} to rank {self.global_ranks[m.dst]}: {e}"
            ) from None

    def _send_on_lane(self, m: Msg, nbytes: int, payload: torch.Tensor | list | None) -> None:
        """:meth:`simdist.network.links.Network.send`'s plain model (no faults, no perturbation), the arrival
        queued on the lane instead of simpy."""
        network = self.sim.network
        network.messages += 1
        now = self.sim.env.now
        src, dst = self.global_ranks[m.src], self.global_ranks[m.dst]
        if src == dst:
            self.lane.push(0.0, (m, payload, now, False))  # type: ignore[union-attr]
            return
        hit = self._routes.get((src, dst))
        route, inv_bw, lat = hit if hit is not None else network._route(src, dst)
        if self.pace is not None:
            lat, inv_bw = self.pace
        free = self._free_at
        start = now
        for i in route:
            if free[i] > start:  # noqa: PLR1730 - as in Network.send
                start = free[i]
        leave = start + nbytes * inv_bw
        for i in route:
            free[i] = leave
        self.lane.push(leave + lat - now, (m, payload, start, False))  # type: ignore[union-attr]

    def _deliver(self, item: tuple[Msg, torch.Tensor | list | None, float, bool]) -> None:
        """A message of the lane arrives (the lane has moved the clock to its arrival)."""
        m, payload, start, reduced = item
        if self.reduce_cost and m.kind == "reduce" and not reduced:
            env = self.sim.env
            done = (
                max(env.now, self.reducing_until[m.dst]) + (m.shi - m.slo) * self.itemsize * self.reduce_cost
            )
            self.reducing_until[m.dst] = done
            self.lane.push(done - env.now, (m, payload, start, True))  # type: ignore[union-attr]
            return
        self._land(m, payload, start)

    def _arrive(self, ev: object) -> None:
        m, payload = ev.value  # type: ignore[attr-defined]
        if self.reduce_cost and m.kind == "reduce" and not getattr(ev, "reduced", False):
            self._reduce_later(ev, m)
            return
        self._land(m, payload, ev.start)  # type: ignore[attr-defined]

    def _land(self, m: Msg, payload: torch.Tensor | list | None, start: float) -> None:
        """Message ``m`` (sent at ``start``) arrives now: its data lands, and its receiver goes on."""
        deferred = self.deferred
        if deferred is not None:
            if payload is not None:  # a box (see DeferredData)
                reducing = m.kind == "reduce"
                if reducing and self.order is not None:
                    deferred.take(m.dst, self._dst_at[m.dst], m.dlo, m.dhi)
                slot = payload[1] if payload[0] is None else deferred.slot(payload)  # type: ignore[index]
                deferred.ops += (REDUCE if reducing else COPY, self._dst_at[m.dst], m.dlo, m.dhi, slot)
        elif payload is not None:
            dst = self.dst_bufs[m.dst][m.dlo : m.dhi]
            if m.kind == "reduce":
                if self.order is not None:
                    self.order.capture(m.dst, m.dlo, m.dhi)
                self.reduce(dst, payload)
            else:
                dst.copy_(payload)
        trace = self.sim.trace
        if trace.record_messages:
            trace.message(
                Message(
                    self.global_ranks[m.src],
                    self.global_ranks[m.dst],
                    self.streams[m.src],
                    self.streams[m.dst],
                    start,
                    self.sim.env.now,
                    (m.shi - m.slo) * self.itemsize,
                    self.name,
                )
            )
        d = m.dst
        miss = self.missing[d]
        miss[m.step] -= 1
        if m.step == self.first_missing[d] and miss[m.step] == 0:
            self._skip_complete(d)
        self._advance(d)

    def _reduce_later(self, ev: object, m: Msg) -> None:
        """Deliver the reduce message ``ev`` once its receiver has added it in, after its earlier reductions."""
        env = self.sim.env
        done = max(env.now, self.reducing_until[m.dst]) + (m.shi - m.slo) * self.itemsize * self.reduce_cost
        self.reducing_until[m.dst] = done
        later = Event(env)
        later._ok = True
        later._value = ev.value  # type: ignore[attr-defined]
        later.start = ev.start  # type: ignore[attr-defined]
        later.reduced = True  # type: ignore[attr-defined]
        for key in ("arrives_at", "owner_rank"):  # what a perturbed run orders ties by
            if hasattr(ev, key):
                setattr(later, key, getattr(ev, key))
        later.callbacks.append(self._arrive)
        env.schedule(later, NORMAL, done - env.now)
