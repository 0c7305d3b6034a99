"""The exhaustive search's partial-order reduction is sound: on random programs of tagged events it reaches every
final state the unreduced search reaches (the oracle: the same search with every pair of events conflicting)."""

from __future__ import annotations

from collections import defaultdict

import explore_fns as fns
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from simpy.events import NORMAL, Event

import simdist
from simdist import Perturbation
from simdist.clock.schedule import PerturbedEnvironment
from simdist.explore import exhaustive
from simdist.explore.runs import Outcome

#: an event: (time, sender, receiver or None for an event that touches everything, follow-up receivers)
Spec = tuple[int, int, "int | None", tuple[int, ...]]

specs = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.integers(0, 2),
        st.one_of(st.none(), st.integers(0, 2)),
        st.lists(st.integers(0, 2), max_size=2).map(tuple),
    ),
    min_size=1,
    max_size=5,
)


def _run(program: list[Spec], chooser: exhaustive.Enumerator) -> tuple:
    """Run ``program`` on a perturbed clock: each event appends its sender to its receiver's log (a wide one to
    every log) and sends its follow-ups, from its receiver, at the same time. Returns the logs."""
    env = PerturbedEnvironment(Perturbation(ties="choices"), chooser)
    logs: dict[object, list[int]] = defaultdict(list)

    def post(sender: int, receiver: int | None, follow: tuple[int, ...], delay: float) -> None:
        ev = Event(env)
        ev._ok, ev._value = True, None
        ev.owner_rank = sender
        if receiver is not None:
            ev.arrives_at = receiver

        def processed(_ev: Event) -> None:
            if receiver is None:
                for r in range(3):
                    logs[r].append(-1 - sender)
                return
            logs[receiver].append(sender)
            for nxt in follow:
                post(receiver, nxt, (), 0)

        ev.callbacks.append(processed)
        env.schedule(ev, NORMAL, delay)

    for t, sender, receiver, follow in program:
        post(sender, receiver, follow, t)
    env.run()
    return tuple(tuple(logs[r]) for r in range(3))


def _search(program: list[Spec]) -> tuple[set, int]:
    states = set()
    runs = 0

    def one(chooser: exhaustive.Enumerator) -> Outcome:
        nonlocal runs
        runs += 1
        try:
            states.add(_run(program, chooser))
        except exhaustive.Pruned:
            return Outcome(runs, Perturbation(), "", pruned=True)
        return Outcome(runs, Perturbation(), "")

    for _ in exhaustive.search(one, 100_000):
        pass
    return states, runs


@settings(max_examples=60, deadline=None)
@given(program=specs)
def test_the_reduced_search_reaches_every_final_state_of_the_full_one(program: list[Spec]) -> None:
    reduced, reduced_runs = _search(program)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exhaustive, "independent", lambda a, b: False)
        full, full_runs = _search(program)
    assert reduced == full
    assert reduced_runs <= full_runs


def test_the_reduction_prunes_commuting_arrivals() -> None:
    # three messages due together at three different receivers commute: one order suffices, where the full
    # search takes all 3! = 6
    program = [(0, 0, 1, ()), (0, 1, 2, ()), (0, 2, 0, ())]
    states, runs = _search(program)
    assert len(states) == 1
    assert runs < 6
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exhaustive, "independent", lambda a, b: False)
        assert _search(program)[1] == 6


def test_a_ring_all_reduces_ties_are_reduced_in_a_real_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = simdist.Cluster.switch(2, device="cpu")
    reduced = simdist.explore(fns.ring_once, cluster, runs=500, strategy="exhaustive")
    monkeypatch.setattr(exhaustive, "independent", lambda a, b: False)
    full = simdist.explore(fns.ring_once, cluster, runs=500, strategy="exhaustive")
    assert reduced.runs - reduced.pruned < full.runs
    assert {tuple(o.decisions[:1]) for o in reduced.outcomes} == {
        tuple(o.decisions[:1]) for o in full.outcomes
    }
