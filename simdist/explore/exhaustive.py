"""Exhaustive search of a program's tie orders: a depth-first enumeration of every decision, with sleep sets.

A run is replayed from a prefix of decisions (stateless search, as CHESS does): it takes the prefix's options,
then at each further decision the first agent whose event is not asleep. After the run, the deepest decision
with an option neither explored nor asleep gives the next prefix.

Partial-order reduction (sleep sets, Godefroid 1996): once option ``a`` has been explored at a decision, the
branch that takes ``b`` there puts ``a`` to sleep if ``a`` and ``b`` commute, and ``a`` stays asleep until an
event that does not commute with it runs; a run that would take a sleeping event was already covered by the
``a``-first branch (``b a ...`` reaches what ``a b ...`` reached) and is cut short. Two events commute when
their footprints are disjoint (see :mod:`simdist.clock.schedule`): a message arrival that only wrote its
receiver's buffer, reserved links and sent further messages commutes with one at another receiver over other
links; an event that ran rank code, completed a work or fired a timer is taken to conflict with every other.
Sleep sets are sound for any such conservative relation: every order's outcome is reached by some explored run
that differs from it only in the order of commuting events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from simdist.clock.schedule import EventId, PerturbedEnvironment, ScheduleDivergence
from simdist.explore.errors import SearchSpaceError
from simdist.explore.runs import Outcome

Footprint = frozenset | None


class Pruned(BaseException):
    """Raised in the simulator to cut a run short: every order from its state on was explored already.

    A ``BaseException`` so that no handler of ordinary errors takes it for the program's failure."""


def independent(a: Footprint, b: Footprint) -> bool:
    """Whether two processed events commute: both footprints known and disjoint."""
    return a is not None and b is not None and not (a & b)


@dataclass
class Node:
    """A decision of the search: the tied agents' events, what was explored there, the sleep set on entry."""

    options: list[EventId]
    #: option -> its footprint, for every option explored here so far (in order)
    explored: dict[EventId, Footprint] = field(default_factory=dict)
    sleep: dict[EventId, Footprint] = field(default_factory=dict)
    #: the option the latest run took here
    current: int = 0


class Enumerator:
    """The tie chooser of one run of the search."""

    def __init__(self, prefix: Sequence[int], branch_sleep: dict[EventId, Footprint]) -> None:
        self._prefix = prefix
        self._branch_sleep = branch_sleep
        #: the sleep set, once past the prefix's earlier decisions (None before)
        self._sleep: dict[EventId, Footprint] | None = {} if not prefix else None
        self.nodes: list[Node] = []
        self._waiting: tuple[Node, EventId] | None = None

    def choose(self, env: PerturbedEnvironment, options: Sequence) -> int:
        ids = [ev._sd_id for ev in options]
        k = len(self.nodes)
        if k < len(self._prefix):
            choice = self._prefix[k]
            if choice >= len(ids):
                raise ScheduleDivergence(k, choice, len(ids))
            node = Node(ids, current=choice)
            if k == len(self._prefix) - 1:
                node.sleep = dict(self._branch_sleep)
                self._sleep = dict(self._branch_sleep)
        else:
            sleep = self._sleep or {}
            awake = [i for i, e in enumerate(ids) if e not in sleep]
            if not awake:
                raise Pruned()
            choice = awake[0]
            node = Node(ids, sleep=dict(sleep), current=choice)
        self.nodes.append(node)
        self._waiting = (node, ids[choice])
        return choice

    def after(self, env: PerturbedEnvironment, event: object, footprint: Footprint) -> None:
        if self._waiting is not None:
            node, chosen = self._waiting
            node.explored[chosen] = footprint
            self._waiting = None
        sleep = self._sleep
        if sleep is None or not sleep:
            return
        if event._sd_id in sleep:  # type: ignore[attr-defined]
            raise Pruned()
        self._sleep = {e: f for e, f in sleep.items() if independent(f, footprint)}


def search(run: Callable[[Enumerator], Outcome], limit: int) -> Iterator[Outcome]:
    """Every outcome of a depth-first search of the decisions, each run made by ``run(chooser)``.

    Raises :class:`SearchSpaceError` when more than ``limit`` runs would be needed (after yielding ``limit``)."""
    path: list[Node] = []
    prefix: list[int] = []
    branch_sleep: dict[EventId, Footprint] = {}
    done = 0
    while True:
        chooser = Enumerator(prefix, branch_sleep)
        outcome = run(chooser)
        done += 1
        fresh = chooser.nodes
        if prefix:
            branch = path[len(prefix) - 1]
            branch.explored.update(fresh[len(prefix) - 1].explored)
        path = path[: len(prefix)] + fresh[len(prefix) :]
        yield outcome
        nxt = _backtrack(path)
        if nxt is None:
            return
        j, option = nxt
        if done >= limit:
            raise SearchSpaceError(
                f"exhaustive search: the program's tie orders need more than runs={limit} runs (decision {j} of a "
                f"run still has unexplored orders; its runs met up to {max(len(path), 1)} decisions): raise runs=, make "
                "the program smaller (fewer ranks, steps or messages), or use strategy='pct' or 'random'"
            )
        node = path[j]
        branch_sleep = {**node.sleep, **node.explored}
        node.current = option
        prefix = [n.current for n in path[: j + 1]]
        path = path[: j + 1]


def _backtrack(path: list[Node]) -> tuple[int, int] | None:
    """The deepest decision with an option neither explored nor asleep, and that option."""
    for j in range(len(path) - 1, -1, -1):
        node = path[j]
        for i, e in enumerate(node.options):
            if e not in node.explored and e not in node.sleep:
                return j, i
    return None
