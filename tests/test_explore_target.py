"""Targets: simulations other than ``simdist.run`` (here the remote-tensor runtime's) explored, replayed by token,
checked for determinism and shipped to worker processes by reference."""

from __future__ import annotations

import json

import explore_targets as targets
import pytest

import simdist
from simdist.explore.runs import NONDETERMINISM

#: between the fastest and the slowest sessions the link's jitter gives: some runs fail, some pass
DEADLINE = targets.Deadline(limit=200e-6)


def test_a_target_is_explored_and_each_run_is_the_session_the_runtime_gives_for_its_perturbation() -> None:
    ex = simdist.explore(DEADLINE, runs=16, seed=1)
    assert ex.runs == 16 and 0 < len(ex.failures) < 16
    assert set(ex.by_kind()) == {"over the deadline"}  # the target names its failures' kind
    for outcome in ex.outcomes:
        # the oracle: the runtime's own session under that outcome's perturbation, run here directly
        session = simdist.runtime.simulate(
            targets.client,
            link=simdist.runtime.LinkSpec(jitter=DEADLINE.jitter),
            perturbation=outcome.perturbation,
        )
        assert outcome.trace_hash == session.trace_hash
        assert (outcome.kind is not None) == (session.sim_time > DEADLINE.limit)
        assert outcome.value == (None if outcome.kind else session.sim_time)
    assert ex.interleavings > 1  # the jitter reaches the link: the runs differ


def test_a_targets_failure_replays_from_its_token_alone() -> None:
    ex = simdist.explore(DEADLINE, runs=12, seed=2)
    failure = ex.failures[0]
    data = json.loads(failure.replay)
    assert data["program"] == {
        "module": "explore_targets",
        "name": "Deadline",
        "fields": {"limit": 200e-6, "jitter": 50e-6},
    }
    with pytest.raises(TimeoutError) as raised:
        simdist.replay(DEADLINE, failure.replay)
    assert raised.value.trace_hash == failure.trace_hash
    passed = next(o for o in ex.outcomes if o.kind is None)
    # a passing run's token is made the same way: its perturbation replays the same session
    ran = DEADLINE.run(passed.perturbation)
    assert ran.trace_hash == passed.trace_hash
    with pytest.warns(simdist.ReplayWarning, match="target's fields differ") as caught, pytest.raises(TimeoutError):
        simdist.replay(targets.Deadline(limit=1e-9), failure.replay)
    assert caught[0].filename == __file__  # the warning points at the replay call


def test_a_check_judges_what_the_target_returned() -> None:
    ex = simdist.explore(targets.Deadline(limit=1.0), runs=8, check=lambda seconds: seconds < 190e-6)
    slow = [o for o in ex.outcomes if o.value is not None and o.value >= 190e-6]
    assert [f.run for f in ex.failures] == [o.index for o in slow] and ex.failures
    assert {f.kind for f in ex.failures} == {"check failed"}


def test_a_target_that_replays_differently_is_reported_as_nondeterministic() -> None:
    ex = simdist.explore(targets.Drifting(), runs=2)
    assert [f.kind for f in ex.failures] == [NONDETERMINISM] * 2
    assert len(set(ex.failures[0].error.hashes)) == 3


@pytest.mark.parametrize(
    ("target", "kwargs", "match"),
    [
        (DEADLINE, {"cluster": "switch"}, "takes no cluster"),
        (DEADLINE, {"watchdog": 5.0}, r"options \['watchdog'\] do not apply"),
        (DEADLINE, {"strategy": "pct"}, "strategy='random' only, got 'pct'"),
        (DEADLINE, {"strategy": "exhaustive"}, "strategy='random' only, got 'exhaustive'"),
        (targets.NotADataclass(), {}, "must be a frozen dataclass"),
    ],
)
def test_explore_refuses_what_a_target_cannot_take(target, kwargs: dict, match: str) -> None:
    with pytest.raises(simdist.ExplorationError, match=match):
        simdist.explore(target, runs=2, **kwargs)


@pytest.mark.slow
def test_two_workers_rebuild_the_target_by_reference_and_find_exactly_what_one_finds() -> None:
    one = simdist.explore(DEADLINE, runs=6, seed=3, workers=1)
    two = simdist.explore(DEADLINE, runs=6, seed=3, workers=2)
    assert [(o.key(), o.value) for o in two.outcomes] == [(o.key(), o.value) for o in one.outcomes]
    assert [(f.run, f.kind, f.replay) for f in two.failures] == [
        (f.run, f.kind, f.replay) for f in one.failures
    ]
    assert one.failures and isinstance(two.failures[0].error, TimeoutError)


def test_shrinking_a_target_is_refused_with_the_reason() -> None:
    late = targets.Deadline(limit=1e-9)  # every session takes longer
    ex = simdist.explore(late, runs=1)
    assert ex.failures
    with pytest.raises(simdist.ShrinkError, match="is a target: shrinking replays a run's tie decisions"):
        simdist.shrink(late, None, ex.failures[0])
