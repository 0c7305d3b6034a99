"""A shared medium: the cluster of processes on one host, where every transfer, either way, takes the same CPUs.

On localhost a message is copied by the host's cores (into the kernel and out again), so two ranks sending to
each other at once take twice as long as one, where a switch of duplex links lets them overlap. Such a medium
needs no link kind of its own: every route crosses one directed link, ``bus.in -> bus.out``, which serialises
all transfers. Each rank has a link up to ``bus.in`` and one down from ``bus.out``, each of half the route's
latency and of the medium's bandwidth (a rank's own transfers wait for each other anyway).

The fit needs each collective's uncontended time on it in closed form. On two ranks, under the gloo model (its
algorithms; each rank working through its own memory at ``γ`` seconds per byte: adding a reduce message in
before it goes on, and the copies ProcessGroupGloo makes, :data:`simdist.comm.selection.GLOO_COPIES`), with
``α`` the route's latency, ``β`` seconds per byte of the medium and ``m`` the buffer's bytes (chunks
``c = m / 2``):

- broadcast (one message): ``α + mβ``;
- all-gather (both chunks at once, one after the other on the medium; a rank's chunk copied into the output
  before, the whole output copied out after): ``α + mβ + 1.5mγ``;
- send/recv (both ranks send ``m``): ``α + 2mβ``;
- all-reduce (the ring: a reduce step, then a copy step): the first chunk leaves at ``cβ``, the second at
  ``2cβ``; each rank adds its chunk in and sends the sum, which waits for the medium: rank 0's sum leaves at
  ``max(2cβ + α + cγ, 3cβ) + cβ``, so ``max(2α + 1.5mβ + 0.5mγ, α + 2mβ)``;
- reduce-scatter (gloo's all-reduce of a clone of the whole input, its messages paced to the ring all-reduce's
  closed form, ``2α + mβ`` for one step of ``c`` bytes each, as :mod:`simdist.comm.selection` paces them; the
  rank's chunk copied out after): the clone, both chunks at ``2β`` per byte on the medium, the add, the copy:
  ``2α + 2mβ + 2mγ``.
"""

from __future__ import annotations

import networkx as nx

from simdist.calibrate.samples import CalibrationError, Sample
from simdist.network import Cluster

#: the fitted cluster's medium: ``switch`` (duplex links through a switch) or ``shared`` (one medium for all)
MEDIA = ("switch", "shared")
#: what the shared medium's closed forms time (on two ranks)
SHARED_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "sendrecv")


def shared_cluster(n: int, bandwidth: float, latency: float, device: str, name: str) -> Cluster:
    """``n`` ranks whose every transfer crosses the one link ``bus.in -> bus.out`` (bytes/s ``bandwidth``; a route
    of ``latency`` seconds, half on each rank's link)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    graph.add_nodes_from(["bus.in", "bus.out"])
    for r in range(n):
        graph.add_edge(r, "bus.in", bandwidth=bandwidth, latency=latency / 2)
    graph.add_edge("bus.in", "bus.out", bandwidth=bandwidth, latency=0.0)
    for r in range(n):
        graph.add_edge("bus.out", r, bandwidth=bandwidth, latency=latency / 2)
    return Cluster(graph, device=device, name=name)


def check_shared(rows: list[Sample], what: str) -> None:
    """Refuse samples the shared medium's closed forms do not time: more than two ranks, other collectives."""
    ranks = rows[0].ranks
    if ranks != 2:
        raise CalibrationError(
            f"{what}: a shared medium is fitted on 2 ranks (its closed forms are those of two processes); these "
            f"are of {ranks}: fit them with medium='switch'"
        )
    other = sorted({s.collective for s in rows} - set(SHARED_COLLECTIVES))
    if other:
        raise CalibrationError(
            f"{what}: a shared medium times {', '.join(SHARED_COLLECTIVES)}; found {', '.join(other)}: leave "
            f"them out or fit with medium='switch'"
        )


def shared_terms(s: Sample, alpha: float, beta: float, gamma: float) -> tuple[str, float, float, float]:
    """(algorithm, a, b, c): the sample's time ``a·α + b·β + c·γ`` on a shared medium of two ranks under the gloo
    model, the branch of a ``max`` that holds at ``(alpha, beta, gamma)``."""
    m = float(s.nbytes)
    if s.collective in ("broadcast", "all_gather"):
        return ("tree", 1.0, m, 0.0) if s.collective == "broadcast" else ("ring", 1.0, m, 1.5 * m)
    if s.collective == "sendrecv":
        return "sendrecv", 1.0, 2 * m, 0.0
    if s.collective == "reduce_scatter":
        return "ring", 2.0, 2 * m, 2 * m
    reducing = (2.0, 1.5 * m, 0.5 * m)
    moving = (1.0, 2 * m, 0.0)
    value = [x[0] * alpha + x[1] * beta + x[2] * gamma for x in (reducing, moving)]
    a, b, c = reducing if value[0] >= value[1] else moving
    return "ring", a, b, c
