"""Each rank's simulated time: the clock's ``now`` plus the compute the rank has queued but not yet waited out.

Compute is charged lazily: an op adds its seconds to the rank's pending time, and the rank sleeps them off
at its next synchronisation point (issuing or waiting on communication, polling, finishing), so a run of
ops costs one baton hand-off instead of one per op.
"""

from __future__ import annotations

from typing import Any

import simpy

from simdist.clock.baton import Baton, current_rank_state


class RankTime:
    """Per-rank compute time on one simpy clock, with the waits that advance it."""

    def __init__(self, env: simpy.Environment, baton: Baton) -> None:
        self.env = env
        self.baton = baton

    def charge(self, seconds: float) -> tuple[int, float, float] | None:
        """Queue ``seconds`` of compute on the calling rank: its (rank, start, end), or None outside a rank."""
        state = current_rank_state()
        if state is None or seconds <= 0:
            return None
        start = self.env.now + state.pending
        state.pending += seconds
        return state.rank, start, start + seconds

    def settle(self) -> None:
        """Advance simulated time over the calling rank's pending compute."""
        state = current_rank_state()
        if state is not None and state.pending > 0:
            pending, state.pending = state.pending, 0.0
            self.baton.sleep(pending, f"rank {state.rank} computing")

    def now(self) -> float:
        """The calling rank's current simulated time (seconds), pending compute included."""
        state = current_rank_state()
        return self.env.now + (state.pending if state is not None else 0.0)

    def let_time_pass(self, event: Any, description: str) -> None:
        """A rank polled an operation that is not done: move it on to the next simulated time at which
        something is scheduled (whatever is due earlier, other ranks' polls included, runs first).

        If nothing is scheduled after now, the operation can only complete by waiting, so the rank waits for
        it (and the run reports a deadlock if it never can) instead of polling forever.
        """
        now = self.env.now
        later = min((item[0] for item in self.env._queue if item[0] > now), default=float("inf"))
        if later == float("inf"):
            self.baton.block(event, description)
        else:
            self.baton.block(self.env.timeout(later - now), description)
