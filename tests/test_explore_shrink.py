"""``simdist.shrink``: a failing run reduced to the fewest decisions off the unperturbed order, and where it
departs from the unperturbed run.

The planted bug: on 3 ranks, rank 0 receives from any source and fails exactly when rank 2's value comes before
rank 1's (``explore_fns.any_source_order``). So every failing run needs one reordering and one suffices: rank 2
going before rank 1 at a tie. That is the oracle the shrunk case is held to.
"""

from __future__ import annotations

import dataclasses
import json

import explore_fns as fns
import pytest
from hypothesis import HealthCheck, given, settings

import simdist
from simdist.clock.perturbation import Perturbation
from simdist.engine.runner import Observed, run_observed
from simdist.explore.divergence import first_difference
from simdist.explore.runs import NONDETERMINISM
from simdist.explore.shrink import ShrinkError, shrink_kinds
from simdist.options import RunOptions
from simdist.testing import perturbations
from simdist.trace.trace import Span, Trace

CPU3 = simdist.Cluster.switch(3, device="cpu")
KIND = "RankError (AssertionError)"


@pytest.fixture(scope="module")
def jittered() -> simdist.Exploration:
    """A random exploration with jitter and drawn callbacks: its failures depart from the plain order in several
    ways at once."""
    ex = simdist.explore(fns.any_source_order, CPU3, runs=12, seed=3, jitter={"latency": 0.5, "compute": 0.3})
    assert ex.failures, "the planted bug is found in 12 random runs"
    return ex


def _replayed_hash(token: str) -> str:
    with pytest.raises(simdist.RankError) as info:
        simdist.replay(fns.any_source_order, CPU3, token)
    return info.value.trace_hash  # type: ignore[attr-defined]


def test_a_failure_needing_one_reordering_shrinks_to_rank_2_before_rank_1(
    jittered: simdist.Exploration,
) -> None:
    for failure in jittered.failures[:3]:
        s = simdist.shrink(fns.any_source_order, CPU3, failure)
        assert s.kind == KIND and "arrival order [2, 1]" in str(s.error)
        assert len(s.decisions) == 1, s.describe()
        (d,) = s.decisions
        assert (d.went, d.instead_of) == (2, 1) and d.agents[0] == 1 and d.time == 0.0
        # the jitter and the callback draws are not needed, and nothing else departs from the plain order
        p = s.perturbation
        assert (p.latency, p.compute, p.callbacks, p.seed, p.wrap) == (0.0, 0.0, False, 0, False)
        assert sum(1 for c in p.choices if c) == 1 and p.choices[-1] != 0
        assert s.complete and s.runs <= 30
        assert not s.notes  # as explicit decisions with its jitter, the run took the same trace
        assert _replayed_hash(s.replay) == s.trace_hash


def test_decisions_with_the_same_jitter_replay_the_same_trace(jittered: simdist.Exploration) -> None:
    """A random or PCT run re-expressed as its explicit decisions, its jitter kept, is the same run."""
    options = RunOptions.from_keywords()
    for outcome in jittered.outcomes[1:6]:
        p = outcome.perturbation
        explicit = dataclasses.replace(p, ties="choices", choices=tuple(outcome.decisions))
        observed = Observed()
        try:
            run_observed(fns.any_source_order, CPU3, options, explicit, observed)
        except simdist.RankError:
            pass
        assert observed.trace is not None and observed.trace.hash() == outcome.trace_hash
        assert observed.decisions == outcome.decisions


def test_pct_failures_shrink_and_replay() -> None:
    ex = simdist.explore(
        fns.any_source_order, simdist.Cluster.switch(4, device="cpu"), runs=6, strategy="pct"
    )
    s = simdist.shrink(fns.any_source_order, simdist.Cluster.switch(4, device="cpu"), ex.failures[0])
    assert len(s.decisions) == 1 and s.kind == ex.failures[0].kind
    with pytest.raises(simdist.RankError) as info:
        simdist.replay(fns.any_source_order, simdist.Cluster.switch(4, device="cpu"), s.replay)
    assert info.value.trace_hash == s.trace_hash  # type: ignore[attr-defined]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=perturbations(max_events=6, jitter={"latency": 0.5}))
def test_shrink_never_returns_a_passing_token(jittered: simdist.Exploration, p: Perturbation) -> None:
    """Whatever perturbation made the run fail, the shrunk token fails the same way with the same trace, and
    the one decision it keeps is the planted bug's."""
    base = json.loads(jittered.failures[0].replay)
    base["perturbation"] = p.to_json()
    token = json.dumps(base)
    try:
        simdist.replay(fns.any_source_order, CPU3, token)
    except simdist.RankError:
        s = simdist.shrink(fns.any_source_order, CPU3, token, max_runs=40)
        assert _replayed_hash(s.replay) == s.trace_hash and s.kind == KIND
        assert [(d.went, d.instead_of) for d in s.decisions] == [(2, 1)]
    else:
        with pytest.raises(ShrinkError, match="passes"):
            simdist.shrink(fns.any_source_order, CPU3, token)


def test_a_passing_token_is_refused(jittered: simdist.Exploration) -> None:
    data = json.loads(jittered.failures[0].replay)
    data["perturbation"] = Perturbation(ties="fifo", callbacks=False).to_json()
    with pytest.raises(
        ShrinkError, match=r"run \d+ of a random exploration\) passes .*: there is no failure"
    ):
        simdist.shrink(fns.any_source_order, CPU3, json.dumps(data))


def test_a_token_of_another_program_is_refused(jittered: simdist.Exploration) -> None:
    with pytest.raises(
        ShrinkError, match=r"records a run of explore_fns.any_source_order, not of .*arrival_order"
    ):
        simdist.shrink(fns.arrival_order, CPU3, jittered.failures[0])


def test_a_failure_whose_replay_fails_otherwise_is_refused(jittered: simdist.Exploration) -> None:
    other = dataclasses.replace(jittered.failures[0], kind="DeadlockError")
    with pytest.raises(
        ShrinkError, match="fails with 'RankError \\(AssertionError\\)', but the failure given is"
    ):
        simdist.shrink(fns.any_source_order, CPU3, other)
    with pytest.raises(ShrinkError, match="determinism self-check"):
        simdist.shrink(fns.any_source_order, CPU3, dataclasses.replace(other, kind=NONDETERMINISM))
    with pytest.raises(ShrinkError, match="max_runs must be an int >= 3"):
        simdist.shrink(fns.any_source_order, CPU3, jittered.failures[0], max_runs=2)
    with pytest.raises(ShrinkError, match="a failure .* or its replay token, got int"):
        simdist.shrink(fns.any_source_order, CPU3, 3)  # type: ignore[arg-type]
    with pytest.raises(simdist.ReplayTokenError):
        simdist.shrink(fns.any_source_order, CPU3, "{}")


def test_the_departure_names_rank_0s_receive_from_rank_2(jittered: simdist.Exploration) -> None:
    s = simdist.shrink(fns.any_source_order, CPU3, jittered.failures[0])
    dep = s.departure
    assert dep.decision == s.decisions[0]
    assert dep.event is not None and dep.expected is not None
    # the unperturbed run receives rank 1's value first; the failing run rank 2's, at the same time
    assert (dep.event.rank, dep.event.name, dep.event.detail) == (0, "nccl:recv", "src 2")
    assert (dep.expected.rank, dep.expected.name, dep.expected.detail) == (0, "nccl:recv", "src 1")
    assert dep.event.time == dep.expected.time == 0.0
    text = s.describe()
    assert "ranks 1, 2 tied; rank 2 went first instead of rank 1" in text
    assert "first differing trace event: rank 0 nccl:recv (src 2) on stream p2p at t=0 s" in text


def _trace(*spans: tuple[int, str, float]) -> Trace:
    tr = Trace()
    for rank, name, start in spans:
        tr.add(Span(rank, "compute", name, start, start + 1.0))
    return tr


def test_first_difference_of_two_rank_traces() -> None:
    """The earliest differing event over both ranks (time first, then rank), and a run that stopped early."""
    plain = _trace((0, "a", 0.0), (1, "b", 0.0), (0, "c", 1.0), (1, "d", 2.0))
    later = _trace((0, "a", 0.0), (1, "b", 0.0), (0, "c", 1.0), (1, "x", 2.0))
    earlier = _trace((0, "a", 0.0), (1, "b", 0.0), (0, "y", 1.5), (1, "x", 2.0))
    stopped = _trace((0, "a", 0.0), (1, "b", 0.0), (0, "c", 1.0))
    assert [str(e.name) if e else None for e in first_difference(later, plain)] == ["x", "d"]
    assert [e.name if e else None for e in first_difference(earlier, plain)] == ["y", "c"]
    assert [e.name if e else None for e in first_difference(stopped, plain)] == [None, "d"]
    assert first_difference(plain, plain) == (None, None)


def test_shrink_kinds_keeps_each_kinds_shrunk_case(jittered: simdist.Exploration) -> None:
    ex = dataclasses.replace(jittered, failures=[dataclasses.replace(f) for f in jittered.failures])
    found = shrink_kinds(ex, fns.any_source_order, CPU3)
    assert list(found) == [KIND]
    assert ex.failures[0].shrunk is found[KIND] and len(found[KIND].decisions) == 1
    assert all(f.shrunk is None for f in ex.failures[1:])


def test_a_depth_2_bug_keeps_exactly_its_two_reorderings() -> None:
    """On 4 ranks, a check that fails only when the values come as 2, 3, 1 needs two ordering constraints
    (2 before 1, 3 before 1): no single departure from rank order gives it, so the shrunk case keeps two."""
    cpu4 = simdist.Cluster.switch(4, device="cpu")

    def not_2_3_1(res: simdist.RunResult) -> bool:
        return res.returns[0] != [2, 3, 1]

    ex = simdist.explore(fns.arrival_order, cpu4, runs=40, strategy="pct", seed=11, check=not_2_3_1)
    assert ex.failures
    s = simdist.shrink(fns.arrival_order, cpu4, ex.failures[0], check=not_2_3_1)
    assert s.kind == "check failed" and len(s.decisions) == 2, s.describe()
    assert {d.went for d in s.decisions} <= {2, 3} and s.complete
    result = simdist.replay(fns.arrival_order, cpu4, s.replay)
    assert result.returns[0] == [2, 3, 1] and result.trace_hash == s.trace_hash


def test_max_runs_stops_shrinking_with_a_case_that_still_fails(jittered: simdist.Exploration) -> None:
    s = simdist.shrink(fns.any_source_order, CPU3, jittered.failures[0], max_runs=4)
    assert s.runs <= 4 and not s.complete and "may not be minimal" in s.describe()
    assert _replayed_hash(s.replay) == s.trace_hash and s.kind == KIND
