"""Timed transfers over the cluster's directed links.

A transfer reserves every link of its route at once, first come first served in simulated-time order: it
starts when the sender issues it or when the last earlier transfer on any of those links has left, occupies
the links for ``bytes / min(bandwidth)`` seconds, and arrives after the route's summed latency on top. Two
transfers that share a link therefore take as long as the link needs for both, and an uncontended transfer
costs ``latency + bytes / bandwidth`` (the alpha-beta model). Routes come from the :class:`Cluster`.

A paced transfer (``pace=(latency, seconds_per_byte)``) reserves the same links but for ``bytes x
seconds_per_byte``, and arrives ``latency`` after it leaves: a collective timed by NCCL's model sends every
message so, so that its uncontended time is the model's while it still waits for, and delays, other
transfers on the links it crosses.

Under link faults (:class:`~simdist.network.faulty.LinkFaults`) a transfer takes the route still up when it is
sent, starts once its flapping links are up, moves at each link's bandwidth times its factor at that start,
and arrives after the added latencies and message delays on top; a crashed rank's messages never leave.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy
from simpy.core import NORMAL
from simpy.events import Event

from simdist.network.faulty import LinkFaults


class Network:
    """Link occupancy for one simulated run."""

    def __init__(self, env: simpy.Environment, cluster: Any) -> None:
        self.env = env
        self.cluster = cluster
        self._free_at = [0.0] * len(cluster.links)
        self._bw = [link.bandwidth for link in cluster.links]
        self._lat = [link.latency for link in cluster.links]
        self._routes: dict[tuple[int, int], tuple[tuple[int, ...], float, float]] = {}
        #: messages sent so far (``RunResult.messages``)
        self.messages = 0
        #: the run's link faults, or None (the plain model below)
        self.faults: LinkFaults | None = None
        perturbation = getattr(env, "perturbation", None)
        if perturbation is not None:
            self._jitter = perturbation.latency
            self._rng = perturbation.rng("latency")
            #: (src, dst) -> when its last message arrives, without and with jitter: jitter never lets a message
            #: overtake an earlier one that the model delivers first
            self._last: dict[tuple[int, int], tuple[float, float]] = {}
            self.send = self._send_perturbed  # type: ignore[method-assign]

    def _route(self, src: int, dst: int) -> tuple[tuple[int, ...], float, float]:
        key = (src, dst)
        hit = self._routes.get(key)
        if hit is None:
            route = tuple(self.cluster.route(src, dst))
            bw = min((self._bw[i] for i in route), default=float("inf"))
            lat = sum(self._lat[i] for i in route)
            hit = self._routes[key] = (route, 1.0 / bw, lat)
        return hit

    def send(
        self,
        src: int,
        dst: int,
        nbytes: int,
        callback: Callable[[Event], None],
        value: Any,
        pace: tuple[float, float] | None = None,
    ) -> None:
        """Send ``nbytes`` from global rank ``src`` to ``dst`` now (at the links' own speed, or at ``pace``).

        On arrival ``callback(event)`` runs, with ``event.value`` set to ``value`` and ``event.start`` to the
        simulated time (seconds) the bytes started to move. Runs once per message: written for speed.
        """
        env = self.env
        now = env.now
        faults = self.faults
        if faults is not None and src in faults.dead:
            return  # its process is gone: nothing it would send leaves
        self.messages += 1
        ev = Event(env)
        ev._ok = True
        ev._value = value
        ev.callbacks.append(callback)
        if src == dst:
            ev.start = now  # type: ignore[attr-defined]
            env.schedule(ev, NORMAL, 0.0)
            return
        if faults is not None:
            self._send_faulty(faults, src, dst, nbytes, ev, pace)
            return
        hit = self._routes.get((src, dst))
        route, inv_bw, lat = hit if hit is not None else self._route(src, dst)
        if pace is not None:
            lat, inv_bw = pace
        free = self._free_at
        start = now
        for i in route:
            if free[i] > start:  # noqa: PLR1730 - a compare is cheaper than max() on this hot path
                start = free[i]
        leave = start + nbytes * inv_bw
        for i in route:
            free[i] = leave
        ev.start = start  # type: ignore[attr-defined]
        env.schedule(ev, NORMAL, leave + lat - now)

    def _send_perturbed(
        self,
        src: int,
        dst: int,
        nbytes: int,
        callback: Callable[[Event], None],
        value: Any,
        pace: tuple[float, float] | None = None,
    ) -> None:
        """:meth:`send` in a perturbed run: the latency stretched by the run's jitter, arrivals between one pair
        of ranks kept in order, and the links and receiver reported to the clock (its partial-order reduction);
        link faults apply as in :meth:`send`."""
        env = self.env
        now = env.now
        faults = self.faults
        if faults is not None and src in faults.dead:
            return  # its process is gone: nothing it would send leaves
        self.messages += 1
        ev = Event(env)
        ev._ok = True
        ev._value = value
        ev.callbacks.append(callback)
        ev.arrives_at = dst  # type: ignore[attr-defined]
        ev.owner_rank = src  # type: ignore[attr-defined]  # a sender's messages to one rank keep their order
        if src == dst:
            ev.start = now  # type: ignore[attr-defined]
            env.schedule(ev, NORMAL, 0.0)
            return
        if faults is not None:
            route, start, leave, lat = self._faulty_timing(faults, src, dst, nbytes, pace)
        else:
            route, inv_bw, lat = self._route(src, dst)
            if pace is not None:
                lat, inv_bw = pace
            free = self._free_at
            start = max([now, *(free[i] for i in route)])
            leave = start + nbytes * inv_bw
            for i in route:
                free[i] = leave
        env.touch([("link", i) for i in route])  # type: ignore[attr-defined]
        ev.start = start  # type: ignore[attr-defined]
        arrive = leave + lat
        if self._jitter:
            modelled = arrive
            arrive = leave + lat * (1.0 + self._jitter * self._rng.random())
            before, before_jittered = self._last.get((src, dst), (0.0, 0.0))
            if modelled >= before:  # the model keeps this pair's order: so does the jitter
                arrive = max(arrive, before_jittered)
            self._last[(src, dst)] = (modelled, arrive)
        env.schedule(ev, NORMAL, arrive - now)

    def _faulty_timing(
        self, faults: LinkFaults, src: int, dst: int, nbytes: int, pace: tuple[float, float] | None
    ) -> tuple[tuple[int, ...], float, float, float]:
        """A transfer's route, start, departure and latency under link faults (the same figures where no fault
        applies); reserves its links until it has left."""
        now = self.env.now
        route = faults.route(src, dst, now)
        free = self._free_at
        start = max([now, *(free[i] for i in route)])
        start = faults.up_at(route, start)
        factors, added = faults.slowdown(route, start)
        if pace is not None:
            lat, inv_bw = pace
            inv_bw /= min(factors, default=1.0)
            lat += added
        else:
            bw = min((self._bw[i] * f for i, f in zip(route, factors)), default=float("inf"))
            inv_bw = 1.0 / bw
            lat = sum(self._lat[i] for i in route) + added
        lat += faults.delay(src, dst, now)
        leave = start + nbytes * inv_bw
        for i in route:
            free[i] = leave
        return tuple(route), start, leave, lat

    def _send_faulty(
        self, faults: LinkFaults, src: int, dst: int, nbytes: int, ev: Event, pace: tuple[float, float] | None
    ) -> None:
        """:meth:`send`'s timing under link faults (the same figures where no fault applies)."""
        _, start, leave, lat = self._faulty_timing(faults, src, dst, nbytes, pace)
        ev.start = start  # type: ignore[attr-defined]
        self.env.schedule(ev, NORMAL, leave + lat - self.env.now)
