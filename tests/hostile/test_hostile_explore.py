"""Hostile uses of exploration: arguments explore cannot take, tokens that are not tokens or were edited, schedules
a run cannot follow, search spaces over their bound, programs that deadlock only in some orders or keep state
between runs. Each ends in a clear error or in the failure it should report, never in a hang."""

from __future__ import annotations

import json
import pickle
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist

CPU3 = simdist.Cluster.switch(3, device="cpu")


class fns:
    """The programs the cases explore."""

    @staticmethod
    def returns_rank() -> int:
        return dist.get_rank()

    @staticmethod
    def any_source_order() -> None:
        """Rank 0 receives from any source and assumes rank order."""
        if dist.get_rank() != 0:
            dist.send(torch.tensor([float(dist.get_rank())]), 0)
            return
        got = []
        for _ in range(dist.get_world_size() - 1):
            buf = torch.zeros(1)
            dist.recv(buf)
            got.append(int(buf.item()))
        assert got == sorted(got), f"arrival order {got}"

    @staticmethod
    def two_sleeps() -> None:
        """Every rank waits twice for 1 ms of compute: each wake-up ties with the others'."""
        for _ in range(2):
            simdist.charge(1e-3)
            simdist.synchronize()

    @staticmethod
    def any_then_named() -> None:
        """Rank 0 receives from any source, then from rank 2 by name: when rank 2's value came first, it waits
        forever."""
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1))
            dist.recv(torch.zeros(1), src=2)
        else:
            dist.send(torch.tensor([float(dist.get_rank())]), 0)

    calls: ClassVar[list[int]] = [0]

    @staticmethod
    def keeps_state() -> None:
        """Rank 0 makes one more all-reduce every other time the module runs it, and every run fails."""
        if dist.get_rank() == 0:
            fns.calls[0] += 1
        flag = torch.tensor([float(fns.calls[0] % 2)])
        dist.broadcast(flag, 0)
        for _ in range(int(flag.item()) + 1):
            dist.all_reduce(torch.ones(2))
        raise AssertionError("always fails, so that every run is replayed")


def _token() -> str:
    """A failing run's replay token."""
    return simdist.explore(fns.any_source_order, CPU3, runs=12, seed=1).failures[0].replay


def _edited(**fields: object) -> str:
    return json.dumps({**json.loads(_token()), **fields})


def _deadlocks_found(ex: simdist.Exploration) -> None:
    kinds = {f.kind for f in ex.failures}
    assert kinds == {"DeadlockError"}, ex.summary()
    assert ex.outcomes[0].kind is None  # the default order passes
    assert "never" in str(ex.failures[0].error) or "unmatched point-to-point" in str(ex.failures[0].error)


def _nondeterminism_found(ex: simdist.Exploration) -> None:
    assert {f.kind for f in ex.failures} == {"nondeterminism (simdist bug)"}


CASES: list[Case] = [
    Case(
        "explore-lambda-on-workers",
        "explore(lambda: ..., workers=2): a closure cannot be shipped by reference",
        lambda: simdist.explore(lambda: None, CPU3, runs=2, workers=2),
        error=simdist.ExplorationError,
        match=r"<lambda>.* cannot be loaded by name in a worker process .* or explore with workers=1",
    ),
    Case(
        "explore-not-a-function",
        "explore('train.py', ...): a path where the function goes",
        lambda: simdist.explore("train.py", CPU3),
        error=simdist.ExplorationError,
        match=r"explore needs a function every rank runs, got str 'train.py'",
    ),
    Case(
        "explore-strategy-case",
        "explore(strategy='PCT') (upper case)",
        lambda: simdist.explore(fns.returns_rank, CPU3, strategy="PCT"),
        error=simdist.ExplorationError,
        match=r"strategy must be one of \('random', 'pct', 'exhaustive'\), got 'PCT'",
    ),
    Case(
        "explore-runs-bool",
        "explore(runs=True)",
        lambda: simdist.explore(fns.returns_rank, CPU3, runs=True),
        error=simdist.ExplorationError,
        match=r"runs must be an int >= 1, got True",
    ),
    Case(
        "explore-infinite-jitter",
        "explore(jitter={'latency': inf})",
        lambda: simdist.explore(fns.returns_rank, CPU3, jitter={"latency": float("inf")}),
        error=simdist.ExplorationError,
        match=r"jitter\['latency'\] must be a finite number >= 0",
    ),
    Case(
        "explore-bad-run-option",
        "explore(progress='mpi'): a run option simdist.run refuses",
        lambda: simdist.explore(fns.returns_rank, CPU3, progress="mpi"),
        error=simdist.RunArgumentError,
        match=r"progress must be one of \('nccl', 'gloo'\), got 'mpi'",
    ),
    Case(
        "explore-exhaustive-too-large",
        "exhaustive search of a program with more orders than runs=",
        lambda: simdist.explore(fns.two_sleeps, CPU3, runs=20, strategy="exhaustive"),
        error=simdist.SearchSpaceError,
        match=r"need more than runs=20 runs .* use strategy='pct' or 'random'",
    ),
    Case(
        "explore-deadlock-in-some-orders",
        "a program that deadlocks only when rank 2's message comes first",
        lambda: simdist.explore(fns.any_then_named, CPU3, runs=12, seed=2),
        check=_deadlocks_found,
    ),
    Case(
        "explore-state-between-runs",
        "a program that keeps a counter between runs (not deterministic)",
        lambda: simdist.explore(fns.keeps_state, CPU3, runs=2),
        check=_nondeterminism_found,
    ),
    Case(
        "replay-pickle",
        "replay a pickled token",
        lambda: simdist.replay(fns.any_source_order, CPU3, pickle.dumps(json.loads(_token()))),
        error=simdist.ReplayTokenError,
        match=r"never bytes or a pickle",
    ),
    Case(
        "replay-run-result",
        "replay a RunResult instead of a token",
        lambda: simdist.replay(fns.any_source_order, CPU3, simdist.run(fns.returns_rank, CPU3)),
        error=simdist.ReplayTokenError,
        match=r"not a simdist replay token",
    ),
    Case(
        "replay-unknown-perturbation-field",
        "replay a token whose perturbation gained a field",
        lambda: simdist.replay(
            fns.any_source_order,
            CPU3,
            _edited(perturbation={**json.loads(_token())["perturbation"], "order": "lifo"}),
        ),
        error=simdist.ReplayTokenError,
        match=r"unknown fields \['order'\]",
    ),
    Case(
        "replay-out-of-range-choice",
        "run with explicit tie decisions the run does not have",
        lambda: simdist.run(
            fns.any_source_order, CPU3, perturbation=simdist.Perturbation(ties="choices", choices=(9,))
        ),
        error=simdist.SimdistError,
        match=r"decision 0 of the replayed schedule takes option 9, but the run has 3",
    ),
    Case(
        "shrink-passing-token",
        "shrink a token whose run passes (its perturbation edited to the unperturbed order)",
        lambda: simdist.shrink(
            fns.any_source_order,
            CPU3,
            _edited(perturbation=simdist.Perturbation(ties="fifo", callbacks=False).to_json()),
        ),
        error=simdist.ShrinkError,
        match=r"passes .*: there is no failure to shrink",
    ),
    Case(
        "shrink-token-of-another-program",
        "shrink a failing token with another program than the one it was recorded with",
        lambda: simdist.shrink(fns.returns_rank, CPU3, _token()),
        error=simdist.ShrinkError,
        match=r"records a run of .*any_source_order, not of .*returns_rank",
    ),
    Case(
        "shrink-out-of-range-choice",
        "shrink a token whose explicit decisions name options the run does not have",
        lambda: simdist.shrink(
            fns.any_source_order,
            CPU3,
            _edited(perturbation=simdist.Perturbation(ties="choices", choices=(9,)).to_json()),
        ),
        error=simdist.ShrinkError,
        match=r"do not fit this program's run: decision 0 .* takes option 9, but the run has 3",
    ),
    Case(
        "shrink-nondeterminism",
        "shrink the failure the determinism self-check reported for a program keeping state between runs",
        lambda: simdist.shrink(
            fns.keeps_state, CPU3, simdist.explore(fns.keeps_state, CPU3, runs=2).failures[0]
        ),
        error=simdist.ShrinkError,
        match=r"determinism self-check: its replays gave other traces",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile_explore(case: Case) -> None:
    check(case)
