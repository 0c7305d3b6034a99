"""Ranks that crash (``simdist.faults.Crash``, ``NodeLoss``): their deaths, and what their peers are told.

A crash ends the rank's process at its simulated time: each of its threads raises ``RankCrashed`` where it
waits, and nothing it would send leaves any more (messages already on the wire arrive). Its peers meet what
NCCL gives them: a collective that waits for the dead rank never completes. Without a timeout they hang, which
the run turns into a diagnosis naming the dead rank and where it died (:meth:`Crashes.error`); with one, their
wait raises the timeout, whose message names the crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from simdist.clock.baton import RankCrashed
from simdist.errors import DeadlockError, RankCrashError, safe_str
from simdist.faults.plan import counted_crashes, timed_crashes
from simdist.faults.specs import Fault
from simdist.ranks import format_ranks

if TYPE_CHECKING:  # annotations only: the run's context imports the machinery, not the other way
    from simdist.comm.context import RunContext


@dataclass(frozen=True)
class Death:
    """How one rank died: when (simulated seconds), what it was doing, and the fault that killed it."""

    time: float
    where: str
    fault: str

    def describe(self, rank: int) -> str:
        return f"rank {rank} crashed at simulated time {self.time:.9g} s ({self.fault}) {self.where}"


class Crashes:
    """The crash faults of one run: scheduled deaths, deaths at a rank's k-th collective, and the dead."""

    def __init__(self, sim: RunContext, faults: tuple[Fault, ...]) -> None:
        self.sim = sim
        self.timed = timed_crashes(faults, sim.cluster.ranks_per_node)
        #: rank -> (k, fault): the rank dies as it issues its k-th collective
        self.counted = counted_crashes(faults)
        #: collectives each rank has issued so far
        self.issued: dict[int, int] = {}
        #: global rank -> how it died, in order of death
        self.dead: dict[int, Death] = {}

    def schedule(self) -> None:
        """Put the timed crashes on the clock (before any rank starts)."""
        env = self.sim.env
        for at, rank, fault in self.timed:
            env.timeout(at - env.now).callbacks.append(lambda _ev, r=rank, f=fault: self._kill(r, f))

    def _kill(self, rank: int, fault: str) -> None:
        """Rank ``rank`` dies now (simpy side)."""
        if rank in self.dead or self.sim.baton.ranks[rank].finished:
            return  # already dead, or its process had ended
        self._record(rank, fault, None)
        waiting = self.sim.baton.crash(rank, self._why(rank))
        doing = waiting.removeprefix(f"rank {rank} ") if waiting else ""
        if doing.startswith("waits "):
            doing = "waiting " + doing.removeprefix("waits ")
        where = f"while {doing}" if waiting else "before it started"
        self.dead[rank] = Death(self.sim.env.now, where, fault)

    def _record(self, rank: int, fault: str, where: str | None) -> None:
        self.dead[rank] = Death(self.sim.env.now, where or "", fault)
        network_faults = self.sim.network.faults
        if network_faults is not None:
            network_faults.dead.add(rank)

    def _why(self, rank: int) -> str:
        return f"rank {rank}'s process crashed ({self.dead[rank].fault})"

    def before_collective(self, rank: int) -> None:
        """Rank ``rank`` (the calling thread) is about to issue a collective: it dies here if that is its k-th."""
        hit = self.counted.get(rank)
        count = self.issued[rank] = self.issued.get(rank, 0) + 1
        if hit is None or count != hit[0] or rank in self.dead:
            return
        # the rank reaches the issue point once its host has spent the compute it charged before it: its death
        # is at that time, not when its last wait ended
        self.sim.settle()
        self._record(
            rank, hit[1], f"as it issued its {_ordinal(count)} collective, at {self.sim.call_site()}"
        )
        self.sim.baton.mark_crashed(rank, self._why(rank))
        # its other threads (those it started, its callback thread) die once this one hands the baton back
        env = self.sim.env
        env.timeout(0).callbacks.append(lambda _ev: self.sim.baton.crash(rank, self._why(rank)))
        raise RankCrashed(self._why(rank))

    def note(self, ranks: list[int]) -> str:
        """What a message about ``ranks`` that never joined adds: which of them crashed, when and where."""
        dead = [r for r in ranks if r in self.dead]
        return " ".join(self.dead[r].describe(r) + "." for r in dead)

    def error(self, failure: BaseException | None) -> RankCrashError:
        """The run's error once a rank has crashed: the deaths, then what the survivors met (``failure``: the
        run's own diagnosis or a survivor's error; None when the survivors finished)."""
        lines = [self.dead[r].describe(r) + "." for r in self.dead]
        dead = format_ranks(list(self.dead))
        verb = "joins" if len(self.dead) == 1 else "join"
        if len(self.dead) == len(self.sim.baton.ranks):
            lines.append(
                "Every rank crashed: a real launch reports each process as failed (torchrun's ChildFailedError)."
            )
        elif failure is None:
            lines.append(
                f"The other ranks finished. A real launch reports {dead}'s process as failed (torchrun's "
                f"ChildFailedError), whatever its peers did."
            )
        elif isinstance(failure, DeadlockError):
            lines.append(
                f"Its peers hang: they wait in collectives that {dead} never {verb} or that never complete. On real NCCL "
                f"without a timeout they wait forever; with init_process_group(timeout=...) their collective times out. "
                f"Where every rank was:\n{safe_str(failure)}"
            )
        else:
            lines.append(f"Its peers failed: {type(failure).__name__}: {safe_str(failure)}")
        return RankCrashError("\n".join(lines), {r: d.time for r, d in self.dead.items()}, failure)


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
