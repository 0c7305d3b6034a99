"""``monitored_barrier`` as gloo runs it, in simulated time: rank 0 names the ranks that never arrive.

Every other rank sends rank 0 a small message and waits for rank 0's reply. Rank 0 waits for the ranks in
order, each until ``timeout`` after it entered the barrier (with ``wait_all_ranks``, each for the whole
``timeout``), then replies to all. A rank that does not arrive in time makes rank 0 raise gloo's
``[Rank 0]: Rank N failed to pass monitoredBarrier in T ms``; the ranks waiting for rank 0's reply then
raise too, as they do on real processes once rank 0 has failed, and their message carries rank 0's finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import simpy

from simdist.errors import SimTimeoutError

if TYPE_CHECKING:  # annotations only: the run's context imports the machinery, not the other way
    from simdist.comm.context import RunContext
    from simdist.comm.group import GroupState

#: bytes of each message (gloo sends a one-element int64 tensor each way)
MESSAGE_BYTES = 8


@dataclass
class Round:
    """Call number ``seq`` of ``monitored_barrier`` on one group, across its ranks."""

    seq: int
    #: per group rank: rank 0 has received its arrival message / it has received rank 0's reply
    arrived: dict[int, simpy.Event] = field(default_factory=dict)
    released: dict[int, simpy.Event] = field(default_factory=dict)
    #: rank 0's error text once it has failed
    failure: str | None = None


def _round(env: simpy.Environment, state: GroupState, grank: int) -> Round:
    rounds: dict[int, Round] = state.monitored_rounds
    seqs: list[int] = state.monitored_seq
    seq = seqs[grank]
    seqs[grank] += 1
    rnd = rounds.get(seq)
    if rnd is None:
        rnd = rounds[seq] = Round(seq)
        for r in range(1, state.size):
            rnd.arrived[r] = env.event()
            rnd.released[r] = env.event()
    return rnd


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def barrier(sim: RunContext, state: GroupState, grank: int, timeout: float | None, wait_all_ranks: bool) -> None:
    """Run group rank ``grank``'s part of one ``monitored_barrier`` on ``state`` (timeout in simulated seconds;
    None waits without limit)."""
    sim.settle()
    env = sim.env
    site = sim.call_site()
    rnd = _round(env, state, grank)
    me = state.global_ranks[grank]
    group = state.name or "default"
    if grank != 0:
        _follower(sim, state, rnd, grank, me, group, site)
        return
    limit = float("inf") if timeout is None else timeout
    start = env.now
    missing: list[int] = []
    for r in range(1, state.size):
        arrived = rnd.arrived[r]
        remaining = limit if wait_all_ranks else limit - (env.now - start)
        if not arrived.triggered and remaining > 0:
            desc = (
                f"rank {me} waits in monitored_barrier #{rnd.seq} on group {group} for rank "
                f"{state.global_ranks[r]} (issued at {site})"
            )
            waits = [arrived] if remaining == float("inf") else [arrived, env.timeout(remaining)]
            sim.baton.block(env.any_of(waits), desc)
        if arrived.triggered:
            continue
        if not wait_all_ranks:
            _fail(rnd, f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {_ms(limit)} ms", state, r, site)
        missing.append(r)
    if missing:
        ranks = ", ".join(str(r) for r in missing)
        _fail(rnd, f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {_ms(limit)} ms", state, missing, site)
    for r in range(1, state.size):
        released = rnd.released[r]
        sim.network.send(me, state.global_ranks[r], MESSAGE_BYTES, lambda ev, done=released: done.succeed(), None)


def _follower(sim: RunContext, state: GroupState, rnd: Round, grank: int, me: int, group: str, site: str) -> None:
    env = sim.env
    prefix = (
        f"Rank {grank} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
        f"from rank 0. Please check rank 0 logs for faulty rank."
    )
    if rnd.failure is None:
        arrived = rnd.arrived[grank]
        sim.network.send(me, state.global_ranks[0], MESSAGE_BYTES, lambda ev: arrived.succeed(), None)
        desc = f"rank {me} waits in monitored_barrier #{rnd.seq} on group {group} for rank {state.global_ranks[0]} (issued at {site})"
        released = rnd.released[grank]
        # gloo's other ranks wait with the group's timeout, not the barrier's: only rank 0 names the culprits
        if state.timeout is None:
            sim.baton.block(released, desc)
        else:
            sim.baton.block(env.any_of([released, env.timeout(state.timeout)]), desc)
        if released.triggered and rnd.failure is None:
            return
    if rnd.failure is None:
        raise SimTimeoutError(
            f"{prefix} Rank 0 did not answer within the group's timeout of {state.timeout:g} s of simulated time "
            f"(monitored_barrier issued at {site})."
        )
    raise SimTimeoutError(f"{prefix} Rank 0 reported: {rnd.failure}")


def _fail(rnd: Round, message: str, state: GroupState, missing: int | list[int], site: str) -> None:
    """Raise rank 0's error, and release the ranks waiting for its reply so that they raise too."""
    late = [missing] if isinstance(missing, int) else missing
    where = ", ".join(f"{r} (global rank {state.global_ranks[r]})" for r in late)
    rnd.failure = (
        f"{message} of simulated time: group rank(s) {where} of group {state.name or 'default'} never "
        f"called monitored_barrier #{rnd.seq} (rank 0 called it at {site})"
    )
    for ev in rnd.released.values():
        if not ev.triggered:
            ev.succeed()
    raise SimTimeoutError(rnd.failure)
