"""Minimum-latency routes between ranks, memoised: one single-source search per source, at most, each stopped
once it has reached the destinations asked for so far.

Vertices are indices (ranks 0..world_size-1 first, then switches); links are ids. A route minimises the
summed latency, then the hop count, then the id of its last link, so ties depend only on link numbering,
never on hashing. Latencies are summed as whole picoseconds: integer sums are exact, so two paths of equal
latency tie exactly whatever order their links are added in, and the hop-count tie-break applies.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

#: latencies are compared as integers in this unit (picoseconds per second)
PS_PER_S = 1e12


class Router:
    """Routes over directed links ``(src index, dst index, latency seconds)``, numbered by position; the links
    in ``down`` keep their numbers but carry nothing (a failed link)."""

    def __init__(
        self,
        vertices: int,
        world_size: int,
        links: Sequence[tuple[int, int, float]],
        down: frozenset[int] = frozenset(),
    ) -> None:
        self.world_size = world_size
        #: per vertex: (neighbour index, link id, latency in ps)
        self._out: list[list[tuple[int, int, int]]] = [[] for _ in range(vertices)]
        self._link_src: list[int] = []
        for link_id, (src, dst, latency) in enumerate(links):
            if link_id not in down:
                self._out[src].append((dst, link_id, round(latency * PS_PER_S)))
            self._link_src.append(src)
        #: per source vertex: its search so far (best keys, which are final, the heap)
        self._searches: dict[int, tuple[list[tuple[int, int, int] | None], list[bool], list]] = {}

    def reachable(self, start: int, reverse: bool = False) -> list[bool]:
        """Which vertex indices ``start`` reaches (or, with ``reverse``, which reach ``start``)."""
        if reverse:
            adjacency: list[list[int]] = [[] for _ in self._out]
            for u, edges in enumerate(self._out):
                for v, _, _ in edges:
                    adjacency[v].append(u)
        else:
            adjacency = [[v for v, _, _ in edges] for edges in self._out]
        seen = [False] * len(adjacency)
        seen[start] = True
        stack = [start]
        while stack:
            for v in adjacency[stack.pop()]:
                if not seen[v]:
                    seen[v] = True
                    stack.append(v)
        return seen

    def route(self, s: int, d: int) -> tuple[int, ...]:
        """The link ids of the best route from vertex ``s`` to vertex ``d`` (``()`` if equal)."""
        if s != d and s not in self._searches and all(v >= self.world_size for v, _, _ in self._out[s]):
            return self._route_via_switches(s, d)
        return self._walk(self._settle(s, d), s, d)

    def _settle(self, src: int, target: int) -> list[tuple[int, int, int] | None]:
        """Search from ``src`` until ``target``'s best route is final: per vertex index, the key (latency, hops,
        last link) of the best route found so far (final for every vertex settled).

        The search stops there and resumes from where it stopped for a later target, so a route to a near
        vertex (a ring's neighbour) costs a few steps instead of a search of the whole graph. A vertex leaves
        the heap only after every vertex of a smaller (latency, hops) has, so its key, last link included, is
        final then: stopping early gives the routes a whole search gives.
        """
        search = self._searches.get(src)
        if search is None:
            best: list[tuple[int, int, int] | None] = [None] * len(self._out)
            best[src] = (0, 0, -1)
            search = self._searches[src] = (best, [False] * len(self._out), [(0, 0, src)])
        best, done, heap = search
        out = self._out
        while heap and not done[target]:
            dist, hops, u = heapq.heappop(heap)
            if done[u]:
                continue
            done[u] = True
            for v, link_id, latency in out[u]:
                if done[v]:
                    continue
                candidate = (dist + latency, hops + 1, link_id)
                current = best[v]
                if current is None or candidate < current:
                    best[v] = candidate
                    if current is None or candidate[:2] < current[:2]:
                        heapq.heappush(heap, (candidate[0], candidate[1], v))
        return best

    def _route_via_switches(self, s: int, d: int) -> tuple[int, ...]:
        """Best route from a rank whose links all lead to switches: first link + the switch's own best route.

        Switches are few, so this needs one search per switch instead of one per source rank (thousands of
        ranks behind one switch would otherwise cost a full search each).
        """
        best: tuple[int, int, int, int] | None = None
        for v, link_id, latency in self._out[s]:
            key = self._settle(v, d)[d]
            if key is None:
                continue
            candidate = (latency + key[0], 1 + key[1], link_id, v)
            if best is None or candidate < best:
                best = candidate
        assert best is not None, "clusters are checked to be connected"
        return (best[2],) + self._walk(self._searches[best[3]][0], best[3], d)

    def _walk(self, best: list[tuple[int, int, int] | None], s: int, d: int) -> tuple[int, ...]:
        """Links from vertex index ``s`` to ``d`` read back from the last links of ``s``'s search."""
        path: list[int] = []
        vertex = d
        while vertex != s:
            link_id = best[vertex][2]  # type: ignore[index]
            path.append(link_id)
            vertex = self._link_src[link_id]
        path.reverse()
        return tuple(path)

    @property
    def sources_searched(self) -> tuple[int, ...]:
        """The vertex indices a single-source search has run from so far."""
        return tuple(self._searches)
