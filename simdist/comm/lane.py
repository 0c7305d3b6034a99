"""A queue of a collective's own messages, merged exactly into simpy's: the same order, fewer simpy events.

simpy processes events in the order of their keys ``(time, priority, id)``, the id counting every event
scheduled so far. A :class:`Lane` takes each of its items' keys from the environment's own counter at the
moment simpy would have scheduled it, keeps them in a heap of its own, and puts one event into simpy's queue
under the key of its head. When that event comes up, the lane delivers its items, one after another, for as
long as each comes before everything in simpy's queue, setting the clock to each one's time as simpy would.
So every item is handled at exactly the point among all the run's events where simpy would have handled it,
and what an item's delivery schedules (a wake-up, another rank's event) keeps its place too.

Only a plain environment merges this way: a perturbed one (exploration) decides ties itself, and link faults
time messages their own way; there the messages go through simpy.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any

import simpy
from simpy.core import NORMAL
from simpy.events import Event

#: whether collectives may use lanes at all (False: every message is a simpy event, as a reference to compare)
ENABLED = True


def lane_allowed(env: simpy.Environment, network: Any) -> bool:
    """Whether a collective on ``env`` and ``network`` may queue its messages on a lane."""
    return ENABLED and type(env) is simpy.Environment and network.faults is None


def proxy(
    env: simpy.Environment,
    key: tuple[float, int],
    posted: dict[tuple[float, int], Event],
    run: Callable[[Event], None],
) -> Event:
    """The event that stands in simpy's queue for a queue's item keyed ``key`` (time, event id), calling ``run`` when
    it comes up: the one ``posted`` holds for that key, or a new one put there (an item's key may come back to a
    queue's head while its old event still waits in simpy's queue; two entries of one key cannot be ordered)."""
    ev = posted.get(key)
    if ev is None:
        ev = posted[key] = Event(env)
        ev._ok = True
        ev._value = key
        ev.callbacks.append(run)
        heappush(env._queue, (key[0], NORMAL, key[1], ev))
    return ev


def _closed(item: Any) -> None:
    raise AssertionError(f"an item delivered on a closed lane: {item!r:.200}")


class Lane:
    """Items delivered by ``deliver(item)`` at their simulated times, in simpy's order."""

    def __init__(
        self, env: simpy.Environment, deliver: Callable[[Any], None], settle: Callable[[], None] | None = None
    ) -> None:
        self.env = env
        self.deliver = deliver
        #: called after each burst of deliveries, before anything else runs
        self.settle = settle
        self._listed = False
        self._heap: list[tuple[float, int, Any]] = []
        #: the simpy event that stands for the head of the heap, and its key (time, id)
        self._proxy: Event | None = None
        self._proxy_key: tuple[float, int] = (float("inf"), 0)
        #: proxies still in simpy's queue, by key: an item's key may come back to the head while its old proxy
        #: waits there (two entries of one key cannot be ordered)
        self._posted: dict[tuple[float, int], Event] = {}
        self._delivering = False

    def push(self, delay: float, item: Any) -> None:
        """Deliver ``item`` ``delay`` seconds from now, where ``env.schedule(event, NORMAL, delay)`` would."""
        env = self.env
        t = env._now + delay
        eid = next(env._eid)
        heappush(self._heap, (t, eid, item))
        if not self._listed:  # where a polling rank looks for the next due time (RankTime.let_time_pass)
            env.__dict__.setdefault("lanes", []).append(self)
            self._listed = True
        if not self._delivering and (t, eid) < self._proxy_key:
            self._post(t, eid)

    def close(self) -> None:
        """Nothing more will be pushed or delivered: drop the owner's callbacks (the owner holds the lane, and
        a cycle would keep the owner's buffers alive, and counted by the memory statistics, until a collection).
        """
        self.deliver = _closed
        self.settle = None

    @property
    def delivering(self) -> bool:
        """Whether a burst of deliveries is under way (no rank runs, nothing else is processed)."""
        return self._delivering

    def next_after(self, now: float) -> float:
        """The earliest time after ``now`` (seconds) at which an item is due (infinity: none)."""
        return min((t for t, _, _ in self._heap if t > now), default=float("inf"))

    def _post(self, t: float, eid: int) -> None:
        """Put an event standing for the item keyed ``(t, eid)`` into simpy's queue (an earlier one goes stale)."""
        key = (t, eid)
        self._proxy, self._proxy_key = proxy(self.env, key, self._posted, self._run), key

    def _run(self, ev: Event) -> None:
        """Deliver every item that comes before simpy's next event (the proxy ``ev`` has come up)."""
        del self._posted[ev._value]
        if ev is not self._proxy:
            return  # stale: an earlier item took its place
        self._proxy, self._proxy_key = None, (float("inf"), 0)
        env = self.env
        heap, queue = self._heap, env._queue
        self._delivering = True
        try:
            while heap:
                t, eid, item = heap[0]
                if queue:
                    qt, qp, qid, _ = queue[0]
                    if qt < t or (qt == t and (qp < NORMAL or (qp == NORMAL and qid < eid))):
                        break
                heappop(heap)
                env._now = t
                self.deliver(item)
        finally:
            self._delivering = False
        if self.settle is not None:
            self.settle()
        if heap:
            self._post(heap[0][0], heap[0][1])
        else:
            env.lanes.remove(self)  # type: ignore[attr-defined]
            self._listed = False
