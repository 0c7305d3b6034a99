"""Minimum-latency routes between ranks, memoised: one single-source search per source, at most.

Vertices are indices (ranks 0..world_size-1 first, then switches); links are ids. A route minimises the
summed latency, then the hop count, then the id of its last link, so ties depend only on link numbering,
never on hashing. Latencies are summed as whole picoseconds: integer sums are exact, so two paths of equal
latency tie exactly whatever order their links are added in, and the hop-count tie-break applies.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence

#: latencies are compared as integers in this unit (picoseconds per second)
PS_PER_S = 1e12


class Router:
    """Routes over directed links ``(src index, dst index, latency seconds)``, numbered by position; the links
    in ``down`` keep their numbers but carry nothing (a failed link)."""

    def __init__(
        self, vertices: int, world_size: int, links: Sequence[tuple[int, int, float]], down: frozenset[int] = frozenset()
    ) -> None:
        self.world_size = world_size
        #: per vertex: (neighbour index, link id, latency in ps)
        self._out: list[list[tuple[int, int, int]]] = [[] for _ in range(vertices)]
        self._link_src: list[int] = []
        for link_id, (src, dst, latency) in enumerate(links):
            if link_id not in down:
                self._out[src].append((dst, link_id, round(latency * PS_PER_S)))
            self._link_src.append(src)
        self._trees: dict[int, array] = {}
        self._keys: dict[int, list[tuple[int, int, int] | None]] = {}

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
        if s != d and s not in self._trees and all(v >= self.world_size for v, _, _ in self._out[s]):
            return self._route_via_switches(s, d)
        tree = self._trees.get(s)
        if tree is None:
            tree = self._tree(s)
        return self._walk(tree, s, d)

    def _tree(self, src: int) -> array:
        """For every vertex index, the last link of the best route from ``src`` (-1: none)."""
        best: list[tuple[int, int, int] | None] = [None] * len(self._out)
        best[src] = (0, 0, -1)
        done = [False] * len(self._out)
        heap = [(0, 0, src)]
        out = self._out
        while heap:
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
        tree = array("l", (-1 if key is None else key[2] for key in best))
        self._trees[src] = tree
        self._keys[src] = best
        return tree

    def _route_via_switches(self, s: int, d: int) -> tuple[int, ...]:
        """Best route from a rank whose links all lead to switches: first link + the switch's own best route.

        Switches are few, so this needs one search per switch instead of one per source rank (thousands of
        ranks behind one switch would otherwise cost a full search each).
        """
        best: tuple[int, int, int, int] | None = None
        for v, link_id, latency in self._out[s]:
            if v not in self._trees:
                self._tree(v)
            key = self._keys[v][d]
            if key is None:
                continue
            candidate = (latency + key[0], 1 + key[1], link_id, v)
            if best is None or candidate < best:
                best = candidate
        assert best is not None, "clusters are checked to be connected"
        return (best[2],) + self._walk(self._trees[best[3]], best[3], d)

    def _walk(self, tree: array, s: int, d: int) -> tuple[int, ...]:
        """Links from vertex index ``s`` to ``d`` read back from ``s``'s last-link tree."""
        path: list[int] = []
        vertex = d
        while vertex != s:
            link_id = tree[vertex]
            path.append(link_id)
            vertex = self._link_src[link_id]
        path.reverse()
        return tuple(path)

    @property
    def sources_searched(self) -> tuple[int, ...]:
        """The vertex indices a single-source search has run from so far."""
        return tuple(self._trees)
