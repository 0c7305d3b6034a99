"""The modelled cluster: ranks and switches joined by directed links, with memoised minimum-latency routing."""

from __future__ import annotations

import difflib
import heapq
import math
import numbers
import operator
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from simdist.errors import ClusterSpecError
from simdist.units import format_bandwidth, format_time, parse_bandwidth, parse_time

COLLECTIVES: frozenset[str] = frozenset(
    {
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all_to_all",
        "barrier",
    }
)
"""Collectives whose algorithm a cluster may fix through ``Cluster.algorithms``."""

ALGORITHMS: frozenset[str] = frozenset({"ring", "tree", "direct", "rhd", "auto"})
"""Algorithm names accepted in ``Cluster.algorithms`` ("rhd": recursive halving/doubling)."""

# Routing sums latencies as whole picoseconds: integer sums are exact, so two paths of equal
# latency tie exactly whatever order their links are added in, and the hop-count tie-break applies.
_PS_PER_S = 1e12


@dataclass(frozen=True, slots=True)
class Link:
    """One directed link: ``bandwidth`` in bytes/s, ``latency`` in seconds; ``src``/``dst`` are ranks or switches."""

    id: int
    src: int | str
    dst: int | str
    bandwidth: float
    latency: float


def _suggest(word: str, choices: Iterable[str]) -> str:
    """Return " Did you mean ...?" for close matches of ``word`` in ``choices``, or ""."""
    close = difflib.get_close_matches(word, sorted(choices), n=3, cutoff=0.6)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def validate_algorithms(algorithms: Mapping[str, str] | None) -> dict[str, str]:
    """Return a copy of the per-collective algorithm choices after checking every key and value."""
    if algorithms is None:
        return {}
    if not isinstance(algorithms, Mapping):
        raise ClusterSpecError(
            f"algorithms must map collective names to algorithm names, e.g. {{'all_reduce': 'ring'}}; "
            f"found a {type(algorithms).__name__}"
        )
    checked: dict[str, str] = {}
    for collective, algorithm in algorithms.items():
        if collective not in COLLECTIVES:
            raise ClusterSpecError(
                f"algorithms: unknown collective {collective!r}; expected one of "
                f"{', '.join(sorted(COLLECTIVES))}.{_suggest(str(collective), COLLECTIVES)}"
            )
        if algorithm not in ALGORITHMS:
            raise ClusterSpecError(
                f"algorithms[{collective!r}]: unknown algorithm {algorithm!r}; expected one of "
                f"{', '.join(sorted(ALGORITHMS))}.{_suggest(str(algorithm), ALGORITHMS)}"
            )
        from simdist.comm.algorithms import SUPPORTED

        if algorithm != "auto" and algorithm not in SUPPORTED[collective]:
            raise ClusterSpecError(
                f"algorithms[{collective!r}]: {algorithm!r} does not implement {collective}; choose one of "
                f"{', '.join(SUPPORTED[collective])} or 'auto'"
            )
        checked[collective] = algorithm
    return checked


def _plural(count: int, noun: str) -> str:
    """Return "1 switch" or "3 switches"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('h') else 's'}"


def _positive_int(value: object, what: str) -> int:
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


def _canonical_graph(graph: object) -> tuple[nx.DiGraph, int, tuple[str, ...]]:
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
        latency = _edge_value(data, "latency", (u, v), parse_time)
        canon.add_edge(u, v, bandwidth=bandwidth, latency=latency)
    # Link ids follow the canonical edge order: by source vertex (ranks ascending, then switches in the
    # order the input lists them), then in the order each source's links were added. Two clusters
    # built the same way therefore number (and so route) identically.
    for link_id, (_, _, data) in enumerate(canon.edges(data=True)):
        data["link"] = link_id
    return nx.freeze(canon), world_size, tuple(switches)


class Cluster:
    """Ranks (ints 0..world_size-1) and switches (strings) joined by directed links (bytes/s, seconds)."""

    def __init__(
        self,
        graph: nx.DiGraph,
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str = "custom",
    ) -> None:
        """Validate ``graph`` (edge ``bandwidth`` in bytes/s or unit strings, ``latency`` in seconds or strings)."""
        from simdist.compute.devices import DeviceSpec

        if isinstance(device, DeviceSpec):
            pass  # a user-built device model
        elif not isinstance(device, str) or not device.strip():
            raise ClusterSpecError(
                f"device must be a device model name such as 'H100' or a simdist.compute.DeviceSpec; "
                f"found {device!r}"
            )
        if not isinstance(name, str) or not name:
            raise ClusterSpecError(f"name must be a non-empty string; found {name!r}")
        self.graph, self.world_size, self.switches = _canonical_graph(graph)
        #: the device model name (or a user-built ``DeviceSpec``) of every rank
        self.device: Any = device
        self.name: str = name
        self.algorithms: dict[str, str] = validate_algorithms(algorithms)
        self.links: tuple[Link, ...] = tuple(
            Link(data["link"], u, v, data["bandwidth"], data["latency"])
            for u, v, data in self.graph.edges(data=True)
        )
        # Vertex indices: rank r is index r, switch j is world_size + j; routing works on these.
        self._index: dict[int | str, int] = {r: r for r in range(self.world_size)}
        self._index.update({s: self.world_size + j for j, s in enumerate(self.switches)})
        self._out: list[list[tuple[int, int, int]]] = [[] for _ in self._index]
        self._link_src: list[int] = []
        for link in self.links:
            src, dst = self._index[link.src], self._index[link.dst]
            self._out[src].append((dst, link.id, round(link.latency * _PS_PER_S)))
            self._link_src.append(src)
        self._trees: dict[int, array] = {}
        self._keys: dict[int, list[tuple[int, int, int] | None]] = {}
        self._routes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._latencies: dict[tuple[int, int], float] = {}
        self._bandwidths: dict[tuple[int, int], float] = {}
        #: ranks per node (for LOCAL_RANK); None when the topology has no notion of nodes
        self.ranks_per_node: int | None = None
        self._check_connected()

    @property
    def device_name(self) -> str:
        """The name of the ranks' device model."""
        return self.device if isinstance(self.device, str) else self.device.name

    # ----------------------------------------------------------------- validation

    def _reachable(self, start: int, reverse: bool) -> list[bool]:
        """Return which vertex indices ``start`` reaches (or, with ``reverse``, which reach ``start``)."""
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

    def _check_connected(self) -> None:
        """Raise unless every rank reaches every other rank (checked through rank 0, both directions)."""
        # Reachability is transitive, so "0 reaches all" and "all reach 0" cover every ordered pair.
        for reverse in (False, True):
            seen = self._reachable(0, reverse)
            for r in range(self.world_size):
                if not seen[r]:
                    src, dst = (r, 0) if reverse else (0, r)
                    raise ClusterSpecError(
                        f"cluster {self.name!r} is disconnected: rank {src} cannot reach rank {dst}; add links "
                        f"(both directions for a full-duplex cable) so every rank can reach every other rank"
                    )

    # ----------------------------------------------------------------- routing

    def _tree(self, src: int) -> array:
        """Return, for every vertex index, the last link of the best route from rank ``src`` (-1: none)."""
        # Best key per vertex: (latency in ps, hop count, id of the last link). Minimising the last-link
        # id among otherwise equal routes makes ties depend only on link numbering, never on hashing.
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

    def _check_rank(self, rank: object, what: str) -> int:
        """Return ``rank`` as an int after checking it is a rank of this cluster."""
        try:
            value = operator.index(rank)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                f"{what} must be an int rank in 0..{self.world_size - 1}; found {rank!r}"
            ) from None
        if not 0 <= value < self.world_size:
            raise ValueError(
                f"{what} rank {value} is out of range: this cluster has ranks 0..{self.world_size - 1}"
            )
        return value

    def _compute_route(self, src: int, dst: int) -> tuple[int, ...]:
        """Compute, memoise and return the route from ``src`` to ``dst`` (the cache-miss path of ``route``)."""
        s, d = self._check_rank(src, "route source"), self._check_rank(dst, "route destination")
        if s != d and s not in self._trees and all(v >= self.world_size for v, _, _ in self._out[s]):
            route = self._route_via_switches(s, d)
            self._routes[(src, dst)] = route
            return route
        tree = self._trees.get(s)
        if tree is None:
            tree = self._tree(s)
        route = self._walk(tree, s, d)
        self._routes[(src, dst)] = route
        return route

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

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """Return the link ids from rank ``src`` to rank ``dst`` on the minimum-latency route (``()`` if equal)."""
        # The hot path is one dict lookup; a miss runs (at most once per source) a single-source Dijkstra.
        try:
            return self._routes[(src, dst)]
        except KeyError:
            return self._compute_route(src, dst)

    def path_latency(self, src: int, dst: int) -> float:
        """Return the summed link latency (seconds) of the route from ``src`` to ``dst``; 0 if equal."""
        try:
            return self._latencies[(src, dst)]
        except KeyError:
            value = math.fsum(self.links[i].latency for i in self.route(src, dst))
            self._latencies[(src, dst)] = value
            return value

    def path_bandwidth(self, src: int, dst: int) -> float:
        """Return the smallest link bandwidth (bytes/s) on the route from ``src`` to ``dst``; inf if equal."""
        try:
            return self._bandwidths[(src, dst)]
        except KeyError:
            value = min((self.links[i].bandwidth for i in self.route(src, dst)), default=math.inf)
            self._bandwidths[(src, dst)] = value
            return value

    def link(self, link_id: int) -> Link:
        """Return the link numbered ``link_id`` (0..len(links)-1)."""
        return self.links[link_id]

    # ----------------------------------------------------------------- description

    def __repr__(self) -> str:
        return (
            f"<Cluster {self.name!r}: {self.world_size} x {self.device_name}, "
            f"{_plural(len(self.switches), 'switch')}, {_plural(len(self.links), 'link')}>"
        )

    def describe(self) -> str:
        """Return a multi-line summary: ranks, switches, link classes with bandwidth and latency."""

        def kind(v: int | str) -> str:
            # "node3.nvswitch" and "node7.nvswitch" are the same kind of switch.
            return "rank" if isinstance(v, int) else re.sub(r"\d+", "*", v)

        classes: dict[tuple[str, str, float, float], int] = {}
        for link in self.links:
            key = (kind(link.src), kind(link.dst), link.bandwidth, link.latency)
            classes[key] = classes.get(key, 0) + 1
        shown = ", ".join(self.switches[:6]) + (
            f", ... ({len(self.switches)} in all)" if len(self.switches) > 6 else ""
        )
        lines = [
            (
                f"Cluster {self.name!r}: {_plural(self.world_size, 'rank')} of {self.device_name}, "
                f"{_plural(len(self.switches), 'switch')}, {_plural(len(self.links), 'directed link')}"
            ),
            f"  switches: {shown or 'none'}",
            "  algorithms: "
            + (
                ", ".join(f"{k}={v}" for k, v in sorted(self.algorithms.items()))
                or "auto for every collective"
            ),
            "  link classes (count, bandwidth per direction, latency per link):",
        ]
        for (src, dst, bandwidth, latency), count in classes.items():
            lines.append(
                f"    {src} -> {dst}: {count} x {format_bandwidth(bandwidth)}, {format_time(latency)}"
            )
        if self.world_size > 1:
            far = max(range(self.world_size), key=lambda r: (self.path_latency(0, r), -r))
            lines.append(
                f"  rank 0 -> rank {far} (highest latency from rank 0): {len(self.route(0, far))} links, "
                f"{format_time(self.path_latency(0, far))}, {format_bandwidth(self.path_bandwidth(0, far))}"
            )
        return "\n".join(lines)

    def to_config(self) -> dict[str, Any]:
        """Return this cluster as a config mapping (explicit ``links`` form) that ``load_cluster`` reads back."""
        cluster: dict[str, Any] = {"name": self.name, "world_size": self.world_size, "device": self.device_name}
        if self.switches:
            cluster["switches"] = list(self.switches)  # keeps switch order, hence link numbering
        if self.algorithms:
            cluster["algorithms"] = dict(self.algorithms)
        links = [
            {"src": l.src, "dst": l.dst, "bandwidth": l.bandwidth, "latency": l.latency} for l in self.links
        ]
        return {"cluster": cluster, "links": links}

    # ----------------------------------------------------------------- builders

    @classmethod
    def from_graph(
        cls,
        graph: nx.DiGraph,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str = "custom",
    ) -> Cluster:
        """Validate a user graph (edge ``bandwidth`` bytes/s, ``latency`` seconds; unit strings allowed)."""
        return cls(graph, device=device, algorithms=algorithms, name=name)

    @classmethod
    def ring(
        cls,
        n: int,
        bandwidth: str | float = "100GB/s",
        latency: str | float = "5us",
        bidirectional: bool = True,
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Cluster:
        """Rank i links directly to rank (i+1) % n (and back, if ``bidirectional``); bytes/s and seconds."""
        n = _positive_int(n, "ring: n (number of ranks)")
        if not isinstance(bidirectional, bool):
            raise ClusterSpecError(f"ring: bidirectional must be True or False; found {bidirectional!r}")
        attrs = {"bandwidth": parse_bandwidth(bandwidth), "latency": parse_time(latency)}
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        if n > 1:
            for i in range(n):
                graph.add_edge(i, (i + 1) % n, **attrs)
            if bidirectional:
                for i in range(n):
                    graph.add_edge((i + 1) % n, i, **attrs)
        return cls(graph, device=device, algorithms=algorithms, name=name or f"ring-{n}")

    @classmethod
    def switch(
        cls,
        n: int,
        bandwidth: str | float = "100GB/s",
        latency: str | float = "5us",
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Cluster:
        """Star: each rank has an uplink to and a downlink from the switch "switch"; latency is per link."""
        n = _positive_int(n, "switch: n (number of ranks)")
        attrs = {"bandwidth": parse_bandwidth(bandwidth), "latency": parse_time(latency)}
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        graph.add_node("switch")
        for r in range(n):
            graph.add_edge(r, "switch", **attrs)
        for r in range(n):
            graph.add_edge("switch", r, **attrs)
        return cls(graph, device=device, algorithms=algorithms, name=name or f"switch-{n}")

    @classmethod
    def fully_connected(
        cls,
        n: int,
        bandwidth: str | float = "100GB/s",
        latency: str | float = "5us",
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Cluster:
        """A direct link (bytes/s, seconds) for every ordered pair of distinct ranks."""
        n = _positive_int(n, "fully_connected: n (number of ranks)")
        attrs = {"bandwidth": parse_bandwidth(bandwidth), "latency": parse_time(latency)}
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        graph.add_edges_from(((i, j) for i in range(n) for j in range(n) if i != j), **attrs)
        return cls(graph, device=device, algorithms=algorithms, name=name or f"fully-connected-{n}")

    @classmethod
    def two_level(
        cls,
        nodes: int,
        gpus_per_node: int = 8,
        intra_bandwidth: str | float = "450GB/s",
        intra_latency: str | float = "1us",
        inter_bandwidth: str | float = "50GB/s",
        inter_latency: str | float = "5us",
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Cluster:
        """Nodes of GPUs: each GPU links to its node's "node{k}.nvswitch" and to the fabric switch "ib"."""
        nodes = _positive_int(nodes, "two_level: nodes")
        per_node = _positive_int(gpus_per_node, "two_level: gpus_per_node")
        intra = {"bandwidth": parse_bandwidth(intra_bandwidth), "latency": parse_time(intra_latency)}
        inter = {"bandwidth": parse_bandwidth(inter_bandwidth), "latency": parse_time(inter_latency)}
        # Routing minimises latency: intra-node traffic stays on NVLink only while the NVSwitch path
        # (2 x intra_latency) is no slower than the IB path (2 x inter_latency). On a tie the NVSwitch
        # links win because they are numbered first (their switches are added before "ib").
        if intra["latency"] > inter["latency"]:
            raise ClusterSpecError(
                f"two_level: intra_latency {intra_latency!r} exceeds inter_latency {inter_latency!r}; routes "
                f"take the lowest-latency path, so traffic inside a node would leave NVLink for IB. Use an "
                f"intra-node latency no larger than the inter-node one, or build the graph with from_graph"
            )
        graph = nx.DiGraph()
        graph.add_nodes_from(range(nodes * per_node))
        graph.add_nodes_from(f"node{k}.nvswitch" for k in range(nodes))
        graph.add_node("ib")
        for rank in range(nodes * per_node):
            nvswitch = f"node{rank // per_node}.nvswitch"
            graph.add_edge(rank, nvswitch, **intra)
            graph.add_edge(nvswitch, rank, **intra)
            # One NIC per GPU (as in a DGX): every GPU has its own full-duplex port on the fabric.
            graph.add_edge(rank, "ib", **inter)
            graph.add_edge("ib", rank, **inter)
        default_name = f"two-level-{nodes}x{per_node}"
        cluster = cls(graph, device=device, algorithms=algorithms, name=name or default_name)
        cluster.ranks_per_node = per_node
        return cluster

    @classmethod
    def torus(
        cls,
        dims: Sequence[int],
        bandwidth: str | float = "100GB/s",
        latency: str | float = "5us",
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Cluster:
        """n-D torus of ranks (row-major numbering), direct full-duplex links to wraparound neighbours."""
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
            raise ClusterSpecError(
                f"torus: dims must be a non-empty sequence of sizes such as (4, 4); found {dims!r}"
            )
        sizes = tuple(_positive_int(d, f"torus: dims[{i}]") for i, d in enumerate(dims))
        attrs = {"bandwidth": parse_bandwidth(bandwidth), "latency": parse_time(latency)}
        strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        n = math.prod(sizes)
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        for rank in range(n):
            for size, stride in zip(sizes, strides):
                if size == 1:
                    continue  # a dimension of size 1 has no neighbour but the rank itself
                coord = (rank // stride) % size
                for step in (1, -1):
                    graph.add_edge(rank, rank + (((coord + step) % size) - coord) * stride, **attrs)
        default_name = "torus-" + "x".join(map(str, sizes))
        return cls(graph, device=device, algorithms=algorithms, name=name or default_name)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Cluster:
        """Build the named preset (see ``simdist.network.presets``); ``world_size=`` sizes parametric presets."""
        from simdist.network.presets import build_preset

        return build_preset(name, **overrides)

    @classmethod
    def from_file(cls, path: str, world_size: int | None = None) -> Cluster:
        """Load a cluster from a .toml or .json config file (format in ``simdist.network.presets``)."""
        from simdist.network.presets import load_file

        return load_file(path, world_size)
