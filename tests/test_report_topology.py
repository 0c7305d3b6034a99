"""The topology picture in a run report's header: every rank, switch and link accounted for exactly once, layers
by hop distance from the ranks, grouping at scale, a bounded size at 1,024 ranks, escaped names."""

from __future__ import annotations

import re
from collections import Counter

import networkx as nx
from hypothesis import given
from hypothesis import strategies as st

import simdist
from simdist.report import render_run_report
from simdist.report.topology import MAX_PER_LAYER, MAX_RANK_BOXES, Picture, topology_picture


def fat_tree(leaves: int, per_leaf: int, spines: int) -> simdist.Cluster:
    """Ranks under leaf switches, every leaf linked to every spine (full-duplex cables)."""
    g = nx.Graph()
    for leaf in range(leaves):
        for i in range(per_leaf):
            g.add_edge(leaf * per_leaf + i, f"leaf{leaf}", bandwidth="50GB/s", latency="1us")
        for s in range(spines):
            g.add_edge(f"leaf{leaf}", f"spine{s}", bandwidth="100GB/s", latency="2us")
    return simdist.Cluster.from_graph(g, name="fat-tree")


def check_accounts_for_everything(cluster: simdist.Cluster, pic: Picture) -> None:
    """Every rank and switch in exactly one box; every directed link drawn or inside a box, exactly once."""
    assert sorted(r for b in pic.boxes for r in b.ranks) == list(range(cluster.world_size))
    assert Counter(s for b in pic.boxes for s in b.switches) == Counter(cluster.switches)
    drawn = sum(ln.count for ln in pic.lines) + sum(sum(b.inside.values()) for b in pic.boxes)
    assert drawn == len(cluster.links)
    # per link class too: a line's count is the number of links of its bandwidth between its boxes' members
    box_of = {v: i for i, b in enumerate(pic.boxes) for v in [*b.ranks, *b.switches]}
    between = Counter(
        (min(box_of[l.src], box_of[l.dst]), max(box_of[l.src], box_of[l.dst]), l.bandwidth, l.latency)
        for l in cluster.links
        if box_of[l.src] != box_of[l.dst]
    )
    assert between == Counter({(ln.a, ln.b, ln.bandwidth, ln.latency): ln.count for ln in pic.lines})
    for layer in {b.layer for b in pic.boxes}:
        assert sum(b.layer == layer for b in pic.boxes) <= MAX_PER_LAYER
    assert all(b.layer == 0 for b in pic.boxes if b.ranks)


clusters = st.one_of(
    st.integers(2, 200).map(lambda n: simdist.Cluster.ring(n)),
    st.integers(1, 300).map(lambda n: simdist.Cluster.switch(n)),
    st.integers(2, 24).map(lambda n: simdist.Cluster.fully_connected(n)),
    st.tuples(st.integers(1, 40), st.integers(1, 8)).map(lambda t: simdist.Cluster.two_level(t[0], t[1])),
    st.tuples(st.integers(2, 9), st.integers(2, 9)).map(lambda d: simdist.Cluster.torus(d)),
    st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(1, 4)).map(lambda t: fat_tree(*t)),
)


@given(clusters)
def test_every_rank_switch_and_link_is_drawn_exactly_once(cluster: simdist.Cluster) -> None:
    check_accounts_for_everything(cluster, topology_picture(cluster))


def test_a_small_cluster_draws_each_rank_and_each_link_class_between_them() -> None:
    cluster = simdist.Cluster.preset("dgx-h100", world_size=16)
    pic = topology_picture(cluster)
    assert [b.label for b in pic.boxes if b.kind == "rank"] == [str(r) for r in range(16)]
    assert sorted(b.label for b in pic.boxes if b.kind == "switch") == ["ib", "node0.nvswitch", "node1.nvswitch"]
    # one line per rank to its NVSwitch and one to ib, each standing for the two directions of a cable
    assert len(pic.lines) == 32 and {ln.count for ln in pic.lines} == {2}
    nvlink = [ln for ln in pic.lines if ln.bandwidth == 450e9]
    assert len(nvlink) == 16 and len({ln.colour for ln in nvlink}) == 1
    assert {ln.colour for ln in pic.lines} == {c for c, _ in pic.legend}
    assert [t for _, t in pic.legend] == ["450 GB/s (32 directed links)", "50 GB/s (32 directed links)"]
    assert "1 us" in nvlink[0].title and "2 directed links" in nvlink[0].title
    # each switch sits above its ranks: node0's NVSwitch left of ib, node1's right of it
    x = {b.label: b.x for b in pic.boxes}
    assert x["node0.nvswitch"] < x["ib"] < x["node1.nvswitch"]
    assert not pic.caption


def test_switches_sit_in_layers_by_hops_from_the_ranks() -> None:
    cluster = fat_tree(4, 4, 2)
    pic = topology_picture(cluster)
    layer = {b.switches[0]: b.layer for b in pic.boxes if b.kind == "switch"}
    assert layer == {**{f"leaf{i}": 1 for i in range(4)}, "spine0": 2, "spine1": 2}
    ys = {b.layer: b.y for b in pic.boxes}
    assert ys[0] > ys[1] > ys[2]  # ranks at the bottom


def test_large_clusters_group_ranks_by_node_and_fold_the_middle() -> None:
    cluster = simdist.Cluster.preset("dgx-h100", world_size=1024)
    pic = topology_picture(cluster)
    check_accounts_for_everything(cluster, pic)
    groups = [b for b in pic.boxes if b.kind == "ranks"]
    # a group is one node: its 8 ranks with its NVSwitch inside
    for b in groups:
        node = b.ranks[0] // 8
        assert b.ranks == list(range(node * 8, node * 8 + 8)) and b.switches == [f"node{node}.nvswitch"]
        assert b.inside == {(450e9, 1e-6): 16}
    (more,) = [b for b in pic.boxes if b.kind == "more"]
    assert more.folded == 128 - len(groups) and len(more.ranks) == 8 * more.folded
    assert [b.label for b in pic.boxes if b.kind == "switch"] == ["ib"]
    assert len(pic.boxes) == MAX_PER_LAYER + 1
    text = " ".join(pic.caption)
    assert "128 groups of at most 8 consecutive ranks" in text and f"+{more.folded}" in text


def test_a_ring_of_1024_ranks_is_cut_into_groups_joined_by_arcs() -> None:
    cluster = simdist.Cluster.ring(1024)
    pic = topology_picture(cluster)
    assert len(pic.boxes) == MAX_PER_LAYER and len(pic.boxes) < 1024
    # neighbouring groups and the wrap-around: one line each, one cable (two directed links) apiece
    assert len(pic.lines) == MAX_PER_LAYER and {ln.count for ln in pic.lines} == {2}
    assert all(" Q" in ln.path for ln in pic.lines)  # arcs, so they clear the boxes between
    assert cluster.world_size > MAX_RANK_BOXES


def test_the_1024_rank_picture_is_small_and_names_are_escaped() -> None:
    cluster = simdist.Cluster.preset("dgx-h100", world_size=1024)
    page = render_run_report(None, error=RuntimeError("stopped"), cluster=cluster)
    svg = re.search(r'<figure class="topology".*?</figure>', page, re.DOTALL).group(0)
    assert len(svg.encode()) < 40_000
    assert svg.count("<rect") == MAX_PER_LAYER + 1
    hostile = nx.Graph()
    for r in range(4):
        hostile.add_edge(r, "<script>alert(1)</script>", bandwidth="10GB/s", latency="1us")
    page = render_run_report(None, error=RuntimeError("stopped"), cluster=simdist.Cluster.from_graph(hostile))
    svg = re.search(r'<figure class="topology".*?</figure>', page, re.DOTALL).group(0)
    assert "<script>alert" not in svg and "&lt;script&gt;alert(1" in svg
