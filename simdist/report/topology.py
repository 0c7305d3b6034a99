"""A picture of a cluster's topology for the run report: boxes for ranks (grouped at scale) and switches, laid
out in layers by hop distance from the ranks, joined by one line per link class (geometry in SVG pixels).

Every link of the cluster is accounted for exactly once: either drawn (a line stands for all the directed links
of one bandwidth and latency between two boxes, counted in its tooltip) or inside a box (links between ranks of
one group, or to a switch drawn inside that group). Every rank and every switch belongs to exactly one box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx

from simdist.network.cluster import Cluster
from simdist.ranks import ranges
from simdist.units import format_bandwidth, format_time

#: clusters up to this many ranks draw one box per rank; larger ones draw groups of consecutive ranks
MAX_RANK_BOXES = 32
#: boxes in one layer; a layer with more shows its first and last ones and folds the middle into one box
MAX_PER_LAYER = 16
#: line colours by bandwidth, fastest first (Okabe-Ito); more classes than colours reuse them in order
LINK_COLOURS = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9", "#999933", "#882255")

#: geometry (pixels): box height, gap between boxes, distance between layers, margins, character width
BOX_H, GAP, ROW, MARGIN, CHAR_W = 22.0, 8.0, 90.0, 12.0, 6.2
#: longest label drawn in a box; the whole name is in the box's tooltip
MAX_LABEL = 16
#: the largest bulge of a line between two boxes of one layer (drawn as an arc so it clears the boxes between)
MAX_ARC = 44.0

Vertex = int | str


@dataclass
class Box:
    """Ranks and switches drawn as one box: kind is "rank", "ranks" (a group), "switch" or "more" (folded)."""

    kind: str
    ranks: list[int]
    switches: list[str]
    layer: int
    label: str = ""
    title: str = ""
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0
    #: how many groups or switches a "more" box stands for
    folded: int = 0
    #: links with both ends in this box: (bandwidth bytes/s, latency s) -> directed links
    inside: dict[tuple[float, float], int] = field(default_factory=dict)


@dataclass
class Line:
    """All directed links of one (bandwidth, latency) between two boxes, drawn as one SVG path."""

    a: int
    b: int
    bandwidth: float
    latency: float
    count: int
    path: str = ""
    colour: str = ""
    width: float = 1.0
    title: str = ""


@dataclass
class Picture:
    """A cluster's drawing: boxes, lines, the bandwidth legend (colour, text) and the caption's sentences."""

    width: float
    height: float
    boxes: list[Box]
    lines: list[Line]
    legend: list[tuple[str, str]]
    caption: list[str]


def layers(cluster: Cluster) -> dict[Vertex, int]:
    """Hops from the nearest rank of every vertex (ranks 0; a switch no rank reaches goes one layer past the last)."""
    hops = nx.multi_source_dijkstra_path_length(
        cluster.graph.to_undirected(as_view=True), set(range(cluster.world_size)), weight=lambda u, v, d: 1
    )
    last = max(hops.values(), default=0)
    return {v: int(hops.get(v, last + 1)) for v in cluster.graph.nodes}


def rank_groups(cluster: Cluster, neighbours: dict[Vertex, set[Vertex]]) -> list[list[int]]:
    """Ranks drawn together: one each up to :data:`MAX_RANK_BOXES`, else runs of consecutive ranks with the same
    switches (a node, a leaf switch's ranks), cut so that no group exceeds 1/:data:`MAX_PER_LAYER` of the world."""
    n = cluster.world_size
    if n <= MAX_RANK_BOXES:
        return [[r] for r in range(n)]
    limit = math.ceil(n / MAX_PER_LAYER)
    groups: list[list[int]] = []
    last_key: tuple[str, ...] | None = None
    for r in range(n):
        key = tuple(sorted(str(v) for v in neighbours[r] if isinstance(v, str)))
        if key != last_key or len(groups[-1]) >= limit:
            groups.append([])
        groups[-1].append(r)
        last_key = key
    return groups


def _centre(linked: set[Vertex], position: dict[Vertex, float], index: int) -> tuple[float, int]:
    """Sort key of a switch: the mean position of the placed vertices it links to, then its cluster order."""
    below = [position[v] for v in linked if v in position]
    return (sum(below) / len(below) if below else math.inf, index)


def _fold(items: list[Box], what: str) -> tuple[list[Box], str]:
    """``items`` with the middle ones merged into one "more" box when there are more than :data:`MAX_PER_LAYER`,
    and a sentence saying so ("" when nothing was folded)."""
    if len(items) <= MAX_PER_LAYER:
        return items, ""
    head = MAX_PER_LAYER // 2
    tail = MAX_PER_LAYER - head - 1
    middle = items[head : len(items) - tail]
    more = Box("more", [r for b in middle for r in b.ranks], [s for b in middle for s in b.switches], items[0].layer,
               folded=len(middle))
    parts = []
    if more.ranks:
        parts.append(f"ranks {ranges(more.ranks)}")
    if more.switches:
        parts.append(f"{len(more.switches)} switches ({more.switches[0]} ... {more.switches[-1]})")
    sentence = (
        f"Of {len(items)} {what}, the first {head} and the last {tail} are drawn; the box '+{len(middle)}' "
        f"stands for the {len(middle)} between them: {' and '.join(parts)}."
    )
    return items[:head] + [more] + items[len(items) - tail :], sentence


def _describe(box: Box) -> None:
    """Fill ``box``'s label and tooltip."""
    if box.kind == "rank":
        box.label, box.title = str(box.ranks[0]), f"rank {box.ranks[0]}"
    elif box.kind == "switch":
        box.label, box.title = box.switches[0], f"switch {box.switches[0]}"
    else:
        what = []
        if box.ranks:
            what.append(f"ranks {ranges(box.ranks)} ({len(box.ranks)} ranks)")
        if box.switches:
            shown = ", ".join(box.switches[:4]) + (f", ... ({len(box.switches)} in all)" if len(box.switches) > 4 else "")
            what.append(f"switch{'es' if len(box.switches) > 1 else ''} {shown}")
        box.title = "; ".join(what)
        box.label = ranges(box.ranks) if box.kind == "ranks" else f"+{box.folded}"
    for (bandwidth, latency), count in sorted(box.inside.items(), key=lambda kv: -kv[0][0]):
        box.title += f"\ninside: {count} directed links of {format_bandwidth(bandwidth)}, {format_time(latency)}"
    if len(box.label) > MAX_LABEL:
        box.label = box.label[: MAX_LABEL - 3] + "..."


def topology_picture(cluster: Cluster) -> Picture:
    """The drawing of ``cluster``: ranks at the bottom, each switch layer above the one nearer the ranks."""
    n = cluster.world_size
    neighbours: dict[Vertex, set[Vertex]] = {v: set() for v in cluster.graph.nodes}
    for link in cluster.links:
        neighbours[link.src].add(link.dst)
        neighbours[link.dst].add(link.src)
    hops = layers(cluster)
    groups = rank_groups(cluster, neighbours)
    grouped = len(groups) < n
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    boxes_of_layer: dict[int, list[Box]] = {0: [Box("ranks" if grouped else "rank", g, [], 0) for g in groups]}
    folded = 0
    for s in cluster.switches:
        owners = {group_of[v] for v in neighbours[s] if isinstance(v, int)}
        # a switch that serves the ranks of one group only (a node's NVSwitch, a leaf) is drawn inside the group
        if grouped and len(owners) == 1:
            boxes_of_layer[0][owners.pop()].switches.append(s)
            folded += 1
        else:
            boxes_of_layer.setdefault(hops[s], []).append(Box("switch", [], [s], hops[s]))
    caption = []
    if grouped:
        caption.append(
            f"{n} ranks drawn as {len(groups)} groups of at most {max(len(g) for g in groups)} consecutive ranks "
            f"(a group never mixes ranks attached to different switches)"
            + (f"; the {folded} switches that serve one group only are drawn inside it" if folded else "")
            + ". Hover a box or a line for its ranks, switches and links."
        )
    # layers numbered from 0 without gaps (folding can empty one), ranks at the bottom
    order = sorted(boxes_of_layer)
    position: dict[Vertex, float] = {}
    boxes: list[Box] = []
    rows: list[list[Box]] = []
    switch_index = {name: i for i, name in enumerate(cluster.switches)}
    for layer_index, layer in enumerate(order):
        items = boxes_of_layer[layer]
        if layer_index > 0:
            # each switch sits above the mean position of the vertices it links to below, so lines rarely cross
            items = sorted(items, key=lambda b: _centre(neighbours[b.switches[0]], position, switch_index[b.switches[0]]))
        items, sentence = _fold(items, "rank groups" if layer_index == 0 else f"switches {layer_index} hop(s) from the ranks")
        if sentence:
            caption.append(sentence)
        for i, b in enumerate(items):
            b.layer = layer_index
            for v in [*b.ranks, *b.switches]:
                position[v] = i
        rows.append(items)
        boxes.extend(items)
    box_of: dict[Vertex, int] = {v: i for i, b in enumerate(boxes) for v in [*b.ranks, *b.switches]}
    merged: dict[tuple[int, int, float, float], int] = {}
    for link in cluster.links:
        a, b = box_of[link.src], box_of[link.dst]
        if a == b:
            boxes[a].inside[(link.bandwidth, link.latency)] = boxes[a].inside.get((link.bandwidth, link.latency), 0) + 1
        else:
            key = (min(a, b), max(a, b), link.bandwidth, link.latency)
            merged[key] = merged.get(key, 0) + 1
    for b in boxes:
        _describe(b)
    same_layer = {boxes[a].layer for a, b, _, _ in merged if boxes[a].layer == boxes[b].layer}
    # room for arcs between boxes of one layer: below the ranks, above the switches
    below = MAX_ARC if 0 in same_layer else 0.0
    above = MAX_ARC if same_layer - {0} else 0.0
    _place(rows, above)
    lines = [Line(a, b, bw, lat, count) for (a, b, bw, lat), count in merged.items()]
    legend = _style(lines, boxes)
    width = max((b.x + b.w for b in boxes), default=0.0) + MARGIN
    height = max((b.y for b in boxes), default=0.0) + BOX_H + MARGIN + below
    return Picture(width, height, boxes, lines, legend, caption)


def _place(rows: list[list[Box]], top: float) -> None:
    """Box sizes and positions: layers stacked upwards from the ranks, each layer centred, ``top`` px free above."""
    for row in rows:
        # one width per layer, so a layer reads as a row of equals
        w = max(28.0, max(len(b.label) for b in row) * CHAR_W + 10)
        for b in row:
            b.w = w
    widest = max((sum(b.w for b in row) + GAP * (len(row) - 1) for row in rows), default=0.0)
    for depth, row in enumerate(rows):
        x = MARGIN + (widest - (sum(b.w for b in row) + GAP * (len(row) - 1))) / 2
        for b in row:
            b.x, b.y = x, MARGIN + top + (len(rows) - 1 - depth) * ROW
            x += b.w + GAP


def _style(lines: list[Line], boxes: list[Box]) -> list[tuple[str, str]]:
    """Colour, width, path and tooltip of every line; returns the legend, fastest bandwidth first."""
    speeds = sorted({ln.bandwidth for ln in lines} | {bw for b in boxes for bw, _ in b.inside}, reverse=True)
    colour = {bw: LINK_COLOURS[i % len(LINK_COLOURS)] for i, bw in enumerate(speeds)}
    fast, slow = (math.log(speeds[0]), math.log(speeds[-1])) if speeds else (0.0, 0.0)
    counts: dict[float, int] = {}
    for b in boxes:
        for (bw, _), c in b.inside.items():
            counts[bw] = counts.get(bw, 0) + c
    inside = dict(counts)
    pair_index: dict[tuple[int, int], int] = {}
    for ln in sorted(lines, key=lambda ln: (ln.a, ln.b, -ln.bandwidth, ln.latency)):
        counts[ln.bandwidth] = counts.get(ln.bandwidth, 0) + ln.count
        a, b = boxes[ln.a], boxes[ln.b]
        ln.colour = colour[ln.bandwidth]
        ln.width = 1.0 + (2.0 * (math.log(ln.bandwidth) - slow) / (fast - slow) if fast > slow else 1.0)
        # a second class between the same two boxes is drawn beside the first, not over it
        k = pair_index[(ln.a, ln.b)] = pair_index.get((ln.a, ln.b), -1) + 1
        shift = 4.0 * k
        ax, bx = a.x + a.w / 2 + shift, b.x + b.w / 2 + shift
        if a.layer == b.layer:
            bulge = min(MAX_ARC, 10 + abs(bx - ax) / 4)
            sign = 1 if a.layer == 0 else -1
            y = a.y + BOX_H if sign > 0 else a.y
            ln.path = f"M{ax:.1f},{y:.1f} Q{(ax + bx) / 2:.1f},{y + sign * 2 * bulge:.1f} {bx:.1f},{y:.1f}"
        else:
            low, high = (a, b) if a.layer < b.layer else (b, a)
            lx, hx = (ax, bx) if low is a else (bx, ax)
            ln.path = f"M{lx:.1f},{low.y:.1f} L{hx:.1f},{high.y + BOX_H:.1f}"
        ln.title = (
            f"{_name(a)} - {_name(b)}: {ln.count} directed link{'s' if ln.count != 1 else ''} of "
            f"{format_bandwidth(ln.bandwidth)}, {format_time(ln.latency)} each"
        )
    return [
        (colour[bw], f"{format_bandwidth(bw)} ({counts.get(bw, 0)} directed links"
         + (f", {inside[bw]} inside boxes)" if inside.get(bw) else ")"))
        for bw in speeds
    ]


def _name(box: Box) -> str:
    """A box as the endpoint of a line in a tooltip."""
    if box.kind == "rank":
        return f"rank {box.ranks[0]}"
    if box.kind == "switch":
        return box.switches[0]
    return f"ranks {ranges(box.ranks)}" if box.ranks else f"{len(box.switches)} switches"
