"""Perturbed runs and the exploration strategies: identity without perturbation, determinism, the exhaustive
search's count and its reduction's soundness, PCT's bound, failures, checks and the determinism self-check."""

from __future__ import annotations

import math

import explore_fns as fns
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist import Perturbation

#: a CPU cluster on one switch: zero-cost compute, alpha-beta links
CPU3 = simdist.Cluster.switch(3, device="cpu")
CPU4 = simdist.Cluster.switch(4, device="cpu")


@pytest.mark.parametrize("progress", ["nccl", "gloo"])
@pytest.mark.parametrize("cluster", ["switch", "cpu", "dgx-h100"])
def test_a_fifo_perturbation_is_the_unperturbed_run(progress: str, cluster: str) -> None:
    # dgx-h100 times collectives with NCCL's model, whose paced messages may arrive out of their sending order
    c = {"switch": simdist.Cluster.preset("switch", world_size=3), "cpu": CPU3}.get(
        cluster
    ) or simdist.Cluster.preset(cluster, world_size=8)
    plain = simdist.run(fns.mixed, c, progress=progress)
    fifo = simdist.run(
        fns.mixed, c, progress=progress, perturbation=Perturbation(ties="fifo", callbacks=False)
    )
    assert fifo.trace_hash == plain.trace_hash
    assert fifo.returns == plain.returns


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    ties=st.sampled_from(["random", "pct"]),
    latency=st.floats(0, 1),
    compute=st.floats(0, 1),
)
def test_a_perturbed_run_is_a_pure_function_of_its_perturbation(
    seed: int, ties: str, latency: float, compute: float
) -> None:
    p = Perturbation(seed=seed, ties=ties, steps=4, latency=latency, compute=compute)
    c = simdist.Cluster.preset("switch", world_size=3)
    first = simdist.run(fns.mixed, c, perturbation=p)
    again = simdist.run(fns.mixed, c, perturbation=Perturbation.from_json(p.to_json()))
    assert again.trace_hash == first.trace_hash
    # the collectives' data never depends on the order: the oracle is the unperturbed run's values
    assert first.returns == simdist.run(fns.mixed, c).returns


def test_jitter_only_stretches_and_keeps_a_pairs_messages_in_order() -> None:
    plain = simdist.run(fns.mixed, CPU4)
    for seed in range(4):
        res = simdist.run(fns.mixed, CPU4, perturbation=Perturbation(seed=seed, ties="fifo", latency=0.5))
        assert res.sim_time >= plain.sim_time
        arrivals: dict[tuple[int, int], float] = {}
        for m in res.trace.messages:  # recorded as they arrive
            key = (m.src, m.dst)
            assert m.end >= arrivals.get(key, 0.0)
            arrivals[key] = m.end


def test_callbacks_due_together_run_in_a_drawn_order_only_when_asked() -> None:
    c = simdist.Cluster.switch(2, device="cpu")
    plain = simdist.run(fns.callback_order, c, progress="gloo").returns
    orders = set()
    for seed in range(8):
        kept = Perturbation(seed=seed, ties="fifo", callbacks=False)
        assert simdist.run(fns.callback_order, c, progress="gloo", perturbation=kept).returns == plain
        drawn = Perturbation(seed=seed, ties="fifo")
        orders.update(
            tuple(r) for r in simdist.run(fns.callback_order, c, progress="gloo", perturbation=drawn).returns
        )
    assert plain == [["a", "b"]] * 2
    assert orders == {("a", "b"), ("b", "a")}


def test_compute_jitter_stretches_each_op_within_its_bound() -> None:
    # every rank computes 2 x 1 ms and waits for it: jitter 0.5 makes each op 1 to 1.5 ms long
    c = simdist.Cluster.switch(2, device="cpu")
    times = set()
    for seed in range(4):
        res = simdist.run(fns.two_sleeps, c, perturbation=Perturbation(seed=seed, ties="fifo", compute=0.5))
        for rank, finish in enumerate(res.finish_times):
            spans = [s for s in res.trace.spans if s.rank == rank and s.stream == "compute"]
            assert len(spans) == 2 and all(1e-3 <= s.end - s.start <= 1.5e-3 for s in spans)
            assert finish == pytest.approx(sum(s.end - s.start for s in spans))
        times.add(res.sim_time)
    assert len(times) == 4 and simdist.run(fns.two_sleeps, c).sim_time == pytest.approx(2e-3)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(-(2**63), 2**64),
    ties=st.sampled_from(["fifo", "random", "pct", "choices"]),
    choices=st.lists(st.integers(0, 7), max_size=6),
    depth=st.integers(1, 5),
    steps=st.integers(1, 100),
    latency=st.floats(0, 10),
    callbacks=st.booleans(),
)
def test_perturbations_round_trip_through_json(seed, ties, choices, depth, steps, latency, callbacks) -> None:
    import json

    p = Perturbation(
        seed=seed,
        ties=ties,
        choices=tuple(choices),
        depth=depth,
        steps=steps,
        latency=latency,
        callbacks=callbacks,
    )
    assert Perturbation.from_json(json.loads(json.dumps(p.to_json()))) == p


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"ties": "lifo"}, "ties must be one of"),
        ({"choices": (-1,)}, "choices must be"),
        ({"depth": 0}, "depth must be an int >= 1"),
        ({"latency": -0.1}, "latency jitter must be a finite number >= 0"),
        ({"compute": float("nan")}, "compute jitter"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_a_bad_perturbation_is_refused_naming_the_field(fields: dict, match: str) -> None:
    with pytest.raises(simdist.RunArgumentError, match=match):
        Perturbation(**fields)


def test_run_refuses_a_perturbation_that_is_not_one() -> None:
    with pytest.raises(simdist.RunArgumentError, match="perturbation must be a simdist.Perturbation"):
        simdist.run(fns.returns_rank, CPU3, perturbation={"seed": 1})


# ---------------------------------------------------------------------- exhaustive
@pytest.mark.parametrize(("world", "steps"), [(2, 0), (2, 1), (2, 2), (2, 3), (3, 1)])
def test_exhaustive_enumerates_every_order_of_ranks_waking_together(world: int, steps: int) -> None:
    # Every rank wakes at the same instants (the start, then after each step): each instant's wake-ups, all of
    # which run rank code and so conflict, can come in world! orders, independently.
    c = simdist.Cluster.switch(world, device="cpu")
    ex = simdist.explore(_sleeps(steps), c, runs=1000, strategy="exhaustive")
    assert ex.runs == math.factorial(world) ** (steps + 1)
    assert ex.pruned == 0
    assert len({tuple(o.decisions) for o in ex.outcomes}) == ex.runs


def _sleeps(steps: int):
    def fn() -> None:
        fns.sleeps(steps)

    return fn


def test_exhaustive_refuses_a_space_over_its_bound_naming_it() -> None:
    with pytest.raises(simdist.SearchSpaceError, match=r"more than runs=5 runs") as info:
        simdist.explore(fns.two_sleeps, CPU3, runs=5, strategy="exhaustive")
    assert info.value.exploration.runs == 5


# ---------------------------------------------------------------------- strategies find the bug
@pytest.mark.parametrize("strategy", ["random", "pct", "exhaustive"])
def test_every_strategy_finds_the_any_source_order_bug_and_replay_reproduces_it(strategy: str) -> None:
    plain = simdist.run(fns.arrival_order, CPU4)
    assert plain.returns[0] == [1, 2, 3]  # the default run passes
    # the exhaustive search needs all 4! = 24 orders of the ranks' starts
    ex = simdist.explore(
        fns.any_source_order, CPU4, runs=24 if strategy == "exhaustive" else 12, strategy=strategy, seed=3
    )
    assert ex.outcomes[0].kind is None
    assert ex.failures, ex.summary()
    f = ex.failures[0]
    assert f.kind == "RankError (AssertionError)"
    assert "arrival order" in str(f.error)
    with pytest.raises(simdist.RankError, match="arrival order") as info:
        simdist.replay(fns.any_source_order, CPU4, f.replay)
    assert info.value.trace_hash == f.trace_hash
    assert f"{len(ex.failures)} failures" in ex.summary()


def test_the_same_exploration_gives_the_same_findings() -> None:
    a = simdist.explore(
        fns.any_source_order, CPU4, runs=12, strategy="pct", jitter={"latency": 0.2, "compute": 0.1}
    )
    b = simdist.explore(
        fns.any_source_order, CPU4, runs=12, strategy="pct", jitter={"latency": 0.2, "compute": 0.1}
    )
    assert [o.key() for o in a.outcomes] == [o.key() for o in b.outcomes]


def test_pct_hits_a_depth_two_bug_at_least_as_often_as_its_bound() -> None:
    # Rank 0 takes values from ranks 1, 2, 3 in the order they were sent; the bug needs 2 before 3 and 3 before 1:
    # two ordering constraints, depth 2. PCT's bound: 1 / (n k^(d-1)) with n agents over k decisions.
    runs = 100
    seen: list[list[int]] = []
    ex = simdist.explore(
        fns.arrival_order,
        CPU4,
        runs=runs,
        strategy="pct",
        depth=2,
        seed=11,
        check=lambda res: seen.append(res.returns[0]),
    )
    k = len(ex.outcomes[0].decisions)
    n = ex.outcomes[0].agents
    hits = sum(order == [2, 3, 1] for order in seen[1:])
    bound = 1 / (n * k ** (2 - 1))
    assert (k, n) == (3, 4)
    assert hits / (runs - 1) >= bound, (hits, bound)


def test_pct_finds_a_rank_slowest_in_every_round_at_a_rate_the_number_of_ties_does_not_lower() -> None:
    # rank 1 last in each of 4 rounds: random choice must pick it last at every tie, (1/3)^4 = 1.2% of runs; PCT's
    # fixed priorities put it last in every round whenever it draws the lowest priority of the three senders
    runs = 40
    found = {}
    for strategy in ("pct", "random"):
        seen: list[list[int]] = []
        ex = simdist.explore(
            fns.four_rounds, CPU4, runs=runs, strategy=strategy, depth=1, seed=0,
            check=lambda res, seen=seen: seen.append(res.returns[0]),
        )  # fmt: skip
        assert len(ex.outcomes[0].decisions) == 11  # ties over the four rounds
        found[strategy] = sum(all(o[3 * r + 2] == 1 for r in range(4)) for o in seen[1:])
    assert found["pct"] / (runs - 1) >= 1 / 4, found  # PCT's bound for depth 1: 1/n, n = 4 agents
    assert found["random"] < found["pct"], found


# ---------------------------------------------------------------------- failures
def test_a_check_returning_false_or_raising_is_a_failure() -> None:
    ex = simdist.explore(fns.arrival_order, CPU4, runs=20, check=fns.order_is_sorted)
    assert ex.failures and all(f.kind == "check failed" for f in ex.failures)
    assert isinstance(ex.failures[0].error, simdist.CheckFailed)

    def raising(res: simdist.RunResult) -> None:
        raise ValueError("no")

    ex = simdist.explore(fns.returns_rank, CPU3, runs=2, check=raising)
    assert [f.kind for f in ex.failures] == ["check raised ValueError"] * 2


def test_a_run_that_replays_differently_is_reported_as_a_simdist_bug_with_every_hash() -> None:
    ex = simdist.explore(fns.keeps_state, CPU3, runs=2)
    assert [f.kind for f in ex.failures] == ["nondeterminism (simdist bug)"] * 2
    err = ex.failures[0].error
    assert isinstance(err, simdist.NondeterminismError)
    assert len(err.hashes) == 3 and len(set(err.hashes)) == 2
    assert err.hashes[0][:16] in str(err)


def test_on_run_sees_every_run_as_it_ends() -> None:
    seen: list[int] = []
    ex = simdist.explore(fns.any_source_order, CPU4, runs=6, on_run=lambda o: seen.append(o.index))
    assert seen == [o.index for o in ex.outcomes] == list(range(6))


def test_ctrl_c_keeps_what_was_found() -> None:
    calls = []

    def interrupt(res: simdist.RunResult) -> bool:
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return res.returns[0] == sorted(res.returns[0])

    ex = simdist.explore(fns.arrival_order, CPU4, runs=50, check=interrupt, seed=1)
    assert ex.interrupted
    assert 1 <= ex.runs < 50
    assert "interrupted" in ex.summary()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "dfs"}, "strategy must be one of"),
        ({"runs": 0}, "runs must be an int >= 1"),
        ({"workers": 0}, "workers must be an int >= 1"),
        ({"jitter": {"bandwidth": 0.1}}, "unknown keys"),
        ({"jitter": {"latency": -1}}, "finite number >= 0"),
        ({"strategy": "exhaustive", "jitter": {"latency": 0.1}}, "exhaustive search enumerates tie orders"),
        ({"compute": simdist.Profile.__new__(simdist.Profile)}, "compute=simdist.profile"),
        ({"check": 3}, "check must be a function"),
        ({"jitter": 0}, "jitter must map"),
        ({"on_run": "print"}, "on_run must be a function"),
    ],
)
def test_explore_refuses_bad_arguments_naming_them(kwargs: dict, match: str) -> None:
    with pytest.raises(simdist.ExplorationError, match=match):
        simdist.explore(fns.returns_rank, CPU3, **kwargs)
