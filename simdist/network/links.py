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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import simpy
from simpy.core import NORMAL
from simpy.events import Event


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
        self.messages += 1
        ev = Event(env)
        ev._ok = True
        ev._value = value
        ev.callbacks.append(callback)
        if src == dst:
            ev.start = now  # type: ignore[attr-defined]
            env.schedule(ev, NORMAL, 0.0)
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
        of ranks kept in order, and the links and receiver reported to the clock (its partial-order reduction)."""
        env = self.env
        now = env.now
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
