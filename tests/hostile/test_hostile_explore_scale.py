"""Hostile uses of exploration at scale: engines that are not engines, a progress bar that is not a flag, closures
sent to a cluster, hypothesis strategies asked for what cannot exist, drawn schedules past the tied agents. Each
ends in a clear error or a correct run, never in a hang or a run that silently ignores what was asked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from simdist.testing import clusters, faults, perturbations

CPU3 = simdist.Cluster.switch(3, device="cpu")


def arrival_order() -> list[int] | None:
    """Rank 0 takes a value from each other rank, from any source, and returns the order they came in."""
    if dist.get_rank() != 0:
        dist.send(torch.tensor([float(dist.get_rank())]), 0)
        return None
    got = []
    for _ in range(dist.get_world_size() - 1):
        buf = torch.zeros(1)
        dist.recv(buf)
        got.append(int(buf.item()))
    return got


def _huge_choice() -> tuple[list[int], list[int]]:
    """A drawn schedule whose choice is far past the agents tied, and the schedule it counts round to."""
    huge = simdist.Perturbation(ties="choices", choices=(10**12,), wrap=True, callbacks=False)
    agents = 2  # ranks 1 and 2 send together: 10**12 % 2 == 0
    same = simdist.Perturbation(ties="choices", choices=(10**12 % agents,), callbacks=False)
    return (
        simdist.run(arrival_order, CPU3, perturbation=huge).returns[0],
        simdist.run(arrival_order, CPU3, perturbation=same).returns[0],
    )


def _same_order(orders: tuple[list[int], list[int]]) -> None:
    drawn, counted = orders
    assert sorted(drawn) == [1, 2] and drawn == counted


CASES: list[Case] = [
    Case(
        "explore-engine-port-number",
        "explore(engine=8786): a port where a Dask client or an address goes",
        lambda: simdist.explore(arrival_order, CPU3, runs=2, engine=8786),
        error=simdist.ExplorationError,
        match=r"engine must be a distributed.Client, a Dask scheduler address .* got int 8786",
    ),
    Case(
        "explore-engine-address-without-scheme",
        "explore(engine='localhost:8786'): a scheduler address without tcp://",
        lambda: simdist.explore(arrival_order, CPU3, runs=2, engine="localhost:8786"),
        error=simdist.ExplorationError,
        match=r"such as 'tcp://host:8786'.* got str 'localhost:8786'",
    ),
    Case(
        "explore-engine-lambda",
        "explore(lambda: ..., engine='tcp://...'): a closure cannot travel to a cluster by reference",
        lambda: simdist.explore(lambda: None, CPU3, runs=2, engine="tcp://127.0.0.1:1"),
        error=simdist.ExplorationError,
        match=r"<lambda>.* cannot be loaded by name in a worker process",
    ),
    Case(
        "explore-progress-bar-string",
        "explore(progress_bar='auto')",
        lambda: simdist.explore(arrival_order, CPU3, runs=2, progress_bar="auto"),
        error=simdist.ExplorationError,
        match=r"progress_bar must be True, False or None .* got 'auto'",
    ),
    Case(
        "perturbation-wrap-string",
        "Perturbation(wrap='yes')",
        lambda: simdist.Perturbation(ties="choices", wrap="yes"),
        error=simdist.RunArgumentError,
        match=r"perturbation wrap must be True or False, got 'yes'",
    ),
    Case(
        "perturbation-wrap-huge-choice",
        "a drawn schedule choosing agent 10**12 at a decision of two",
        _huge_choice,
        check=_same_order,
    ),
    Case(
        "testing-negative-max-events",
        "perturbations(max_events=-1)",
        lambda: perturbations(max_events=-1),
        error=simdist.RunArgumentError,
        match=r"max_events must be an int >= 0, got -1",
    ),
    Case(
        "testing-jitter-unknown-point",
        "perturbations(jitter={'bandwidth': 0.1})",
        lambda: perturbations(jitter={"bandwidth": 0.1}),
        error=simdist.RunArgumentError,
        match=r"jitter must map 'latency' and/or 'compute'",
    ),
    Case(
        "testing-clusters-empty-range",
        "clusters(max_ranks=2, min_ranks=4)",
        lambda: clusters(max_ranks=2, min_ranks=4),
        error=simdist.RunArgumentError,
        match=r"max_ranks 2 is below min_ranks 4",
    ),
    Case(
        "testing-link-faults-on-a-world-size",
        "faults(4, kinds=('LinkDown',)): link faults with no cluster to take links from",
        lambda: faults(4, kinds=("LinkDown",)),
        error=simdist.RunArgumentError,
        match=r"link faults need a simdist.Cluster",
    ),
    Case(
        "testing-node-loss-without-nodes",
        "faults(switch cluster, kinds=('NodeLoss',)): a cluster without nodes",
        lambda: faults(CPU3, kinds=("NodeLoss",)),
        error=simdist.RunArgumentError,
        match=r"NodeLoss needs a cluster of nodes",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile_explore_scale(case: Case) -> None:
    check(case)
