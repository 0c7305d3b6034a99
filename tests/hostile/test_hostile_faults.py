"""Hostile fault specs and programs under faults (``simdist.run(..., faults=[...])``): ranks, links and nodes the
cluster lacks, malformed records, crashes mid-collective and of every rank, a program that catches its own
crash, user-made fault classes, and faults that never fire."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from simdist.faults import Crash, Fault, FlappingLink, LinkDown, MessageDelay, NodeLoss, SlowLink, Straggler

RING4 = simdist.Cluster.ring(4, bandwidth="1GB/s", latency="1us", device="cpu")
NBYTES = 40_000_000


def _big() -> float:
    """One all-reduce of 10M float32 (60 ms on RING4): a crash can land in its middle."""
    t = torch.ones(NBYTES // 4)
    dist.all_reduce(t)
    return t[0].item()


def _steps() -> float:
    t = torch.ones(8)
    for _ in range(3):
        simdist.charge(1e-3)
        dist.all_reduce(t)
    return t[0].item()


def _catches_its_crash() -> str:
    """Rank code that catches everything, its own death included, and goes on communicating."""
    t = torch.ones(8)
    for _ in range(3):
        try:
            simdist.charge(1e-3)
            dist.all_reduce(t)
        except BaseException:  # noqa: BLE001, S110 - the hostile part
            pass
    return "survived"


def _run(fn, faults, cluster=RING4, **kw):
    return lambda: simdist.run(fn, cluster, compute=False, faults=faults, **kw)


class Meteor(Fault):
    """A fault class the simulator does not know."""


def _same_as_plain(res: simdist.RunResult) -> None:
    plain = simdist.run(_steps, RING4, compute=False)
    assert res.trace_hash == plain.trace_hash and res.returns == plain.returns


def _rerouted(res: simdist.RunResult) -> None:
    # ring(4) has a way round: 0 -> 3 -> 2 -> 1 instead of 0 -> 1; the all-reduce's sums stay exact
    assert res.returns == [4.0] * 4


CASES = [
    Case(
        "crash-rank-out-of-range",
        "Crash(rank=4) on 4 ranks",
        _run(_steps, [Crash(rank=4, at=0.0)]),
        error=simdist.FaultSpecError,
        match=r"Crash: rank 4 is not a rank of cluster 'ring-4', whose ranks are 0..3",
    ),
    Case(
        "straggler-rank-out-of-range",
        "Straggler(rank=[0, 9])",
        _run(_steps, [Straggler(rank=[0, 9], slowdown=2)]),
        error=simdist.FaultSpecError,
        match=r"Straggler: rank 9 is not a rank",
    ),
    Case(
        "delay-rank-out-of-range",
        "MessageDelay(src=5, dst=0)",
        _run(_steps, [MessageDelay(src=5, dst=0, delay=1e-3)]),
        error=simdist.FaultSpecError,
        match=r"MessageDelay: rank 5 is not a rank",
    ),
    Case(
        "link-id-out-of-range",
        "LinkDown(link=8) on a cluster of 8 links",
        _run(_steps, [LinkDown(link=8)]),
        error=simdist.FaultSpecError,
        match=r"LinkDown: link 8 is not a link of cluster 'ring-4', .* 0..7",
    ),
    Case(
        "cable-not-in-cluster",
        "SlowLink(link=[0, 'ib']) on a ring",
        _run(_steps, [SlowLink(link=[0, "ib"])]),
        error=simdist.FaultSpecError,
        match=r"SlowLink: no link joins 0 and 'ib' in cluster 'ring-4'.* e\.g\. \[0, 1\]",
    ),
    Case(
        "node-loss-without-nodes",
        "NodeLoss on a ring",
        _run(_steps, [NodeLoss(node=0)]),
        error=simdist.FaultSpecError,
        match=r"cluster 'ring-4' has no nodes .* Crash .* LinkDown",
    ),
    Case(
        "node-out-of-range",
        "NodeLoss(node=2) on two nodes",
        _run(_steps, [NodeLoss(node=2)], simdist.Cluster.two_level(2, 2, device="cpu")),
        error=simdist.FaultSpecError,
        match=r"NodeLoss: node 2 is not a node of cluster .* whose nodes are 0..1",
    ),
    Case(
        "negative-crash-time",
        "Crash(rank=0, at=-1)",
        lambda: Crash(rank=0, at=-1),
        error=simdist.FaultSpecError,
        match=r"at must be a non-negative finite number of simulated seconds, got -1",
    ),
    Case(
        "infinite-crash-time",
        "Crash(rank=0, at=inf)",
        lambda: Crash(rank=0, at=float("inf")),
        error=simdist.FaultSpecError,
        match=r"at must be a non-negative finite number",
    ),
    Case(
        "crash-both-when",
        "Crash(rank=0, at=1, collective=2)",
        lambda: Crash(rank=0, at=1.0, collective=2),
        error=simdist.FaultSpecError,
        match=r"give exactly one of at=",
    ),
    Case(
        "string-rank",
        "Crash(rank='1', at=0)",
        lambda: Crash(rank="1", at=0.0),
        error=simdist.FaultSpecError,
        match=r"rank must be a whole number, got str '1'",
    ),
    Case(
        "speed-up-straggler",
        "Straggler(slowdown=0.5)",
        lambda: Straggler(rank=0, slowdown=0.5),
        error=simdist.FaultSpecError,
        match=r"slowdown must be at least 1",
    ),
    Case(
        "nan-bandwidth-factor",
        "SlowLink(bandwidth_factor=nan)",
        lambda: SlowLink(link=0, bandwidth_factor=float("nan")),
        error=simdist.FaultSpecError,
        match=r"bandwidth_factor must be a positive finite number",
    ),
    Case(
        "window-backwards",
        "FlappingLink(window=(2, 1))",
        lambda: FlappingLink(link=0, period=1e-3, down=1e-4, window=(2.0, 1.0)),
        error=simdist.FaultSpecError,
        match=r"window \(2.0, 1.0\) ends before it starts",
    ),
    Case(
        "window-not-a-pair",
        "Straggler(window=5)",
        lambda: Straggler(rank=0, slowdown=2, window=5),
        error=simdist.FaultSpecError,
        match=r"window must be \(start, end\)",
    ),
    Case(
        "always-down-flapping",
        "FlappingLink(down=period)",
        lambda: FlappingLink(link=0, period=1.0, down=1.0),
        error=simdist.FaultSpecError,
        match=r"down 1.0 s must be shorter than period 1.0 s .* use LinkDown",
    ),
    Case(
        "one-fault-not-a-list",
        "faults=Crash(...)",
        lambda: simdist.run(_steps, RING4, faults=Crash(rank=0, at=0.0)),
        error=simdist.FaultSpecError,
        match=r"faults must be a list of faults, got one Crash",
    ),
    Case(
        "string-faults",
        "faults='Crash'",
        lambda: simdist.run(_steps, RING4, faults="Crash"),
        error=simdist.FaultSpecError,
        match=r"faults must be a list of simdist.faults records",
    ),
    Case(
        "user-made-fault-class",
        "faults=[Meteor()] (a Fault subclass of the user's)",
        _run(_steps, [Meteor()]),
        error=simdist.FaultSpecError,
        match=r"faults\[0\] must be a simdist.faults record .* got Meteor",
    ),
    Case(
        "json-unknown-type",
        "faults=[{'type': 'Meteor'}]",
        _run(_steps, [{"type": "Meteor"}]),
        error=simdist.FaultSpecError,
        match=r"unknown fault type 'Meteor'; the faults are Crash, FlappingLink",
    ),
    Case(
        "json-unknown-field",
        "faults=[{'type': 'Crash', 'rank': 0, 'when': 1}]",
        _run(_steps, [{"type": "Crash", "rank": 0, "when": 1.0}]),
        error=simdist.FaultSpecError,
        match=r"Crash: .*unexpected keyword argument 'when'; its fields are rank, at, collective",
    ),
    Case(
        "crash-mid-collective",
        "Crash in the middle of a 60 ms all-reduce",
        _run(_big, [Crash(rank=1, at=0.03)]),
        error=simdist.RankCrashError,
        match=r"rank 1 crashed at simulated time 0.03 s .* while waiting in all_reduce #0",
    ),
    Case(
        "crash-at-collective-after-compute",
        "Crash(collective=2) of a rank that charges 1 ms before each all-reduce",
        _run(_steps, [Crash(rank=1, collective=2)]),
        error=simdist.RankCrashError,
        # 2 ms of compute and one all-reduce of 32 bytes (6 ring steps of about 1 us) come before the 2nd issue
        match=r"rank 1 crashed at simulated time 0.00200\d+ s .* as it issued its 2nd collective",
    ),
    Case(
        "every-rank-crashes",
        "Crash of every rank at 0",
        _run(_steps, [Crash(rank=r, at=0.0) for r in range(4)]),
        error=simdist.RankCrashError,
        match=r"Every rank crashed",
    ),
    Case(
        "rank-catches-its-crash",
        "rank code catching BaseException around its collectives",
        _run(_catches_its_crash, [Crash(rank=2, at=1.5e-3)]),
        error=simdist.RankCrashError,
        match=r"rank 2 crashed at simulated time 0.0015 s",
    ),
    Case(
        "crash-after-finish",
        "Crash(at=1 s) of a program done at 3 ms",
        _run(_steps, [Crash(rank=0, at=1.0)]),
        check=_same_as_plain,
    ),
    Case(
        "collective-never-reached",
        "Crash(collective=99) of a rank that issues 3",
        _run(_steps, [Crash(rank=0, collective=99)]),
        check=_same_as_plain,
    ),
    Case(
        "link-down-with-detour",
        "LinkDown of a ring link mid-collective",
        _run(_big, [LinkDown(link=0, at=0.03)]),
        check=_rerouted,
    ),
    Case(
        "link-down-without-detour",
        "LinkDown of the only link between two ranks",
        _run(_steps, [LinkDown(link=[0, 1], at=0.0)], simdist.Cluster.ring(2, device="cpu")),
        error=simdist.LinkFailureError,
        match=r"all_reduce on global ranks 0-1 cannot send .* no route from rank 0 to rank 1 .* LinkDown at 0 s",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
