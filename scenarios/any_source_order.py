"""A receive from any source that assumes arrival in rank order: passes every default run, fails under exploration.

Rank 0 of four collects one result from every other rank with ``dist.recv(buf)`` (no ``src``: from any source)
and appends them to a list it takes to be in rank order, as code written against a single test run often does.
Every default run passes, whatever its seed: the simulator, like a lightly loaded machine, lets ranks 1, 2, 3
send in rank order. ``simdist.explore`` perturbs the order of events due at the same simulated time (here, which
rank sends first) and finds the orders that break it; each failure's replay token reruns it with the same trace;
``simdist.shrink`` reduces a failure to the one reordering it needs, and hypothesis, searching perturbations
itself, shrinks to one as well; the exhaustive search counts every order and how many fail; the fix (receive
from each rank by name) passes them all.

Usage: python scenarios/any_source_order.py [--runs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import hypothesis
import torch
import torch.distributed as dist
from verdicts import Verdict, finish

import simdist
import simdist.report
from simdist.testing import perturbations

REPORTS = Path(__file__).resolve().parent.parent / "reports"
WORLD = 4
CLUSTER = simdist.Cluster.switch(WORLD, device="cpu")


def collect() -> list[int] | None:
    """Rank 0 collects each rank's result from any source and assumes they came in rank order."""
    rank = dist.get_rank()
    if rank != 0:
        dist.send(torch.tensor([float(rank * 10)]), 0)
        return None
    results = []
    for _ in range(dist.get_world_size() - 1):
        buf = torch.zeros(1)
        dist.recv(buf)  # from any source
        results.append(int(buf.item()))
    assert results == sorted(results), f"results arrived as {results}, not in rank order"
    return results


def collect_by_rank() -> list[int] | None:
    """The fix: receive from each rank by name."""
    rank = dist.get_rank()
    if rank != 0:
        dist.send(torch.tensor([float(rank * 10)]), 0)
        return None
    results = []
    for src in range(1, dist.get_world_size()):
        buf = torch.zeros(1)
        dist.recv(buf, src=src)
        results.append(int(buf.item()))
    return results


def shrink_section(page: simdist.report.ScenarioReport, failure: simdist.Failure) -> list[Verdict]:
    """simdist.shrink of PCT's first failure: one decision off the unperturbed order is all it needs."""
    shrunk = simdist.shrink(collect, CLUSTER, failure)
    print()
    print(f"simdist.shrink(collect, cluster, ex.failures[0]):\n{shrunk}")
    page.text("The first failure shrunk", shrunk.describe())
    try:
        simdist.replay(collect, CLUSTER, shrunk.replay)
        replayed = ""
    except simdist.RankError as e:
        replayed = e.trace_hash
    return [
        (
            "shrink keeps one reordering",
            len(shrunk.decisions) == 1,
            f"{len(shrunk.decisions)} decision off the unperturbed order (from {shrunk.before})",
        ),
        ("the shrunk token replays the failure", replayed == shrunk.trace_hash, replayed[:16]),
    ]


def hypothesis_section(page: simdist.report.ScenarioReport, token: str | None) -> list[Verdict]:
    """hypothesis searches perturbations for a failing one and shrinks it to the minimal reordering."""

    def fails(p: simdist.Perturbation) -> bool:
        try:
            simdist.run(collect, CLUSTER, perturbation=p)
        except simdist.RankError:
            return True
        return False

    found = hypothesis.find(
        perturbations(max_events=6, callbacks=False),
        fails,
        settings=hypothesis.settings(
            database=None,
            derandomize=True,
            max_examples=200,
            deadline=None,
            suppress_health_check=[hypothesis.HealthCheck.too_slow],
        ),
    )
    print()
    print("hypothesis.find(simdist.testing.perturbations(max_events=6, callbacks=False), fails):")
    print(f"shrunk to choices={list(found.choices)} (wrap={found.wrap})")
    text = f"choices={list(found.choices)}"
    held = len([c for c in found.choices if c]) == 1
    if token is not None:  # what that one choice means, as simdist.shrink describes a token of it
        data = json.loads(token)
        data["perturbation"] = found.to_json()
        described = simdist.shrink(collect, CLUSTER, json.dumps(data))
        print("\n".join(str(d) for d in described.decisions))
        text += "\n" + "\n".join(str(d) for d in described.decisions)
        held = held and len(described.decisions) == 1
    page.text("hypothesis shrinks to the minimal reordering", text)
    return [("hypothesis shrinks to one reordering", held, f"choices={list(found.choices)}")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60, help="runs of the PCT exploration (default: %(default)s)")
    ap.add_argument(
        "--out",
        type=Path,
        default=REPORTS,
        metavar="DIR",
        help="where the HTML report is written (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    verdicts: list[Verdict] = []
    page = simdist.report.ScenarioReport(
        "A receive from any source",
        description=__doc__,
        command=f"python scenarios/any_source_order.py --runs {args.runs}",
    )

    seeds = range(5)
    plain = [simdist.run(collect, CLUSTER, seed=s) for s in seeds]
    print(
        f"default runs, seeds {seeds.start}..{seeds.stop - 1}: rank 0 got {plain[0].returns[0]} in every run"
    )
    verdicts.append(
        ("every default run passes", all(r.returns[0] == [10, 20, 30] for r in plain), f"{len(plain)} seeds")
    )

    ex = simdist.explore(collect, CLUSTER, runs=args.runs, strategy="pct", depth=2, seed=0)
    print()
    print(f"simdist.explore(collect, runs={args.runs}, strategy='pct', depth=2):")
    print(ex.summary())
    page.text("PCT exploration", ex.summary())
    first = ex.failures[0] if ex.failures else None
    verdicts.append(
        ("pct finds the failing order", first is not None, f"{len(ex.failures)} of {ex.runs} runs fail")
    )
    if first is not None:
        print(f"first failure: run {first.run}: {first.error.exc!s}; trace {first.trace_hash[:16]}")
        perturbation = json.loads(first.replay)["perturbation"]
        print(
            f"its perturbation: ties={perturbation['ties']} seed={perturbation['seed']} depth={perturbation['depth']} "
            f"steps={perturbation['steps']}"
        )
        try:
            simdist.replay(collect, CLUSTER, first.replay)
            replayed = ""
        except simdist.RankError as e:
            replayed = e.trace_hash
        print(f"simdist.replay(collect, cluster, token): the same failure, trace {replayed[:16]}")
        verdicts.append(
            ("replay reproduces it with the same trace", replayed == first.trace_hash, replayed[:16])
        )
        verdicts += shrink_section(page, first)
    verdicts += hypothesis_section(page, ex.failures[0].replay if ex.failures else None)

    full = simdist.explore(collect, CLUSTER, runs=200, strategy="exhaustive")
    orders = sorted({re.search(r"\[[^\]]*\]", str(f.error.exc)).group() for f in full.failures})
    print()
    print("simdist.explore(collect, strategy='exhaustive'):")
    print(full.summary())
    print(f"failing arrival orders: {', '.join(orders)}")
    page.text("Exhaustive search", full.summary() + "\nfailing arrival orders: " + ", ".join(orders))
    verdicts.append(
        (
            "exhaustive: every order but rank order fails",
            len(orders) == 5,
            f"{len(orders)} failing orders of 3! = 6",
        )
    )

    fixed = simdist.explore(collect_by_rank, CLUSTER, runs=200, strategy="exhaustive")
    print()
    print("the fix, recv(buf, src=r) for r = 1, 2, 3, searched exhaustively:")
    print(fixed.summary())
    verdicts.append(("the fix passes every order", not fixed.failures, f"{fixed.runs} runs"))
    print()
    return finish(page, verdicts, args.out, "any_source_order")


if __name__ == "__main__":
    sys.exit(main())
