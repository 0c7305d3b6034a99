"""The simpy clock of a perturbed run: events due at the same time are taken in an order a chooser picks.

simpy takes events in (time, priority, insertion id) order. :class:`PerturbedEnvironment` keeps time and
priority (URGENT before NORMAL is simpy's own machinery) and lets a :class:`TieChooser` decide among events that
tie on both. Each event belongs to an *agent*: the rank whose thread scheduled it, or, for an event the
simulator scheduled while processing another, that event's agent (a message's arrival is its sender's; a rank's
wake-up its own). An agent's events keep their insertion order among themselves, so messages between two ranks
never overtake one another and a rank's own steps stay in program order; the chooser picks which agent goes
next. A *decision* is a tie with several agents: the only place a run's order can differ.

For partial-order reduction each processed event leaves a *footprint*: what its processing touched. A message
arrival whose processing only copied into its receiver, reserved links and sent further arrivals touches its
receiver and those links; anything else (a rank thread ran, a work completed, a timer fired) touches
everything, :data:`WIDE`. Two events with disjoint footprints commute (see ``simdist.explore.exhaustive``).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import simpy
from simpy.core import EmptySchedule, StopSimulation
from simpy.events import NORMAL, Event, EventPriority

from simdist.clock.baton import current_rank_state
from simdist.clock.perturbation import Perturbation
from simdist.errors import SimdistError

#: the footprint of an event whose effects are not tracked: it depends on every other event
WIDE = None

#: an event's identity across runs that take the same decisions: (agent, how many events that agent scheduled
#: before it)
EventId = tuple[int, int]


class TieChooser(Protocol):
    """Picks which agent's event runs at a decision."""

    def choose(self, env: PerturbedEnvironment, options: Sequence[Event]) -> int:
        """The index in ``options`` (each agent's first tied event, in insertion order) to run now."""

    def after(self, env: PerturbedEnvironment, event: Event, footprint: frozenset | None) -> None:
        """``event`` was processed, touching ``footprint`` (:data:`WIDE` for everything)."""


class Fifo:
    """simpy's own order: the first scheduled."""

    def choose(self, env: PerturbedEnvironment, options: Sequence[Event]) -> int:
        return 0

    def after(self, env: PerturbedEnvironment, event: Event, footprint: frozenset | None) -> None:
        pass


class Random(Fifo):
    """A uniformly drawn agent at each decision."""

    def __init__(self, p: Perturbation) -> None:
        self._rng = p.rng("ties")

    def choose(self, env: PerturbedEnvironment, options: Sequence[Event]) -> int:
        return self._rng.randrange(len(options))


class PCT(Fifo):
    """Probabilistic concurrency testing (Burckhardt, Kothari, Musuvathi, Nagarakatte, ASPLOS 2010).

    Each agent gets a distinct random priority above ``depth`` when first seen; the highest-priority agent goes at
    every decision. At ``depth - 1`` decisions drawn uniformly from the first ``steps``, the agent that just
    went drops to priority ``depth - i`` (below every initial one). A bug that needs ``d`` ordering constraints
    among ``n`` agents over ``k`` decisions is hit with probability at least ``1 / (n k^(d-1))``.
    """

    def __init__(self, p: Perturbation) -> None:
        self._rng = p.rng("pct")
        self._depth = p.depth
        draws = sorted(self._rng.randint(1, p.steps) for _ in range(p.depth - 1))
        #: decision number -> the priority the agent that runs there drops to
        self._changes = {k: p.depth - 1 - i for i, k in enumerate(draws)}
        self._priority: dict[int, float] = {}
        self._decisions = 0

    def choose(self, env: PerturbedEnvironment, options: Sequence[Event]) -> int:
        prio = self._priority
        for ev in options:
            if ev._sd_agent not in prio:  # type: ignore[attr-defined]
                prio[ev._sd_agent] = self._depth + self._rng.random()  # type: ignore[attr-defined]
        i = max(range(len(options)), key=lambda j: prio[options[j]._sd_agent])  # type: ignore[attr-defined]
        self._decisions += 1
        drop = self._changes.get(self._decisions)
        if drop is not None:
            prio[options[i]._sd_agent] = drop  # type: ignore[attr-defined]
        return i


class Choices(Fifo):
    """Explicit decisions, then simpy's order; with ``wrap``, a choice past the options counts round them."""

    def __init__(self, choices: Sequence[int], wrap: bool = False) -> None:
        self._choices = choices
        self._wrap = wrap
        self._next = 0

    def choose(self, env: PerturbedEnvironment, options: Sequence[Event]) -> int:
        k = self._next
        self._next += 1
        if k < len(self._choices):
            c = self._choices[k]
            if self._wrap:
                return c % len(options)
            if c >= len(options):
                raise ScheduleDivergence(k, c, len(options))
            return c
        return 0


class ScheduleDivergence(SimdistError):
    """An explicit decision names an option the run does not have: the program or simdist changed since the
    decisions were recorded (or the program is not deterministic)."""

    def __init__(self, decision: int, choice: int, options: int) -> None:
        super().__init__(
            f"decision {decision} of the replayed schedule takes option {choice}, but the run has {options} tied "
            "agents there: the program, its inputs or simdist changed since the schedule was recorded, or the "
            "program is not deterministic"
        )


def chooser_for(p: Perturbation) -> TieChooser:
    """The chooser ``p.ties`` names."""
    if p.ties == "random":
        return Random(p)
    if p.ties == "pct":
        return PCT(p)
    if p.ties == "choices":
        return Choices(p.choices, p.wrap)
    return Fifo()


class PerturbedEnvironment(simpy.Environment):
    """A simpy environment whose ties are broken by a :class:`TieChooser` (see the module's docstring)."""

    def __init__(self, perturbation: Perturbation, chooser: TieChooser | None = None) -> None:
        super().__init__()
        self.perturbation = perturbation
        self.chooser = chooser if chooser is not None else chooser_for(perturbation)
        #: the option taken at each decision, in order (what ``ties="choices"`` replays)
        self.decisions: list[int] = []
        #: agents seen at decisions
        self.agents: set[int] = set()
        #: each decision's simulated time (seconds) and its tied agents in insertion order (option i is ``agents[i]``)
        self.ties: list[tuple[float, tuple[int, ...]]] = []
        self._serial: dict[int, int] = {}
        self._setup = 0
        self._active: int | None = None
        #: what the event being processed has touched so far (None: everything)
        self._touched: set[Hashable] | None = None

    # ------------------------------------------------------------------ scheduling
    def schedule(self, event: Event, priority: EventPriority = NORMAL, delay: float = 0) -> None:
        agent = getattr(event, "owner_rank", None)
        if agent is None:
            state = current_rank_state()
            if state is not None:
                agent = state.owner.rank
            elif self._active is not None:
                agent = self._active
            else:  # scheduled before the run started: an agent of its own
                self._setup += 1
                agent = -self._setup
        n = self._serial.get(agent, 0)
        self._serial[agent] = n + 1
        event._sd_agent = agent  # type: ignore[attr-defined]
        event._sd_id = (agent, n)  # type: ignore[attr-defined]
        if getattr(event, "arrives_at", None) is None:
            self._touched = None  # an untracked effect: this step may depend on anything
        elif self._touched is not None:
            self._touched.add(agent)  # the agent's order of events is state too
        heapq.heappush(self._queue, (self._now + delay, priority, next(self._eid), event))

    def touch(self, resources: Sequence[Hashable]) -> None:
        """The event being processed reserved or changed ``resources`` (links, as ``("link", i)``)."""
        if self._touched is not None:
            self._touched.update(resources)

    # ------------------------------------------------------------------ stepping
    def step(self) -> None:
        queue = self._queue
        if not queue:
            raise EmptySchedule()
        entry = self._pick(queue)
        self._now = entry[0]
        event = entry[3]
        receiver = getattr(event, "arrives_at", None)
        self._touched = None if receiver is None else {receiver}
        self._active = event._sd_agent  # type: ignore[attr-defined]
        callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
        try:
            for callback in callbacks:
                callback(event)
        except StopSimulation:
            event.callbacks = callbacks[callbacks.index(callback) + 1 :]
            self.schedule(event, EventPriority(-1))
            raise
        finally:
            self._active = None
        touched = self._touched
        self.chooser.after(self, event, None if touched is None else frozenset(touched))
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc

    def _pick(self, queue: list[Any]) -> Any:
        """Pop the next entry: the earliest, with the chooser deciding among agents that tie with it."""
        head = queue[0]
        when, priority = head[0], head[1]
        # Every entry tying with the root has only tying ancestors, so a tie exists iff a child of the root ties.
        n = len(queue)
        if not (
            (n > 1 and queue[1][0] == when and queue[1][1] == priority)
            or (n > 2 and queue[2][0] == when and queue[2][1] == priority)
        ):
            return heapq.heappop(queue)
        key = (when, priority)
        tied = [heapq.heappop(queue)]
        while queue and queue[0][:2] == key:
            tied.append(heapq.heappop(queue))
        firsts: dict[int, Any] = {}
        for entry in tied:  # popped in insertion order
            firsts.setdefault(entry[3]._sd_agent, entry)
        pick = tied[0]
        if len(firsts) > 1:
            options = list(firsts.values())
            i = self.chooser.choose(self, [e[3] for e in options])
            self.decisions.append(i)
            self.agents.update(firsts)
            self.ties.append((key[0], tuple(firsts)))
            pick = options[i]
        for entry in tied:
            if entry is not pick:
                heapq.heappush(queue, entry)
        return pick
