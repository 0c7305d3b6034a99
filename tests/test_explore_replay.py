"""Replay tokens (JSON only, checked, warning on changes), faults in tokens, and the local process pool."""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import types
import warnings

import explore_fns as fns
import pytest

import simdist
from simdist.explore import token

CPU4 = simdist.Cluster.switch(4, device="cpu")


@pytest.fixture(scope="module")
def failure() -> simdist.Failure:
    ex = simdist.explore(fns.any_source_order, CPU4, runs=10, strategy="random", seed=3)
    assert ex.failures
    return ex.failures[0]


def test_a_token_is_json_holding_what_replays_the_run(failure: simdist.Failure) -> None:
    data = json.loads(failure.replay)
    assert data["kind"] == "simdist-replay"
    assert data["program"] == {"module": "explore_fns", "name": "any_source_order"}
    assert data["cluster"] == CPU4.to_config()
    assert data["perturbation"]["ties"] == "random"
    assert data["versions"]["torch"] and data["code"]
    assert data["options"]["seed"] == 0 and data["faults"] == []


def test_replaying_a_token_twice_gives_the_same_failure_and_trace(failure: simdist.Failure) -> None:
    hashes = []
    for given in (failure.replay, json.loads(failure.replay)):
        with pytest.raises(simdist.RankError, match="arrival order") as info:
            simdist.replay(fns.any_source_order, CPU4, given)
        hashes.append(info.value.trace_hash)
    assert hashes == [failure.trace_hash] * 2


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.encode(), "JSON text"),
        (lambda t: pickle.dumps(json.loads(t)), "never bytes or a pickle"),
        (lambda t: t[:-3], "is JSON text; this one is not"),
        (lambda t: json.dumps([1]), "not a simdist replay token"),
        (lambda t: json.dumps({**json.loads(t), "format": 99}), "format 99"),
        (
            lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "perturbation"}),
            "'perturbation' is missing",
        ),
        (lambda t: json.dumps({**json.loads(t), "seed": "x"}), "'seed' is missing or not"),
        (
            lambda t: json.dumps(
                {**json.loads(t), "perturbation": {**json.loads(t)["perturbation"], "ties": "lifo"}}
            ),
            "ties must be one of",
        ),
        (lambda t: json.dumps({**json.loads(t), "options": {"progress": "mpi"}}), "progress must be one of"),
    ],
)
def test_a_bad_token_is_refused_saying_why(failure: simdist.Failure, edit, match: str) -> None:
    with pytest.raises(simdist.ReplayTokenError, match=match):
        simdist.replay(fns.any_source_order, CPU4, edit(failure.replay))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("code", "0" * 64, "the program's code changed"),
        (
            "versions",
            {"simdist": "0.0.1", "torch": "1.0"},
            "simdist 0.0.1 when recorded.*torch 1.0 when recorded",
        ),
        (
            "cluster",
            simdist.Cluster.switch(4, device="cpu", latency="9us").to_config(),
            "the cluster differs",
        ),
    ],
)
def test_replaying_in_changed_conditions_warns_naming_the_change(
    failure: simdist.Failure, field: str, value, match: str
) -> None:
    edited = json.dumps({**json.loads(failure.replay), field: value})
    with pytest.warns(simdist.ReplayWarning, match=match) as caught, pytest.raises(simdist.RankError):
        simdist.replay(fns.any_source_order, CPU4, edited)
    assert caught[0].filename == __file__  # the warning points at the replay call


def test_replaying_unchanged_does_not_warn(failure: simdist.Failure) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", simdist.ReplayWarning)
        with pytest.raises(simdist.RankError):
            simdist.replay(fns.any_source_order, CPU4, failure.replay)


def test_a_replayed_schedule_the_run_cannot_follow_is_a_clear_error() -> None:
    ex = simdist.explore(fns.any_source_order, CPU4, runs=30, strategy="exhaustive")
    data = json.loads(ex.failures[0].replay)
    data["perturbation"]["choices"] = [0, 7]
    with pytest.raises(
        simdist.SimdistError, match="decision 1 of the replayed schedule takes option 7, but the run has 3"
    ):
        simdist.replay(fns.any_source_order, CPU4, json.dumps(data))


# ---------------------------------------------------------------------- faults in tokens
@dataclasses.dataclass(frozen=True)
class Straggler:
    """A stand-in for a fault of simdist.faults: a frozen dataclass of JSON fields."""

    rank: int
    slowdown: float
    window: tuple[float, float] = (0.0, 1.0)


def test_faults_go_into_a_token_as_json_and_come_back_equal() -> None:
    namespace = types.ModuleType("faults_stand_in")
    namespace.Straggler = Straggler
    fault = Straggler(rank=3, slowdown=2.0, window=(0.5, 2.0))
    data = json.loads(json.dumps(token.fault_json(fault)))
    assert data == {"type": "Straggler", "rank": 3, "slowdown": 2.0, "window": [0.5, 2.0]}
    assert token.fault_from_json(data, namespace) == fault
    with pytest.raises(simdist.ReplayTokenError, match="has no fault type 'Crash'"):
        token.fault_from_json({"type": "Crash", "rank": 1}, namespace)
    with pytest.raises(simdist.ReplayTokenError, match="cannot be rebuilt"):
        token.fault_from_json({"type": "Straggler", "rank": 1}, namespace)
    with pytest.raises(simdist.ExplorationError, match="faults must be simdist.faults objects"):
        token.fault_json({"rank": 1})


def test_explore_runs_under_faults_and_its_tokens_replay_them() -> None:
    # rank 2 dies at its first collective: every run fails, each token holds the crash, and replaying a token
    # meets the same crash with the same trace
    crash = simdist.faults.Crash(rank=2, collective=1)
    ex = simdist.explore(fns.mixed, CPU4, runs=3, strategy="random", seed=1, faults=[crash])
    assert ex.runs == 3 and len(ex.failures) == 3
    failure = ex.failures[1]
    assert isinstance(failure.error, simdist.RankCrashError), failure.error
    data = json.loads(failure.replay)
    assert data["faults"] == [{"type": "Crash", **{k: v for k, v in crash.to_json().items() if k != "type"}}]
    assert data["options"]["faults"] == []
    with pytest.raises(simdist.RankCrashError) as caught:
        simdist.replay(fns.mixed, CPU4, failure.replay)
    assert caught.value.trace_hash == failure.trace_hash
    # without the fault the same runs pass: the crash came from the faults, and replay took it from the token
    assert not simdist.explore(fns.mixed, CPU4, runs=3, strategy="random", seed=1).failures



# ---------------------------------------------------------------------- the process pool
@pytest.mark.slow
def test_two_workers_find_exactly_what_one_finds() -> None:
    kwargs = {
        "runs": 6,
        "strategy": "pct",
        "seed": 5,
        "jitter": {"latency": 0.2},
        "check": fns.order_is_sorted,
    }
    one = simdist.explore(fns.arrival_order, CPU4, workers=1, **kwargs)
    two = simdist.explore(fns.arrival_order, CPU4, workers=2, **kwargs)
    assert [o.key() for o in two.outcomes] == [o.key() for o in one.outcomes]
    assert [(f.run, f.kind, f.replay, f.trace_hash) for f in two.failures] == [
        (f.run, f.kind, f.replay, f.trace_hash) for f in one.failures
    ]
    assert one.failures and isinstance(two.failures[0].error, simdist.CheckFailed)


def test_workers_need_a_program_they_can_load_by_name() -> None:
    def local() -> None:
        pass

    for fn, what in ((lambda: None, "<lambda>"), (local, "local")):
        with pytest.raises(
            simdist.ExplorationError, match=f"{what}.*cannot be loaded by name in a worker process"
        ):
            simdist.explore(fn, CPU4, runs=2, workers=2)
    with pytest.raises(simdist.ExplorationError, match="cannot be loaded by name"):
        simdist.explore(fns.returns_rank, CPU4, runs=2, workers=2, check=lambda res: True)


def test_a_program_read_from_standard_input_is_refused_workers_before_any_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # multiprocessing starts each worker by running __main__'s file again; python - < prog.py has none
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "<stdin>", raising=False)  # none under xdist
    with pytest.raises(simdist.ExplorationError, match=r"__main__ is '<stdin>', not a file.*workers=1"):
        simdist.explore(fns.arrival_order, CPU4, runs=2, workers=2)

    def step() -> None:
        pass

    step.__module__, step.__qualname__ = "__main__", "step"
    with pytest.raises(simdist.ExplorationError, match="read from standard input"):
        simdist.explore(step, CPU4, runs=2, workers=2)
