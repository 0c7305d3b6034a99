"""The modelled cluster: ranks and switches joined by directed links, with memoised minimum-latency routing.

The class is assembled from mixins, one file each: :mod:`~simdist.network.builders` (ring, switch, ...),
:mod:`~simdist.network.presets` (named clusters) and :mod:`~simdist.network.config` (TOML/JSON files). Its
graph is checked and frozen by :mod:`~simdist.network.graph` and routed by :mod:`~simdist.network.routing`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx

from simdist.algorithms import nccl
from simdist.compute.devicefile import device_config, is_builtin
from simdist.compute.devices import DeviceSpec, get_device
from simdist.errors import ClusterSpecError
from simdist.network.builders import ClusterBuilders
from simdist.network.config import ClusterFiles
from simdist.network.graph import Link, canonical_graph, plural, validate_algorithms
from simdist.network.models import check_collective_model
from simdist.network.presets import ClusterPresets
from simdist.network.routing import Router
from simdist.units import format_bandwidth, format_time


class Cluster(ClusterBuilders, ClusterPresets, ClusterFiles):
    """Ranks (ints 0..world_size-1) and switches (strings) joined by directed links (bytes/s, seconds)."""

    def __init__(
        self,
        graph: nx.DiGraph,
        *,
        device: str = "H100",
        algorithms: Mapping[str, str] | None = None,
        name: str = "custom",
        collective_model: str = "alpha-beta",
    ) -> None:
        """Validate ``graph`` (edge ``bandwidth`` in bytes/s or unit strings, ``latency`` in seconds or strings)."""
        if isinstance(device, DeviceSpec):
            pass  # a user-built device model
        elif not isinstance(device, str) or not device.strip():
            raise ClusterSpecError(
                f"device must be a device model name such as 'H100' or a simdist.compute.DeviceSpec; "
                f"found {device!r}"
            )
        else:
            get_device(device)  # an unknown name fails here, where the cluster is described, not mid-run
        if not isinstance(name, str) or not name:
            raise ClusterSpecError(f"name must be a non-empty string; found {name!r}")
        self.graph, self.world_size, self.switches = canonical_graph(graph)
        #: the device model name (or a user-built ``DeviceSpec``) of every rank
        self.device: Any = device
        self.name: str = name
        self.algorithms: dict[str, str] = validate_algorithms(algorithms)
        #: how collectives are timed: "alpha-beta" (each message on its links) or "nccl" (NCCL's tuner)
        self.collective_model: str = check_collective_model(collective_model, device)
        self.links: tuple[Link, ...] = tuple(
            Link(data["link"], u, v, data["bandwidth"], data["latency"])
            for u, v, data in self.graph.edges(data=True)
        )
        # Vertex indices: rank r is index r, switch j is world_size + j; routing works on these.
        index: dict[int | str, int] = {r: r for r in range(self.world_size)}
        index.update({s: self.world_size + j for j, s in enumerate(self.switches)})
        self._router = Router(
            len(index), self.world_size, [(index[l.src], index[l.dst], l.latency) for l in self.links]
        )
        self._routes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._latencies: dict[tuple[int, int], float] = {}
        self._bandwidths: dict[tuple[int, int], float] = {}
        #: ranks per node (LOCAL_WORLD_SIZE; a rank's LOCAL_RANK is its place in its node); None when the
        #: topology has no notion of nodes
        self.ranks_per_node: int | None = None
        #: GPUs in each node, ``ranks_per_node`` of which the ranks use (a node's ``device_count()``); None when the
        #: topology has no notion of nodes
        self.gpus_per_node: int | None = None
        #: corrections of NCCL's model fitted to this cluster's measurements (``collective_model="nccl"`` only)
        self.nccl_overrides: nccl.Overrides = nccl.NO_OVERRIDES
        #: bytes/s at which a rank works through its own memory under ``collective_model="gloo"``: adding a
        #: received message into its buffer, the copies torch's ProcessGroupGloo makes (inf: they take no time)
        self.local_bandwidth: float = math.inf
        self._check_connected()

    def nccl_fabric(self, ranks: Sequence[int]) -> nccl.Fabric:
        """The communicator of ``ranks`` as NCCL's tuner sees it on this cluster (its nodes, NICs and GPUs)."""
        per_node = self.ranks_per_node
        if per_node is None:
            raise ClusterSpecError(
                f"cluster {self.name!r}: collective_model='nccl' needs nodes of GPUs (a two_level cluster or a "
                f"preset such as 'dgx-h100'); this cluster has none: use collective_model='alpha-beta'"
            )
        nodes = sorted({r // per_node for r in ranks})
        nic = math.inf
        if len(nodes) > 1:
            other = next(r for r in ranks if r // per_node != ranks[0] // per_node)
            nic = self.path_bandwidth(ranks[0], other)
        device = get_device(self.device).name if isinstance(self.device, str) else self.device_name
        fab = nccl.fabric(device, len(ranks), len(nodes), nic)
        return (
            fab if self.nccl_overrides.is_default else dataclasses.replace(fab, overrides=self.nccl_overrides)
        )

    @property
    def device_name(self) -> str:
        """The name of the ranks' device model."""
        return self.device if isinstance(self.device, str) else self.device.name

    # ----------------------------------------------------------------- validation

    def _check_connected(self) -> None:
        """Raise unless every rank reaches every other rank (checked through rank 0, both directions)."""
        # Reachability is transitive, so "0 reaches all" and "all reach 0" cover every ordered pair.
        for reverse in (False, True):
            seen = self._router.reachable(0, reverse)
            for r in range(self.world_size):
                if not seen[r]:
                    src, dst = (r, 0) if reverse else (0, r)
                    raise ClusterSpecError(
                        f"cluster {self.name!r} is disconnected: rank {src} cannot reach rank {dst}; add links "
                        f"(both directions for a full-duplex cable) so every rank can reach every other rank"
                    )

    # ----------------------------------------------------------------- routing

    def _check_rank(self, rank: object, what: str) -> int:
        """Return ``rank`` as an int after checking it is a rank of this cluster."""
        try:
            value = operator.index(rank)  # type: ignore[arg-type]
        except TypeError:
            raise ClusterSpecError(
                f"{what} must be an int rank in 0..{self.world_size - 1}; found {rank!r}"
            ) from None
        if not 0 <= value < self.world_size:
            raise ClusterSpecError(
                f"{what} rank {value} is out of range: this cluster has ranks 0..{self.world_size - 1}"
            )
        return value

    def _compute_route(self, src: int, dst: int) -> tuple[int, ...]:
        """Compute, memoise and return the route from ``src`` to ``dst`` (the cache-miss path of ``route``)."""
        s, d = self._check_rank(src, "route source"), self._check_rank(dst, "route destination")
        route = self._router.route(s, d)
        self._routes[(src, dst)] = route
        return route

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

    def alpha_beta(self, ranks: Sequence[int]) -> tuple[tuple[float, float], tuple[float, float]]:
        """(latency s, seconds per byte) between ring neighbours of ``ranks`` (the mean latency and the slowest
        bandwidth of its hops), and between its farthest-apart members (the first and the middle one): what
        prices an algorithm that talks to neighbours only, and one that talks across the group."""
        n = len(ranks)
        if n < 2:
            return (0.0, 0.0), (0.0, 0.0)
        # a ring's bytes move at the pace of its slowest hop (e.g. the one crossing nodes), but its latencies add
        # up hop after hop around the ring: each step's message is the next hop's, so a call pays the mean
        # latency of its hops per step, not the highest
        near = (
            math.fsum(self.path_latency(ranks[i], ranks[(i + 1) % n]) for i in range(n)) / n,
            max(1.0 / self.path_bandwidth(ranks[i], ranks[(i + 1) % n]) for i in range(n)),
        )
        far = (self.path_latency(ranks[0], ranks[n // 2]), 1.0 / self.path_bandwidth(ranks[0], ranks[n // 2]))
        return near, far

    def hop_alpha_beta(self, ranks: Sequence[int], distance: int) -> tuple[float, float]:
        """(latency s, seconds per byte) of the slowest route between members ``i`` and ``i XOR distance`` of
        ``ranks``: what one round of recursive halving or doubling at that distance costs."""
        n = len(ranks)
        pairs = [
            (ranks[i], ranks[i ^ distance]) for i in range(n) if (i ^ distance) < n and i != i ^ distance
        ]
        if not pairs:
            return 0.0, 0.0
        return (
            max(self.path_latency(a, b) for a, b in pairs),
            max(1.0 / self.path_bandwidth(a, b) for a, b in pairs),
        )

    def link(self, link_id: int) -> Link:
        """Return the link numbered ``link_id`` (0..len(links)-1)."""
        return self.links[link_id]

    # ----------------------------------------------------------------- description

    def __repr__(self) -> str:
        return (
            f"<Cluster {self.name!r}: {self.world_size} x {self.device_name}, "
            f"{plural(len(self.switches), 'switch')}, {plural(len(self.links), 'link')}>"
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
                f"Cluster {self.name!r}: {plural(self.world_size, 'rank')} of {self.device_name}, "
                f"{plural(len(self.switches), 'switch')}, {plural(len(self.links), 'directed link')}"
            ),
            f"  switches: {shown or 'none'}",
            "  algorithms: "
            + (
                ", ".join(f"{k}={v}" for k, v in sorted(self.algorithms.items()))
                or "auto for every collective"
            )
            + (
                ""
                if self.collective_model == "alpha-beta"
                else f"; timed by the {self.collective_model} model"
            )
            + (
                f" (adds and copies at {format_bandwidth(self.local_bandwidth)})"
                if self.local_bandwidth != math.inf
                else ""
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
        cluster: dict[str, Any] = {
            "name": self.name,
            "world_size": self.world_size,
            # a device built by hand or fitted by calibrate keeps its figures; a built-in one is named
            "device": self.device_name
            if isinstance(self.device, str) or is_builtin(self.device)
            else device_config(self.device),
        }
        if self.switches:
            cluster["switches"] = list(self.switches)  # keeps switch order, hence link numbering
        if self.ranks_per_node is not None:
            cluster["ranks_per_node"] = self.ranks_per_node
            cluster["gpus_per_node"] = self.gpus_per_node
        if self.collective_model != "alpha-beta":
            cluster["collective_model"] = self.collective_model
        if not self.nccl_overrides.is_default:
            cluster["nccl"] = self.nccl_overrides.to_config()
        if self.local_bandwidth != math.inf:
            cluster["gloo"] = {"local_bandwidth": self.local_bandwidth}
        if self.algorithms:
            cluster["algorithms"] = dict(self.algorithms)
        links = [
            {"src": l.src, "dst": l.dst, "bandwidth": l.bandwidth, "latency": l.latency} for l in self.links
        ]
        return {"cluster": cluster, "links": links}


def build_preset(name: str, world_size: int | None = None, **overrides: Any) -> Cluster:
    """``Cluster.preset``: build preset ``name``; ``world_size`` sizes a parametric preset."""
    return Cluster.preset(name, world_size, **overrides)


def load_cluster(spec: str, world_size: int | None = None) -> Cluster:
    """``Cluster.load``: the cluster named by a preset name or a .toml/.json path, sized by ``world_size``."""
    return Cluster.load(spec, world_size)


def load_file(path: str | Path, world_size: int | None = None) -> Cluster:
    """``Cluster.from_file``: a cluster from a .toml or .json config file."""
    return Cluster.from_file(path, world_size)


def cluster_from_config(
    config: Mapping[str, Any], world_size: int | None = None, source: str = "config"
) -> Cluster:
    """``Cluster.from_config``: a cluster from a parsed config mapping; ``source`` names it in errors."""
    return Cluster.from_config(config, world_size, source)


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """``cluster.save(path)``: write it to a .toml or .json file that ``load_cluster`` reads back."""
    cluster.save(path)
