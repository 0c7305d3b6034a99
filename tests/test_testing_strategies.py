"""simdist.testing's hypothesis strategies: every draw runs, each shrinks to today's plain run, and a failing
perturbation of the any_source_order scenario shrinks to one changed decision that no smaller one matches."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import explore_fns as fns
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

import simdist
from simdist.clock.schedule import ScheduleDivergence
from simdist.testing import FAULT_KINDS, clusters, faults, perturbations

SCENARIOS = str(Path(__file__).resolve().parent.parent / "scenarios")
sys.path.insert(0, SCENARIOS)  # scenarios are scripts, not a package: imported from their folder
try:
    any_source_order = importlib.import_module("any_source_order")
finally:
    sys.path.remove(SCENARIOS)

CPU4 = simdist.Cluster.switch(4, device="cpu")
#: hypothesis's search, the same on every run of the suite; without the explain phase, which runs the found example
#: again with each part varied to print what matters, which `find` never prints
FIND = settings(
    max_examples=30,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[phase for phase in Phase if phase is not Phase.explain],
)


def _fails(p: simdist.Perturbation) -> bool:
    """Whether the scenario's program fails under ``p`` (rank 0's assertion on the arrival order)."""
    try:
        simdist.run(any_source_order.collect, any_source_order.CLUSTER, perturbation=p)
    except simdist.RankError as e:
        assert isinstance(e.exc, AssertionError), e
        return True
    return False


def test_a_failing_perturbation_of_any_source_order_shrinks_to_one_changed_decision() -> None:
    minimal = find(perturbations(max_events=8, callbacks=False), _fails, settings=FIND)
    assert _fails(minimal)
    # one decision differs from today's run (option 0 everywhere), and nothing else is perturbed
    assert len([c for c in minimal.choices if c]) == 1 and minimal.choices[-1] != 0
    assert (minimal.latency, minimal.compute, minimal.callbacks) == (0.0, 0.0, False)
    # the oracle: no smaller perturbation fails, neither one decision fewer nor any choice lowered
    smaller = [minimal.choices[:i] + minimal.choices[i + 1 :] for i in range(len(minimal.choices))]
    smaller += [
        minimal.choices[:i] + (lower,) + minimal.choices[i + 1 :]
        for i, c in enumerate(minimal.choices)
        for lower in range(c)
    ]
    for choices in smaller:
        assert not _fails(
            simdist.Perturbation(ties="choices", choices=choices, wrap=True, callbacks=False)
        ), choices


@pytest.mark.parametrize("progress", ["nccl", "gloo"])
def test_the_simplest_perturbation_is_todays_run(progress: str) -> None:
    simplest = find(perturbations(jitter={"latency": 0.3, "compute": 0.3}), lambda p: True, settings=FIND)
    plain = simdist.run(fns.mixed, CPU4, progress=progress)
    assert (
        simdist.run(fns.mixed, CPU4, progress=progress, perturbation=simplest).trace_hash == plain.trace_hash
    )


def test_the_simplest_cluster_and_faults_are_two_ranks_on_a_switch_and_none() -> None:
    c = find(clusters(max_ranks=8), lambda c: True, settings=FIND)
    assert (c.world_size, c.name) == (2, "switch-2")
    big = simdist.Cluster.two_level(2, gpus_per_node=2, device="cpu")
    assert find(faults(big, kinds=FAULT_KINDS), lambda f: True, settings=FIND) == []
    with pytest.raises(NoSuchExample):
        find(clusters(max_ranks=3), lambda c: c.world_size > 3, settings=FIND)


@settings(max_examples=10, deadline=None)
@given(p=perturbations(max_events=12, jitter={"latency": 0.5}), c=clusters(max_ranks=5))
def test_every_drawn_perturbation_runs_on_every_drawn_cluster(
    p: simdist.Perturbation, c: simdist.Cluster
) -> None:
    res = simdist.run(fns.arrival_order, c, perturbation=p)
    assert sorted(res.returns[0]) == list(range(1, c.world_size))
    assert simdist.run(fns.arrival_order, c, perturbation=p).trace_hash == res.trace_hash


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_drawn_survivable_faults_slow_a_run_without_changing_its_result(data: st.DataObject) -> None:
    c = data.draw(clusters(max_ranks=4))
    drawn = data.draw(faults(c, max_faults=2))
    res = simdist.run(fns.ring_once, c, faults=drawn)
    assert res.returns == simdist.run(fns.ring_once, c).returns


def test_a_choice_past_the_tied_agents_counts_round_them_only_with_wrap() -> None:
    def run(choice: int, wrap: bool) -> str:
        p = simdist.Perturbation(ties="choices", choices=(choice,), wrap=wrap, callbacks=False)
        return simdist.run(fns.arrival_order, CPU4, perturbation=p).trace_hash

    # the agents tied at the first decision: the first choice a strict schedule cannot take
    agents = 0
    while True:
        try:
            run(agents, wrap=False)
        except ScheduleDivergence:
            break
        agents += 1
    assert agents >= 2
    for k in range(3 * agents):
        assert run(k, wrap=True) == run(k % agents, wrap=False)
    with pytest.raises(simdist.SimdistError, match="wrap must be True or False"):
        simdist.Perturbation(ties="choices", wrap=1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: perturbations(max_events=-1), "max_events must be an int >= 0"),
        (lambda: perturbations(jitter={"delay": 0.1}), "jitter must map 'latency' and/or 'compute'"),
        (lambda: perturbations(jitter={"latency": -1}), r"jitter\['latency'\] must be a finite number >= 0"),
        (lambda: clusters(max_ranks=1, min_ranks=2), "max_ranks 1 is below min_ranks 2"),
        (lambda: clusters(topologies=("mesh",)), "topologies must be some of"),
        (lambda: faults(4, kinds=("SlowLink",)), "link faults need a simdist.Cluster"),
        (lambda: faults(CPU4, kinds=("Meteor",)), "kinds must be some of"),
        (lambda: faults(CPU4, kinds=("NodeLoss",)), "NodeLoss needs a cluster of nodes"),
        (lambda: faults("4"), "give a simdist.Cluster or a world size"),
    ],
)
def test_bad_strategy_arguments_are_refused_naming_them(make, match: str) -> None:
    with pytest.raises(simdist.SimdistError, match=match):
        make()
