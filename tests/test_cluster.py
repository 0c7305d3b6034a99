"""The Cluster: builders' shapes, minimum-latency routing, validation, presets and config files."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import tomllib
from hypothesis import given
from hypothesis import strategies as st

from simdist.errors import ClusterSpecError
from simdist.network import (
    PRESETS,
    Cluster,
    Link,
    build_preset,
    cluster_from_config,
    config_to_toml,
    load_cluster,
    preset_names,
    save_cluster,
)


def hops(cluster: Cluster, src: int, dst: int) -> int:
    return len(cluster.route(src, dst))


def assert_route_is_a_path(cluster: Cluster, src: int, dst: int) -> None:
    """The route's links chain from src to dst."""
    links = [cluster.link(i) for i in cluster.route(src, dst)]
    if src == dst:
        assert links == []
        return
    assert links[0].src == src
    assert links[-1].dst == dst
    for a, b in itertools.pairwise(links):
        assert a.dst == b.src


def route_vertices(cluster: Cluster, src: int, dst: int) -> list[int | str]:
    return [src] + [cluster.link(i).dst for i in cluster.route(src, dst)]


# --------------------------------------------------------------------------- links and numbering


def test_links_are_numbered_densely_and_match_the_graph() -> None:
    cluster = Cluster.two_level(2, 4)
    assert [link.id for link in cluster.links] == list(range(len(cluster.links)))
    assert len(cluster.links) == cluster.graph.number_of_edges()
    for link in cluster.links:
        assert cluster.link(link.id) is link
        data = cluster.graph.edges[link.src, link.dst]
        assert (data["bandwidth"], data["latency"], data["link"]) == (link.bandwidth, link.latency, link.id)


def test_link_is_frozen() -> None:
    link = Cluster.ring(3).link(0)
    assert isinstance(link, Link)
    with pytest.raises(AttributeError):
        link.bandwidth = 1.0  # type: ignore[misc]


def test_graph_is_read_only() -> None:
    cluster = Cluster.ring(3)
    with pytest.raises(nx.NetworkXError):
        cluster.graph.add_edge(0, 2, bandwidth=1.0, latency=0.0)


# --------------------------------------------------------------------------- ring


@pytest.mark.parametrize(
    ("n", "bidirectional", "edges"),
    [
        (1, True, 0),
        (1, False, 0),
        (2, True, 2),
        (2, False, 2),
        (3, True, 6),
        (3, False, 3),
        (7, True, 14),
        (7, False, 7),
    ],
)
def test_ring_shape(n: int, bidirectional: bool, edges: int) -> None:
    cluster = Cluster.ring(n, bidirectional=bidirectional)
    assert cluster.world_size == n
    assert cluster.switches == ()
    assert sorted(cluster.graph.nodes) == list(range(n))
    assert len(cluster.links) == edges
    for link in cluster.links:
        assert link.bandwidth == 100e9 and link.latency == 5e-6


@given(st.integers(2, 40), st.data())
def test_ring_routes_take_the_short_way_round(n: int, data: st.DataObject) -> None:
    both, one_way = Cluster.ring(n), Cluster.ring(n, bidirectional=False)
    src = data.draw(st.integers(0, n - 1))
    dst = data.draw(st.integers(0, n - 1))
    forward = (dst - src) % n
    assert hops(both, src, dst) == min(forward, n - forward)
    assert hops(one_way, src, dst) == forward
    assert_route_is_a_path(both, src, dst)
    assert_route_is_a_path(one_way, src, dst)
    assert one_way.path_latency(src, dst) == pytest.approx(forward * 5e-6)


def test_single_rank_ring_routes_to_itself() -> None:
    cluster = Cluster.ring(1)
    assert cluster.route(0, 0) == ()
    assert cluster.path_latency(0, 0) == 0.0
    assert cluster.path_bandwidth(0, 0) == math.inf


# --------------------------------------------------------------------------- switch, fully connected


@given(st.integers(1, 30), st.data())
def test_switch_is_a_star(n: int, data: st.DataObject) -> None:
    cluster = Cluster.switch(n, "25GB/s", "2us")
    assert cluster.switches == ("switch",)
    assert cluster.graph.number_of_nodes() == n + 1
    assert len(cluster.links) == 2 * n
    src, dst = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    if src != dst:
        assert route_vertices(cluster, src, dst) == [src, "switch", dst]
        assert cluster.path_latency(src, dst) == pytest.approx(4e-6)  # latency is per link
        assert cluster.path_bandwidth(src, dst) == 25e9
    else:
        assert cluster.route(src, dst) == ()


@given(st.integers(1, 12), st.data())
def test_fully_connected_has_a_link_per_ordered_pair(n: int, data: st.DataObject) -> None:
    cluster = Cluster.fully_connected(n, 1e9, 1e-6)
    assert len(cluster.links) == n * (n - 1)
    src, dst = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    assert hops(cluster, src, dst) == (0 if src == dst else 1)


# --------------------------------------------------------------------------- two level


@given(st.integers(1, 5), st.integers(1, 8), st.data())
def test_two_level_keeps_intra_node_traffic_on_nvlink(nodes: int, per_node: int, data: st.DataObject) -> None:
    cluster = Cluster.two_level(nodes, per_node)
    n = nodes * per_node
    assert cluster.world_size == n
    assert cluster.graph.number_of_nodes() == n + nodes + 1
    assert len(cluster.links) == 4 * n
    assert set(cluster.switches) == {f"node{k}.nvswitch" for k in range(nodes)} | {"ib"}
    src, dst = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    if src == dst:
        return
    if src // per_node == dst // per_node:
        assert route_vertices(cluster, src, dst) == [src, f"node{src // per_node}.nvswitch", dst]
        assert cluster.path_bandwidth(src, dst) == 450e9
        assert cluster.path_latency(src, dst) == pytest.approx(2e-6)
    else:
        assert route_vertices(cluster, src, dst) == [src, "ib", dst]
        assert cluster.path_bandwidth(src, dst) == 50e9
        assert cluster.path_latency(src, dst) == pytest.approx(10e-6)


def test_two_level_equal_latencies_still_prefer_nvlink() -> None:
    cluster = Cluster.two_level(2, 4, intra_latency="3us", inter_latency="3us")
    assert route_vertices(cluster, 0, 3) == [0, "node0.nvswitch", 3]
    assert route_vertices(cluster, 0, 4) == [0, "ib", 4]


def test_two_level_refuses_nvlink_slower_than_ib() -> None:
    with pytest.raises(ClusterSpecError, match="intra_latency"):
        Cluster.two_level(2, 4, intra_latency="10us", inter_latency="5us")


# --------------------------------------------------------------------------- torus


def torus_distance(a: int, b: int, dims: tuple[int, ...]) -> int:
    """Manhattan distance with wraparound between row-major ranks a and b."""
    total = 0
    for size in reversed(dims):
        da, db = a % size, b % size
        a, b = a // size, b // size
        delta = abs(da - db)
        total += min(delta, size - delta)
    return total


@given(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), st.data())
def test_torus_routes_match_wraparound_manhattan_distance(dims: tuple[int, ...], data: st.DataObject) -> None:
    cluster = Cluster.torus(dims, latency="1us")
    n = math.prod(dims)
    assert cluster.world_size == n
    per_rank = sum(2 if d >= 3 else 1 if d == 2 else 0 for d in dims)
    assert len(cluster.links) == n * per_rank
    for _ in range(5):
        src, dst = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
        distance = torus_distance(src, dst, dims)
        assert hops(cluster, src, dst) == distance
        assert cluster.path_latency(src, dst) == pytest.approx(distance * 1e-6)
        assert_route_is_a_path(cluster, src, dst)


def test_torus_wraps_around() -> None:
    cluster = Cluster.torus((4, 5))
    assert route_vertices(cluster, 0, 4) == [0, 4]  # row wrap: (0,0) -> (0,4)
    assert route_vertices(cluster, 0, 15) == [0, 15]  # column wrap: (0,0) -> (3,0)
    assert cluster.graph.has_edge(19, 15) and cluster.graph.has_edge(19, 4)


# --------------------------------------------------------------------------- routing in general


@st.composite
def random_clusters(draw: st.DrawFn) -> Cluster:
    """Connected graphs of ranks and switches whose few distinct latencies make many ties."""
    n = draw(st.integers(2, 6))
    switches = [f"s{j}" for j in range(draw(st.integers(0, 3)))]
    vertices: list[int | str] = [*range(n), *switches]
    latency = st.sampled_from([0.0, 1e-6, 2e-6, 3e-6])
    graph = nx.DiGraph()
    graph.add_nodes_from(vertices)
    for r in range(n):  # a directed ring keeps every rank reachable from every other
        graph.add_edge(r, (r + 1) % n, bandwidth=1e9, latency=draw(latency))
    for u, v in draw(st.lists(st.tuples(st.sampled_from(vertices), st.sampled_from(vertices)), max_size=20)):
        if u != v:
            graph.add_edge(u, v, bandwidth=draw(st.sampled_from([1e9, 2e9])), latency=draw(latency))
    return Cluster.from_graph(graph)


@given(random_clusters(), st.data())
def test_routes_minimise_latency_then_hops(cluster: Cluster, data: st.DataObject) -> None:
    src = data.draw(st.integers(0, cluster.world_size - 1))
    # Lexicographic (latency, hops) as one exact integer weight: latency in ps times a bound on hops.
    scale = cluster.graph.number_of_nodes() + 1
    weights = {(l.src, l.dst): round(l.latency * 1e12) * scale + 1 for l in cluster.links}
    best = nx.single_source_dijkstra_path_length(cluster.graph, src, weight=lambda u, v, _: weights[u, v])
    for dst in range(cluster.world_size):
        assert_route_is_a_path(cluster, src, dst)
        route = cluster.route(dst=dst, src=src)
        assert sum(weights[cluster.link(i).src, cluster.link(i).dst] for i in route) == best[dst]
        assert cluster.path_latency(src, dst) == pytest.approx(
            math.fsum(cluster.link(i).latency for i in route)
        )
        expected_bw = min((cluster.link(i).bandwidth for i in route), default=math.inf)
        assert cluster.path_bandwidth(src, dst) == expected_bw


def all_routes(cluster: Cluster) -> list[tuple[int, ...]]:
    return [cluster.route(s, d) for s in range(cluster.world_size) for d in range(cluster.world_size)]


@pytest.mark.parametrize(
    "build",
    [
        lambda: Cluster.two_level(3, 4, intra_latency="5us", inter_latency="5us"),
        lambda: Cluster.torus((4, 4)),
        lambda: Cluster.ring(6),
    ],
)
def test_routes_are_identical_for_separately_built_clusters(build: object) -> None:
    a, b = build(), build()  # type: ignore[operator]
    assert a.links == b.links
    assert all_routes(a) == all_routes(b)


def test_routes_do_not_depend_on_string_hashing() -> None:
    # Switch names are strings, whose hashes change with PYTHONHASHSEED; ties must not.
    # this process is one side, another process with another hash seed the other
    script = textwrap.dedent(
        """
        from simdist.network import Cluster
        c = Cluster.two_level(3, 2, intra_latency="2us", inter_latency="2us")
        t = Cluster.torus((4, 4))
        print([c.route(s, d) for s in range(6) for d in range(6)], [t.route(0, d) for d in range(16)])
        """
    )
    root = Path(__file__).resolve().parents[1]
    other_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    there = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={"PYTHONHASHSEED": other_seed, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    c = Cluster.two_level(3, 2, intra_latency="2us", inter_latency="2us")
    t = Cluster.torus((4, 4))
    here = [c.route(s, d) for s in range(6) for d in range(6)], [t.route(0, d) for d in range(16)]
    assert there == " ".join(map(str, here)) + "\n"


def test_routes_are_memoised() -> None:
    cluster = Cluster.torus((5, 5))
    first = cluster.route(3, 17)
    assert cluster.route(3, 17) is first
    assert cluster.path_latency(3, 17) == cluster.path_latency(3, 17)


@pytest.mark.parametrize("build", [lambda: Cluster.switch(4096), lambda: Cluster.two_level(512, 8)])
def test_large_clusters_route_lazily_one_source_at_a_time(build: object) -> None:
    cluster = build()  # type: ignore[operator]
    assert cluster.world_size == 4096
    for dst in (1, 7, 8, 2049, 4095):
        assert_route_is_a_path(cluster, 0, dst)
        assert hops(cluster, 0, dst) == 2
    for _ in range(100_000):
        cluster.route(0, 4095)
    assert cluster.path_latency(4095, 0) == 2 * 5e-6  # two links of the builders' default 5 us
    # ranks that hang off switches reuse the switches' searches: no search starts at a rank, and only
    # the few switches the two sources use were searched (not all pairs, not one per source)
    assert all(v >= cluster.world_size for v in cluster._router.sources_searched)
    assert len(cluster._router.sources_searched) <= 3


def test_route_rejects_ranks_outside_the_cluster() -> None:
    cluster = Cluster.ring(4)
    with pytest.raises(ValueError, match="out of range"):
        cluster.route(0, 4)
    with pytest.raises(ValueError, match="int rank"):
        cluster.route("switch", 0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- from_graph and validation


def test_from_graph_accepts_unit_strings_undirected_graphs_and_numpy_ranks() -> None:
    graph = nx.Graph()
    graph.add_edge(np.int64(0), "sw", bandwidth="10Gb/s", latency="50us")
    graph.add_edge(np.int64(1), "sw", bandwidth="10Gb/s", latency="50us")
    cluster = Cluster.from_graph(graph, device="cpu", name="pair")
    assert (cluster.world_size, cluster.device, cluster.name) == (2, "cpu", "pair")
    assert len(cluster.links) == 4  # an undirected edge is a full-duplex cable
    assert route_vertices(cluster, 1, 0) == [1, "sw", 0]
    assert cluster.path_bandwidth(0, 1) == 1.25e9
    assert all(isinstance(link.src, (int, str)) and type(link.src) is not np.int64 for link in cluster.links)


def edge_graph(*edges: tuple[object, object, object, object], nodes: tuple[object, ...] = ()) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    for u, v, bw, lat in edges:
        graph.add_edge(u, v, bandwidth=bw, latency=lat)
    return graph


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        (nx.DiGraph(), "no rank vertices"),
        (edge_graph(("a", "b", 1.0, 0.0)), "no rank vertices"),
        (edge_graph((0, 1.5, 1.0, 0.0), (1.5, 0, 1.0, 0.0)), "float"),
        (edge_graph((0, (1, 2), 1.0, 0.0)), "tuple"),
        (edge_graph((0, True, 1.0, 0.0)), "bool"),
        (edge_graph((0, 2, 1.0, 0.0), (2, 0, 1.0, 0.0)), "rank 1 is missing"),
        (edge_graph((-1, 0, 1.0, 0.0), (0, -1, 1.0, 0.0)), "rank 1 is missing"),
        (edge_graph((0, 1, 0.0, 0.0), (1, 0, 1.0, 0.0)), "link 0 -> 1: bandwidth 0.0 is zero"),
        (edge_graph((0, 1, "-5GB/s", 0.0), (1, 0, 1.0, 0.0)), "link 0 -> 1: bandwidth '-5GB/s' is negative"),
        (edge_graph((0, 1, 1.0, 0.0), (1, 0, 1.0, "-1us")), "link 1 -> 0: latency '-1us' is negative"),
        (edge_graph((0, 1, 1.0, 0.0), (1, 0, "fast", 0.0)), "link 1 -> 0: bandwidth 'fast'"),
        (edge_graph((0, 1, 1.0, 0.0), (1, 1, 1.0, 0.0)), "self-loop"),
        (edge_graph((0, 1, 1.0, 0.0)), "rank 1 cannot reach rank 0"),
        (edge_graph((0, 1, 1.0, 0.0), (1, 0, 1.0, 0.0), nodes=(2,)), "rank 0 cannot reach rank 2"),
        (edge_graph((0, "", 1.0, 0.0)), "empty name"),
        (nx.MultiDiGraph([(0, 1), (1, 0)]), "multigraph"),
        ({0: [1]}, "expected a networkx.DiGraph"),
    ],
)
def test_invalid_graphs_are_rejected_with_the_cause(graph: object, message: str) -> None:
    with pytest.raises(ClusterSpecError, match=message.replace("(", r"\(")):
        Cluster.from_graph(graph)  # type: ignore[arg-type]


def test_missing_edge_attributes_are_named() -> None:
    graph = nx.DiGraph([(0, 1), (1, 0)])
    with pytest.raises(ClusterSpecError, match="link 0 -> 1 has no 'bandwidth'"):
        Cluster.from_graph(graph)


def test_zero_latency_is_allowed() -> None:
    cluster = Cluster.ring(3, latency=0)
    assert cluster.path_latency(0, 1) == 0.0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Cluster.ring(0), "positive integer"),
        (lambda: Cluster.switch(-3), "positive integer"),
        (lambda: Cluster.fully_connected(2.5), "positive integer"),
        (lambda: Cluster.ring(True), "positive integer"),
        (lambda: Cluster.two_level(0, 8), "nodes"),
        (lambda: Cluster.two_level(2, 0), "gpus_per_node"),
        (lambda: Cluster.torus(()), "non-empty"),
        (lambda: Cluster.torus((4, 0)), r"dims\[1\]"),
        (lambda: Cluster.torus("44"), "non-empty sequence"),
        (lambda: Cluster.ring(4, bidirectional="yes"), "bidirectional"),
        (lambda: Cluster.ring(4, bandwidth="0GB/s"), "zero"),
        (lambda: Cluster.switch(4, latency="-1us"), "negative"),
        (lambda: Cluster.ring(4, device=""), "device"),
        (lambda: Cluster.ring(4, device=None), "device"),
        (
            lambda: Cluster.ring(4, algorithms={"allreduce": "ring"}),
            "unknown collective 'allreduce'.*all_reduce",
        ),
        (lambda: Cluster.ring(4, algorithms={"all_reduce": "rings"}), "unknown algorithm 'rings'.*'ring'"),
        (lambda: Cluster.ring(4, algorithms=["ring"]), "algorithms must map"),
    ],
)
def test_invalid_builder_arguments_are_rejected(build: object, message: str) -> None:
    with pytest.raises(ClusterSpecError, match=message):
        build()  # type: ignore[operator]


def test_algorithms_device_and_name_are_kept() -> None:
    choice = {"all_reduce": "ring", "broadcast": "tree", "all_to_all": "direct", "reduce_scatter": "rhd"}
    cluster = Cluster.switch(4, device="A100", algorithms=choice, name="lab")
    assert cluster.algorithms == choice
    assert (cluster.device, cluster.name) == ("A100", "lab")
    assert Cluster.switch(4).algorithms == {}


def test_repr_and_describe_summarise_the_cluster() -> None:
    cluster = Cluster.two_level(2, 8, algorithms={"all_reduce": "tree"})
    assert repr(cluster) == "<Cluster 'two-level-2x8': 16 x H100, 3 switches, 64 links>"
    text = cluster.describe()
    assert "16 ranks of H100" in text
    assert "node0.nvswitch" in text and "ib" in text
    assert "rank -> node*.nvswitch: 16 x 450 GB/s, 1 us" in text
    assert "rank -> ib: 16 x 50 GB/s, 5 us" in text
    assert "all_reduce=tree" in text


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name: str) -> None:
    cluster = Cluster.preset(name)
    assert cluster.name == name
    assert cluster.world_size >= 4
    assert_route_is_a_path(cluster, 0, cluster.world_size - 1)


def test_dgx_presets_model_their_hardware() -> None:
    h100 = Cluster.preset("dgx-h100", nodes=2)
    assert (h100.world_size, h100.device) == (16, "H100")
    assert h100.path_bandwidth(0, 7) == 450e9
    assert h100.path_bandwidth(0, 8) == 50e9  # 400 Gb/s ConnectX-7 per GPU
    a100 = Cluster.preset("dgx-a100", world_size=24)
    assert (a100.world_size, a100.device) == (24, "A100")
    assert a100.path_bandwidth(0, 7) == 300e9
    assert a100.path_bandwidth(0, 23) == 25e9  # 200 Gb/s HDR per GPU
    assert Cluster.preset("cpu-ethernet").device == "cpu"
    assert Cluster.preset("cpu-ethernet").path_bandwidth(0, 1) == 1.25e9


def test_ranks_per_node_use_the_first_gpus_of_each_node() -> None:
    """As torchrun --nproc-per-node 3 on two 8-GPU nodes: 6 ranks, three per node, the rest of each node idle."""
    cluster = Cluster.two_level(2, 8, ranks_per_node=3)
    assert (cluster.world_size, cluster.ranks_per_node, cluster.gpus_per_node) == (6, 3, 8)
    assert cluster.path_bandwidth(0, 2) == 450e9 and cluster.path_bandwidth(2, 3) == 50e9  # NVLink; IB to node 1
    assert Cluster.preset("dgx-h100", world_size=6, ranks_per_node=3).world_size == 6
    partial = Cluster.preset("dgx-h100", world_size=3)  # smaller than a node: part of one
    assert (partial.world_size, partial.ranks_per_node, partial.gpus_per_node, partial.name) == (3, 3, 8, "dgx-h100")


@pytest.mark.parametrize(
    ("name", "world_size", "shape"),
    [("ring", 5, 10), ("switch", 3, 6), ("cpu-ethernet", 16, 32), ("dgx-h100", 32, 128), ("torus", 12, 48)],
)
def test_world_size_sizes_parametric_presets(name: str, world_size: int, shape: int) -> None:
    cluster = load_cluster(name, world_size)
    assert cluster.world_size == world_size
    assert len(cluster.links) == shape


def test_torus_preset_is_as_square_as_the_world_size_allows() -> None:
    assert load_cluster("torus", 12).name == "torus"
    assert hops(load_cluster("torus", 12), 0, 8) == 1  # 3 x 4: (0,0) -> (2,0) wraps; 2 x 6 would take 3
    assert load_cluster("torus", 7).world_size == 7


def test_preset_names_are_forgiving_about_case_and_underscores() -> None:
    assert Cluster.preset("DGX_H100").world_size == 8


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Cluster.preset("dgx-h10"), "unknown cluster preset 'dgx-h10'.*Did you mean 'dgx-h100'"),
        (lambda: load_cluster("rign"), "known presets: .*Did you mean 'ring'"),
        (lambda: load_cluster("dgx-h100", 12), r"not a multiple of the ranks per node \(8, of gpus_per_node=8\)"),
        (lambda: Cluster.two_level(1, 8, ranks_per_node=9), "ranks_per_node 9 is more than the node's gpus_per_node 8"),
        (lambda: Cluster.preset("dgx-h100", world_size=6, ranks_per_node=4), r"world size 6 is not a multiple of the ranks per node \(4"),
        (lambda: Cluster.preset("dgx-h100", node=2), "unknown key 'node'.*Did you mean 'nodes'"),
        (lambda: build_preset("ring", world_size=5, n=4), "describes 4 ranks but a world size of 5"),
        (lambda: load_cluster("ring", 0), "world_size must be a positive integer"),
        (lambda: load_cluster(""), "preset name"),
    ],
)
def test_bad_preset_requests_are_rejected(call: object, message: str) -> None:
    with pytest.raises(ClusterSpecError, match=message):
        call()  # type: ignore[operator]


def test_preset_names_lists_them_all() -> None:
    assert preset_names() == sorted(PRESETS)
    assert {"dgx-h100", "dgx-a100", "ring", "switch", "torus", "cpu-ethernet"} <= set(preset_names())


# --------------------------------------------------------------------------- config files


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_builder_config_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "cluster.toml",
        """
        [cluster]
        builder = "two_level"
        nodes = 2
        gpus_per_node = 4
        inter_bandwidth = "200Gb/s"
        device = "A100"
        name = "lab"

        [cluster.algorithms]
        all_reduce = "ring"
        """,
    )
    cluster = load_cluster(str(path), world_size=8)
    assert (cluster.world_size, cluster.device, cluster.name) == (8, "A100", "lab")
    assert cluster.algorithms == {"all_reduce": "ring"}
    assert cluster.path_bandwidth(0, 4) == 25e9
    assert Cluster.from_file(path).links == cluster.links


def test_preset_config_file_is_sized_by_the_world_size(tmp_path: Path) -> None:
    path = write(tmp_path, "dgx.toml", '[cluster]\npreset = "dgx-h100"\ninter_latency = "3us"\n')
    cluster = load_cluster(str(path), world_size=16)
    assert cluster.world_size == 16
    assert cluster.path_latency(0, 8) == pytest.approx(6e-6)
    assert load_cluster(str(path)).world_size == 8


def test_links_config_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "custom.toml",
        """
        [cluster]
        world_size = 3
        device = "cpu"

        [[links]]
        src = 0
        dst = "sw"
        bandwidth = "1GB/s"
        latency = "10us"
        duplex = true

        [[links]]
        src = 1
        dst = "sw"
        bandwidth = "1GB/s"
        latency = "10us"
        duplex = true

        [[links]]
        src = 2
        dst = 1
        bandwidth = "2GB/s"
        latency = "1us"
        duplex = true
        """,
    )
    cluster = load_cluster(str(path))
    assert cluster.world_size == 3 and cluster.switches == ("sw",)
    assert len(cluster.links) == 6
    assert route_vertices(cluster, 2, 0) == [2, 1, "sw", 0]
    assert cluster.path_bandwidth(2, 0) == 1e9


def test_json_config_file(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    path.write_text(json.dumps({"cluster": {"builder": "ring", "n": 4, "bandwidth": "10GB/s"}}))
    assert load_cluster(str(path)).path_bandwidth(0, 2) == 10e9


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_saved_clusters_load_back_identically(tmp_path: Path, suffix: str) -> None:
    original = Cluster.two_level(
        2, 2, "300GB/s", "0.7us", "25GB/s", "3.3us", device="A100", algorithms={"barrier": "tree"}
    )
    path = tmp_path / f"saved{suffix}"
    save_cluster(original, path)
    loaded = load_cluster(str(path))
    assert loaded.links == original.links
    assert (loaded.name, loaded.device, loaded.algorithms) == (
        original.name,
        original.device,
        original.algorithms,
    )
    assert all_routes(loaded) == all_routes(original)


@given(random_clusters())
def test_config_round_trip_preserves_any_graph(cluster: Cluster) -> None:
    config = cluster.to_config()
    assert cluster_from_config(config).links == cluster.links
    assert cluster_from_config(tomllib.loads(config_to_toml(config))).links == cluster.links


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[cluster]\nbuilder = "mesh"\n', "unknown builder 'mesh'"),
        ('[cluster]\nbuilder = "rign"\nn = 2\n', "Did you mean 'ring'"),
        ('[cluster]\nbuilder = "ring"\n', "builder 'ring' needs 'n'; give it, or a world_size"),
        ('[cluster]\nbuilder = "ring"\nn = 4\nbandwith = "1GB/s"\n', "unknown key 'bandwith'.*'bandwidth'"),
        ('[cluster]\npreset = "ring"\nbuilder = "ring"\n', "exactly one of"),
        ("[cluster]\ndevice = 'cpu'\n", "exactly one of"),
        ("[other]\nx = 1\n", "unknown key 'other'"),
        ('[cluster]\npreset = "dgx-h100"\nnodes = 1\n', "describes 8 ranks but a world size of 16"),
        ('[cluster]\npreset = "ring"\nworld_size = 4\n', "world_size = 4 in the file but a world size of 16"),
        (
            '[cluster]\ndevice = "cpu"\n[[links]]\nsrc = 0\ndst = 1\nbandwidth = 1\nlatency = 0\n',
            "needs world_size",
        ),
        (
            "[cluster]\nworld_size = 2\n[[links]]\nsrc = 0\ndst = 5\nbandwidth = 1\nlatency = 0\n",
            "rank 5 is outside",
        ),
        ("[cluster]\nworld_size = 2\n[[links]]\nsrc = 0\ndst = 1\nbandwidth = 1\n", "lacks latency"),
        (
            (
                "[cluster]\nworld_size = 2\n[[links]]\nsrc = 0\ndst = 1\nbandwidth = 1\nlatency = 0\nduplex = true\n"
                "[[links]]\nsrc = 1\ndst = 0\nbandwidth = 1\nlatency = 0\n"
            ),
            "declared twice",
        ),
        (
            "[cluster]\nworld_size = 2\n[[links]]\nsrc = 0\ndst = 1\nbandwidth = 1\nlatency = 0\n",
            "cannot reach",
        ),
        (
            '[cluster]\nworld_size = 2\n[[links]]\nsrc = 0\ndst = 1\nbandwidth = "x"\nlatency = 0\nduplex = true\n',
            "'x'",
        ),
        (
            '[cluster]\npreset = "dgx-h100"\n[cluster.algorithms]\nall_reduce = "fastest"\n',
            "unknown algorithm",
        ),
        ("[cluster\n", "not valid TOML"),
    ],
)
def test_bad_config_files_are_rejected(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(ClusterSpecError, match=message) as info:
        load_cluster(str(path), world_size=16 if "16" in message else None)
    assert str(path) in str(info.value)  # the error names the file


def test_missing_and_unsupported_files_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ClusterSpecError, match="does not exist"):
        load_cluster(str(tmp_path / "nope.toml"))
    odd = write(tmp_path, "cluster.yaml", "cluster: {}\n")
    with pytest.raises(ClusterSpecError, match=r"\.toml or \.json"):
        load_cluster(str(odd))
    with pytest.raises(ClusterSpecError, match="not valid JSON"):
        load_cluster(str(write(tmp_path, "bad.json", "{")))
    with pytest.raises(ClusterSpecError, match=r"\.toml or \.json"):
        save_cluster(Cluster.ring(2), tmp_path / "out.yaml")

