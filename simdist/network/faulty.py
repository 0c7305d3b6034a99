"""Link faults in a run: slow, flapping and failed links, delayed messages, and ranks whose messages stop.

:class:`LinkFaults` answers, for one transfer, the route it takes at the time it is sent (around the links that
are down by then, over the cluster's remaining links), when it may start (a flapping link that is down makes it
wait), the bandwidth factor and added latency of each link at that start, and the extra delay of its message.
A transfer reads the links' state once, when it starts, and keeps it until it arrives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from simdist.errors import FaultSpecError, LinkFailureError
from simdist.faults.specs import FlappingLink, LinkDown, LinkRef, MessageDelay, NodeLoss, SlowLink, in_window
from simdist.network.routing import Router

if TYPE_CHECKING:  # annotations only: a cluster is passed in
    from simdist.network.cluster import Cluster


def resolve_link(cluster: Cluster, ref: LinkRef, fault: str) -> tuple[int, ...]:
    """The directed link ids ``ref`` names on ``cluster``: one id, or both directions of a cable."""
    if isinstance(ref, int):
        if not 0 <= ref < len(cluster.links):
            raise FaultSpecError(
                f"{fault}: link {ref} is not a link of cluster {cluster.name!r}, whose links are numbered "
                f"0..{len(cluster.links) - 1} (Cluster.links)"
            )
        return (ref,)
    a, b = ref
    ids = tuple(l.id for l in cluster.links if (l.src, l.dst) in ((a, b), (b, a)))
    if not ids:
        raise FaultSpecError(
            f"{fault}: no link joins {a!r} and {b!r} in cluster {cluster.name!r}; name a cable by its two ends as "
            f"Cluster.links has them (ranks as ints, switches by name, e.g. {_example(cluster)}) or a link by its id"
        )
    return ids


def _example(cluster: Cluster) -> str:
    first = cluster.links[0]
    return f"[{first.src!r}, {first.dst!r}]"


def node_links(cluster: Cluster, node: int) -> tuple[int, ...]:
    """The ids of every link to or from node ``node``: its ranks' and its switches' (named ``node{k}.*``)."""
    per_node = cluster.ranks_per_node
    assert per_node is not None
    ranks = range(node * per_node, (node + 1) * per_node)
    prefix = f"node{node}."

    def on_node(v: int | str) -> bool:
        return v in ranks if isinstance(v, int) else v.startswith(prefix)

    return tuple(l.id for l in cluster.links if on_node(l.src) or on_node(l.dst))


class LinkFaults:
    """The state of the links of one run under its link faults, read by the network for each transfer."""

    def __init__(self, cluster: Cluster, faults: Sequence[object]) -> None:
        self.cluster = cluster
        #: link id -> [(window, bandwidth factor, latency added)]
        self.slow: dict[int, list[tuple[tuple[float, float] | None, float, float]]] = {}
        #: link id -> the flapping faults on it
        self.flapping: dict[int, list[FlappingLink]] = {}
        #: (time, link id, what took it down), in time order
        self.downs: list[tuple[float, int, str]] = []
        self.delays: list[MessageDelay] = []
        #: global ranks that have crashed: what they would send no longer leaves
        self.dead: set[int] = set()
        for f in faults:
            if isinstance(f, SlowLink):
                for i in resolve_link(cluster, f.link, "SlowLink"):
                    self.slow.setdefault(i, []).append((f.window, f.bandwidth_factor, f.latency))
            elif isinstance(f, FlappingLink):
                for i in resolve_link(cluster, f.link, "FlappingLink"):
                    self.flapping.setdefault(i, []).append(f)
            elif isinstance(f, LinkDown):
                self.downs += [
                    (f.at, i, f"LinkDown at {f.at:g} s") for i in resolve_link(cluster, f.link, "LinkDown")
                ]
            elif isinstance(f, NodeLoss):
                self.downs += [
                    (f.at, i, f"NodeLoss of node {f.node} at {f.at:g} s") for i in node_links(cluster, f.node)
                ]
            elif isinstance(f, MessageDelay):
                self.delays.append(f)
        self.downs.sort()
        # vertex indices as the cluster's router numbers them: ranks first, then switches
        index = {r: r for r in range(cluster.world_size)}
        index.update({s: cluster.world_size + j for j, s in enumerate(cluster.switches)})
        self._index = index
        self._edges = [(index[l.src], index[l.dst], l.latency) for l in cluster.links]
        self._routers: dict[frozenset[int], tuple[Router, dict[tuple[int, int], tuple[int, ...] | None]]] = {}

    def down_at(self, t: float) -> frozenset[int]:
        """The links down at simulated time ``t``."""
        return frozenset(i for at, i, _ in self.downs if at <= t)

    def route(self, src: int, dst: int, t: float) -> tuple[int, ...]:
        """The links a transfer from rank ``src`` to rank ``dst`` sent at ``t`` crosses: the cluster's route while
        none of the links is down, else the best route over the links still up. Raises
        :class:`LinkFailureError` when none is left."""
        down = self.down_at(t) if self.downs else frozenset()
        if not down:
            return self.cluster.route(src, dst)
        hit = self._routers.get(down)
        if hit is None:
            hit = self._routers[down] = (
                Router(len(self._index), self.cluster.world_size, self._edges, down),
                {},
            )
        router, routes = hit
        if (src, dst) not in routes:
            routes[(src, dst)] = router.route(src, dst) if router.reachable(src)[dst] else None
        route = routes[(src, dst)]
        if route is None:
            raise LinkFailureError(self._no_route(src, dst, t, down))
        return route

    def _no_route(self, src: int, dst: int, t: float, down: frozenset[int]) -> str:
        links = self.cluster.links
        usual = [i for i in self.cluster.route(src, dst) if i in down]
        named = usual or sorted(down)
        why = {i: what for _, i, what in self.downs}
        shown = "; ".join(f"link {i} ({links[i].src} -> {links[i].dst}, {why[i]})" for i in named[:4])
        more = f" and {len(named) - 4} more" if len(named) > 4 else ""
        return (
            f"no route from rank {src} to rank {dst} at simulated time {t:.9g} s: {shown}{more} failed and the "
            f"cluster has no other route between them"
        )

    def up_at(self, route: tuple[int, ...], t: float) -> float:
        """The first time at or after ``t`` at which every flapping link of ``route`` is up."""
        if not self.flapping:
            return t
        for _ in range(64):  # each pass moves to the end of one down phase; phases of few links soon agree
            later = t
            for i in route:
                for f in self.flapping.get(i, ()):
                    later = max(later, f.up_at(later))
            if later == t:
                return t
            t = later
        return t

    def slowdown(self, route: tuple[int, ...], t: float) -> tuple[list[float], float]:
        """Each link's bandwidth factor on ``route`` at ``t``, and the latency the slow links add (seconds)."""
        factors = [1.0] * len(route)
        added = 0.0
        if not self.slow:
            return factors, added
        for k, i in enumerate(route):
            for window, factor, latency in self.slow.get(i, ()):
                if in_window(window, t):
                    factors[k] *= factor
                    added += latency
        return factors, added

    def delay(self, src: int, dst: int, t: float) -> float:
        """The extra seconds a message from ``src`` to ``dst`` sent at ``t`` takes to arrive."""
        return math.fsum(
            d.delay
            for d in self.delays
            if src in d.src and dst in d.dst and in_window(d.window, t)  # type: ignore[operator]
        )
