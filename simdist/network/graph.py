"""A cluster's graph checked and frozen: ranks 0..n-1 and named switches joined by numbered directed links."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from simdist import algorithms as algos
from simdist.errors import ClusterSpecError
from simdist.units import parse_bandwidth, parse_latency

#: the largest world a cluster may have: a million ranks already take tens of seconds and gigabytes to build,
#: so a larger number is a typo (or a job for the closed-form estimates, ``simdist.algorithms.estimate``)
MAX_WORLD_SIZE = 1 << 20
#: the most directed links a builder makes (a graph this size takes minutes and several GB to build)
MAX_LINKS = 1 << 23


@dataclass(frozen=True, slots=True)
class Link:
    """One directed link: ``bandwidth`` in bytes/s, ``latency`` in seconds; ``src``/``dst`` are ranks or switches."""

    id: int
    src: int | str
    dst: int | str
    bandwidth: float
    latency: float


def suggest(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """Return " Did you mean ...?" for close matches of ``word`` in ``choices``, or ""."""
    close = difflib.get_close_matches(word, sorted(choices), n=3, cutoff=cutoff)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def validate_algorithms(algorithms: Mapping[str, str] | None) -> dict[str, str]:
    """Return a copy of the per-collective algorithm choices after checking each against the registry."""
    if algorithms is None:
        return {}
    if not isinstance(algorithms, Mapping):
        raise ClusterSpecError(
            f"algorithms must map collective names to algorithm names, e.g. {{'all_reduce': 'ring'}}; "
            f"found a {type(algorithms).__name__}"
        )
    checked: dict[str, str] = {}
    for collective, algorithm in algorithms.items():
        try:
            algos.check_collective(collective)
        except ValueError as exc:
            raise ClusterSpecError(f"algorithms: {exc}") from None
        try:
            algos.check_choice(collective, algorithm)
        except ValueError as exc:
            raise ClusterSpecError(f"algorithms[{collective!r}]: {exc}") from None
        checked[collective] = algorithm
    return checked


def plural(count: int, noun: str) -> str:
    """Return "1 switch" or "3 switches"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('h') else 's'}"


def world_size_within_limit(world_size: int, what: str, links: int = 0) -> int:
    """Return ``world_size`` after checking it, and the ``links`` a builder would make, are within the limits."""
    if world_size > MAX_WORLD_SIZE:
        raise ClusterSpecError(
            f"{what} gives {world_size} ranks, more than the {MAX_WORLD_SIZE} a simulated cluster may have "
            f"(building it alone would take minutes and gigabytes); simulate a smaller world, or price large ones "
            f"with the closed forms of simdist.algorithms.estimate"
        )
    if links > MAX_LINKS:
        raise ClusterSpecError(
            f"{what} gives {links} directed links, more than the {MAX_LINKS} a simulated cluster may have; use "
            f"fewer ranks, or a topology with fewer links per rank (a switch has 2)"
        )
    return world_size


def positive_int(value: object, what: str) -> int:
    """Return ``value`` as an int after checking it is a whole number >= 1 (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ClusterSpecError(f"{what} must be a positive integer; found {value!r}")
    if value < 1:
        raise ClusterSpecError(f"{what} must be a positive integer; found {value}")
    return int(value)


def _edge_value(data: Mapping[str, Any], key: str, edge: tuple[object, object], parse: Any) -> float:
    """Return the parsed ``key`` attribute of ``edge``, naming the edge if it is missing or bad."""
    u, v = edge
    if key not in data:
        raise ClusterSpecError(
            f"link {u!r} -> {v!r} has no {key!r} attribute; every link needs 'bandwidth' (bytes/s or "
            f"a string such as '100GB/s') and 'latency' (seconds or a string such as '5us')"
        )
    try:
        return parse(data[key])
    except ClusterSpecError as exc:
        raise ClusterSpecError(f"link {u!r} -> {v!r}: {exc}") from None


def canonical_graph(graph: object) -> tuple[nx.DiGraph, int, tuple[str, ...]]:
    """Return a validated, frozen copy of ``graph`` with ranks first, then switches, and link ids on edges."""
    if not isinstance(graph, nx.Graph):
        raise ClusterSpecError(
            f"expected a networkx.DiGraph of ranks and switches; found a {type(graph).__name__}"
        )
    if graph.is_multigraph():
        raise ClusterSpecError(
            "multigraphs are not supported: merge parallel links between the same two vertices into one "
            "link whose bandwidth is their sum"
        )
    if not graph.is_directed():
        # An undirected edge is a full-duplex cable: one directed link each way.
        graph = graph.to_directed()
    ranks: list[int] = []
    switches: list[str] = []
    for v in graph.nodes:
        if isinstance(v, str):
            if not v:
                raise ClusterSpecError("a switch vertex has an empty name; name every switch, e.g. 'sw0'")
            switches.append(v)
        elif isinstance(v, numbers.Integral) and not isinstance(v, bool):
            ranks.append(int(v))
        else:
            raise ClusterSpecError(
                f"vertex {v!r} is a {type(v).__name__}; ranks must be ints 0..world_size-1 and switches strings"
            )
    if not ranks:
        raise ClusterSpecError("the graph has no rank vertices (ints 0..world_size-1): world size would be 0")
    world_size = len(ranks)
    rank_set = set(ranks)
    if rank_set != set(range(world_size)):
        missing = min(set(range(world_size)) - rank_set)
        raise ClusterSpecError(
            f"ranks must be exactly 0..{world_size - 1} for {world_size} rank vertices; rank {missing} is "
            f"missing and rank(s) {sorted(rank_set - set(range(world_size)))[:5]} are out of range"
        )
    canon = nx.DiGraph()
    canon.add_nodes_from(range(world_size))
    canon.add_nodes_from(switches)
    for u, v, data in graph.edges(data=True):
        u = u if isinstance(u, str) else int(u)
        v = v if isinstance(v, str) else int(v)
        if u == v:
            raise ClusterSpecError(
                f"link {u!r} -> {v!r} is a self-loop; remove it (a rank needs no link to itself)"
            )
        bandwidth = _edge_value(data, "bandwidth", (u, v), parse_bandwidth)
        latency = _edge_value(data, "latency", (u, v), parse_latency)
        canon.add_edge(u, v, bandwidth=bandwidth, latency=latency)
    # Link ids follow the canonical edge order: by source vertex (ranks ascending, then switches in the
    # order the input lists them), then in the order each source's links were added. Two clusters
    # built the same way therefore number (and so route) identically.
    for link_id, (_, _, data) in enumerate(canon.edges(data=True)):
        data["link"] = link_id
    return nx.freeze(canon), world_size, tuple(switches)
