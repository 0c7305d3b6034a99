"""Where the callbacks chained to a rank's futures run: a thread of that rank, as gloo's worker threads.

On real hardware a future's ``then()`` callbacks run in a thread of the rank's own process, so they may issue
collectives and wait on them (torch's PowerSGD hook does). The simulator completes operations in its own thread,
which can neither issue nor wait as a rank; so completing a future that has callbacks is posted to the rank's
callback thread (:meth:`Baton.spawn`), which runs them at the same simulated time, acting as the rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import simpy

from simdist.clock.baton import Baton, RankState
from simdist.comm.thread_world import acting_as

#: what the callback thread waits on when it has nothing to do (a deadlock report leaves such threads out)
IDLE = "waiting for futures to complete (idle)"


class FutureCallbacks:
    """One callback thread per rank, started when the rank's first future with callbacks completes."""

    def __init__(self, env: simpy.Environment, baton: Baton) -> None:
        self.env = env
        self.baton = baton
        self._queues: dict[int, deque[Callable[[], Any]]] = {}
        self._wake: dict[int, simpy.Event] = {}
        self._threads: dict[int, RankState] = {}
        perturbation = getattr(env, "perturbation", None)
        #: draws which due completion runs next in a perturbed run (None: the order they were posted)
        self._rng = perturbation.rng("callbacks") if perturbation is not None and perturbation.callbacks else None

    def post(self, rank: int, complete: Callable[[], Any]) -> None:
        """Run ``complete()`` (which runs the future's callbacks) in ``rank``'s callback thread, now."""
        queue = self._queues.setdefault(rank, deque())
        queue.append(complete)
        if rank not in self._threads:
            self._threads[rank] = self.baton.spawn(
                lambda: self._serve(rank), rank=rank, name=f"simdist-rank-{rank}-callbacks", service=True
            )
            return
        wake = self._wake.pop(rank, None)
        if wake is not None and not wake.triggered:
            wake.succeed()

    def _serve(self, rank: int) -> None:
        queue = self._queues[rank]
        with acting_as(rank):
            while True:
                while queue:
                    if self._rng is not None and len(queue) > 1:
                        queue.rotate(-self._rng.randrange(len(queue)))
                    queue.popleft()()
                wake = self._wake[rank] = self.env.event()
                self.baton.block(wake, IDLE)
