"""Cluster builders: the usual topologies (ring, switch, fully connected, two-level, torus) as classmethods.

:class:`ClusterBuilders` is a mixin of :class:`~simdist.network.cluster.Cluster`; each builder makes the
networkx graph of its topology and hands it to the class, which validates it. Bandwidths are bytes/s and
latencies seconds, or unit strings such as "100GB/s" and "5us".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import networkx as nx
from typing_extensions import Self

from simdist.errors import ClusterSpecError
from simdist.network.graph import positive_int, world_size_within_limit
from simdist.units import parse_bandwidth, parse_latency

#: builder names usable as ``builder = ...`` in config files (each a classmethod of the cluster class)
BUILDERS: tuple[str, ...] = ("ring", "switch", "fully_connected", "two_level", "torus")
#: the keyword that sets each builder's size, so that a world size can fill it in
SIZE_KEY: dict[str, str] = {
    "ring": "n",
    "switch": "n",
    "fully_connected": "n",
    "two_level": "nodes",
    "torus": "dims",
}


def _link(where: str, bandwidth: tuple[str, object], latency: tuple[str, object]) -> dict[str, float]:
    """Edge attributes of one link from its (argument name, value) pairs, naming the argument in errors."""
    parsed: dict[str, float] = {}
    for key, (arg, value), parse in (
        ("bandwidth", bandwidth, parse_bandwidth),
        ("latency", latency, parse_latency),
    ):
        try:
            parsed[key] = parse(value)  # type: ignore[arg-type]
        except ClusterSpecError as exc:
            # "ring: latency 1e+300 ..." rather than "ring: latency: latency 1e+300 ...".
            raise ClusterSpecError(f"{where}: {'' if arg == key else arg + ': '}{exc}") from None
    return parsed


class ClusterBuilders:
    """Classmethods that build common topologies; mixed into the cluster class."""

    ranks_per_node: int | None
    gpus_per_node: int | None

    @classmethod
    def from_graph(
        cls,
        graph: nx.DiGraph,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str = "custom",
    ) -> Self:
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
    ) -> Self:
        """Rank i links directly to rank (i+1) % n (and back, if ``bidirectional``); bytes/s and seconds."""
        n = world_size_within_limit(positive_int(n, "ring: n (number of ranks)"), "ring: n", 2 * n)
        if not isinstance(bidirectional, bool):
            raise ClusterSpecError(f"ring: bidirectional must be True or False; found {bidirectional!r}")
        attrs = _link("ring", ("bandwidth", bandwidth), ("latency", latency))
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
    ) -> Self:
        """Star: each rank has an uplink to and a downlink from the switch "switch"; latency is per link."""
        n = world_size_within_limit(positive_int(n, "switch: n (number of ranks)"), "switch: n", 2 * n)
        attrs = _link("switch", ("bandwidth", bandwidth), ("latency", latency))
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
    ) -> Self:
        """A direct link (bytes/s, seconds) for every ordered pair of distinct ranks."""
        n = positive_int(n, "fully_connected: n (number of ranks)")
        world_size_within_limit(n, f"fully_connected: n = {n}", n * (n - 1))
        attrs = _link("fully_connected", ("bandwidth", bandwidth), ("latency", latency))
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
        ranks_per_node: int | None = None,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str | None = None,
        collective_model: str = "alpha-beta",
    ) -> Self:
        """Nodes of GPUs: each GPU links to its node's "node{k}.nvswitch" and to the fabric switch "ib".

        ``ranks_per_node`` ranks use the first GPUs of each node (default: all ``gpus_per_node``), as torchrun's
        ``--nproc-per-node`` does on a node with more GPUs: the cluster's ranks are ``nodes x ranks_per_node``.
        ``collective_model="nccl"`` times collectives as NCCL's tuner predicts them on such nodes.
        """
        nodes = positive_int(nodes, "two_level: nodes")
        per_node = positive_int(gpus_per_node, "two_level: gpus_per_node")
        used = (
            per_node if ranks_per_node is None else positive_int(ranks_per_node, "two_level: ranks_per_node")
        )
        if used > per_node:
            raise ClusterSpecError(
                f"two_level: ranks_per_node {used} is more than the node's gpus_per_node {per_node}; a rank takes one "
                f"GPU: use at most {per_node} ranks per node, or more GPUs per node"
            )
        factor = "gpus_per_node" if ranks_per_node is None else "ranks_per_node"
        world_size_within_limit(
            nodes * used, f"two_level: nodes x {factor} ({nodes} x {used})", 4 * nodes * used
        )
        intra = _link("two_level", ("intra_bandwidth", intra_bandwidth), ("intra_latency", intra_latency))
        inter = _link("two_level", ("inter_bandwidth", inter_bandwidth), ("inter_latency", inter_latency))
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
        graph.add_nodes_from(range(nodes * used))
        graph.add_nodes_from(f"node{k}.nvswitch" for k in range(nodes))
        graph.add_node("ib")
        for rank in range(nodes * used):
            nvswitch = f"node{rank // used}.nvswitch"
            graph.add_edge(rank, nvswitch, **intra)
            graph.add_edge(nvswitch, rank, **intra)
            # One NIC per GPU (as in a DGX): every GPU has its own full-duplex port on the fabric.
            graph.add_edge(rank, "ib", **inter)
            graph.add_edge("ib", rank, **inter)
        default_name = (
            f"two-level-{nodes}x{per_node}" if used == per_node else f"two-level-{nodes}x{used}of{per_node}"
        )
        cluster = cls(
            graph,
            device=device,
            algorithms=algorithms,
            name=name or default_name,
            collective_model=collective_model,
        )
        cluster.ranks_per_node = used
        cluster.gpus_per_node = per_node
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
    ) -> Self:
        """n-D torus of ranks (row-major numbering), direct full-duplex links to wraparound neighbours."""
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
            raise ClusterSpecError(
                f"torus: dims must be a non-empty sequence of sizes such as (4, 4); found {dims!r}"
            )
        sizes = tuple(positive_int(d, f"torus: dims[{i}]") for i, d in enumerate(dims))
        per_rank = sum(min(2, size - 1) for size in sizes)  # a dimension of size 2 has one neighbour
        world_size_within_limit(math.prod(sizes), f"torus: dims {sizes}", math.prod(sizes) * per_rank)
        attrs = _link("torus", ("bandwidth", bandwidth), ("latency", latency))
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
