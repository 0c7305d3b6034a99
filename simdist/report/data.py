"""What a run report shows, computed from a run's trace: timeline rows, the collective table, the per-rank
step breakdown and memory series (times in seconds, sizes in bytes)."""

from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from simdist import algorithms
from simdist.clock.sites import TORCH_DIR
from simdist.layers import is_simulator_frame
from simdist.trace.trace import ANNOTATION, COMM, KERNEL, Span, Trace, stream_kind

#: ranks drawn one row each on the timeline; larger runs show an evenly spaced sample of this many ranks
MAX_TIMELINE_RANKS = 64

#: colour-blind-safe palette (Okabe-Ito, then Tol's muted); compute keeps the first grey-blue for every run
COMPUTE_COLOUR = "#7a8ca3"
PALETTE = (
    "#e69f00", "#56b4e9", "#009e73", "#d55e00", "#cc79a7", "#0072b2", "#f0e442",
    "#882255", "#44aa99", "#999933", "#aa4499", "#117733",
)  # fmt: skip
#: NVTX ranges' colour (Tol's pale grey-green), one for every range: their names tell them apart
ANNOTATION_COLOUR = "#bbccaa"
#: collectives that get a fixed colour, so the same op looks the same in every report
FIXED_COLOURS = {
    "all_reduce": PALETTE[0], "all_gather": PALETTE[1], "reduce_scatter": PALETTE[2], "broadcast": PALETTE[3],
    "all_to_all": PALETTE[4], "send": PALETTE[5], "recv": PALETTE[6], "reduce": PALETTE[7], "barrier": PALETTE[8],
}  # fmt: skip


def op_name(span: Span) -> str:
    """The collective or point-to-point op of a communication span (``nccl:all_reduce`` -> ``all_reduce``)."""
    return str(span.args.get("Collective name") or span.name.rpartition(":")[2])


def base_op(op: str) -> str:
    """The collective an op variant performs (``all_gather_into_tensor`` -> ``all_gather``)."""
    for base in ("all_gather", "reduce_scatter", "all_to_all"):
        if op.startswith(base):
            return base
    return op


def colour_of(op: str, taken: dict[str, str]) -> str:
    """A stable colour for ``op``: its fixed one, else the next palette entry in first-seen order."""
    if op not in taken:
        taken[op] = FIXED_COLOURS.get(base_op(op)) or PALETTE[(len(taken) + len(FIXED_COLOURS)) % len(PALETTE)]
    return taken[op]


def span_bytes(span: Span) -> int:
    """Bytes a communication span moves per rank: its input elements x element size, or its ``bytes`` arg."""
    if "bytes" in span.args:
        return int(span.args["bytes"])
    nelems = span.args.get("In msg nelems")
    dtype = getattr(torch, str(span.args.get("dtype", "")), None)
    if nelems is None or not isinstance(dtype, torch.dtype):
        return 0
    return int(nelems) * torch.empty((), dtype=dtype).element_size()


@dataclass
class CollectiveRow:
    """One collective call (all ranks of its group together): time from the first start to the last end."""

    op: str
    group: str
    seq: int
    ranks: int
    nbytes: int
    algorithm: str
    start: float
    time: float
    algbw: float
    busbw: float


def collective_rows(trace: Trace) -> list[CollectiveRow]:
    """One row per (group, sequence number) collective, in start order; bandwidths in bytes/s as nccl-tests."""
    calls: dict[tuple[str, int], list[Span]] = {}
    for s in trace.spans:
        if s.stream.startswith("comm") and "Seq" in s.args:
            calls.setdefault((str(s.args.get("Process Group Name", "")), int(s.args["Seq"])), []).append(s)
    rows = []
    for (group, seq), spans in calls.items():
        first = spans[0]
        op = op_name(first)
        n = int(first.args.get("Group size", len(spans)))
        start, end = min(s.start for s in spans), max(s.end for s in spans)
        nbytes = span_bytes(first)
        base = base_op(op)
        # nccl-tests' algbw divides the buffer size by the time; all-gather's buffer is the output (n inputs)
        size = nbytes * n if base == "all_gather" else nbytes
        algbw = size / (end - start) if end > start else 0.0
        # an op that is no collective of the registry (its name unmapped by base_op) shows busbw = algbw
        factor = algorithms.collective(base).bus_factor(n) if base in algorithms.COLLECTIVES else 1.0
        rows.append(
            CollectiveRow(op, group, seq, n, size, str(first.args.get("algorithm", "")), start, end - start, algbw,
                          algbw * factor)
        )
    return sorted(rows, key=lambda r: (r.start, r.group, r.seq))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds that two disjoint sorted interval lists share."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class Breakdown:
    """One rank's step: busy compute, busy communication, and communication not hidden by compute (seconds)."""

    rank: int
    compute: float
    communication: float
    exposed: float
    finish: float


def breakdowns(trace: Trace, finish_times: list[float]) -> list[Breakdown]:
    """Each rank's :class:`Breakdown` (overlapping spans on one kind of stream counted once)."""
    compute: dict[int, list] = {r: [] for r in range(len(finish_times))}
    comm: dict[int, list] = {r: [] for r in range(len(finish_times))}
    for s in trace.spans:
        kind = stream_kind(s.stream)
        if kind != ANNOTATION:
            (compute if kind == KERNEL else comm).setdefault(s.rank, []).append((s.start, s.end))
    out = []
    for r, finish in enumerate(finish_times):
        c, m = _union(compute[r]), _union(comm[r])
        out.append(Breakdown(r, _length(c), _length(m), _length(m) - _overlap(c, m), finish))
    return out


def sampled_ranks(world_size: int) -> list[int]:
    """The ranks the timeline draws: all of them up to :data:`MAX_TIMELINE_RANKS`, else an evenly spaced sample
    that keeps the first and the last rank."""
    if world_size <= MAX_TIMELINE_RANKS:
        return list(range(world_size))
    k = MAX_TIMELINE_RANKS
    return sorted({round(i * (world_size - 1) / (k - 1)) for i in range(k)})


def timeline(
    trace: Trace,
    ranks: list[int],
    colours: dict[str, str],
    sites: dict[tuple[int, str, int], str] | None = None,
    p2p_sites: dict[tuple[int, str, float, float], str] | None = None,
) -> dict[str, Any]:
    """The timeline's JSON payload: rows (rank, stream), spans as [row, start us, end us, colour index, label,
    detail index], the details, and messages between drawn rows as [src row, dst row, start us, end us].
    ``sites`` (``RunResult.call_sites``) gives each collective's call site to its details, ``p2p_sites``
    (``RunResult.p2p_sites``) each send's and receive's."""
    sites, p2p_sites = sites or {}, p2p_sites or {}
    shown = set(ranks)
    row_of: dict[tuple[int, str], int] = {}
    streams: dict[int, list[str]] = {r: [] for r in ranks}
    spans = [s for s in trace.spans if s.rank in shown]
    row_names = [_row_name(s) for s in spans]
    for s, name in zip(spans, row_names):
        if name not in streams[s.rank]:
            streams[s.rank].append(name)
    rows = []
    order = {KERNEL: 0, ANNOTATION: 1, COMM: 2}
    for r in ranks:
        # device streams first (the compute stream, then side streams), NVTX ranges by depth, then
        # communication streams by name, so every rank's rows read alike
        for stream in sorted(streams[r], key=lambda st: (order[stream_kind(st.split(" ")[0])], st != "compute", st)):
            row_of[(r, stream)] = len(rows)
            rows.append([r, stream])
    colour_list = [COMPUTE_COLOUR]
    colour_index = {COMPUTE_COLOUR: 0}
    details: list[dict[str, Any]] = []
    detail_index: dict[str, int] = {}
    out_spans = []
    for s, row in zip(spans, row_names):
        kind = stream_kind(s.stream)
        if kind == KERNEL:
            colour, label, info = COMPUTE_COLOUR, s.name, {"op": s.name}
        elif kind == ANNOTATION:
            colour, label, info = ANNOTATION_COLOUR, s.name, {"op": s.name, "range": s.stream}
        else:
            op = op_name(s)
            colour, label = colour_of(op, colours), op
            info = {"op": op, "bytes": span_bytes(s), "algorithm": s.args.get("algorithm", ""),
                    "group": s.args.get("Process Group Name", ""),
                    "site": sites.get((s.rank, str(s.args.get("Process Group Name", "")), s.args.get("Seq", -1)))
                    or p2p_sites.get((s.rank, s.name, s.start, s.end), ""),
                    "peer": s.args.get("dst", s.args.get("src", "")),
                    # the call's number on its group: the page outlines every rank's span of one collective
                    "seq": s.args.get("Seq", "")}
            info = {k: v for k, v in info.items() if v != ""}
        key = repr(sorted(info.items()))
        if key not in detail_index:
            detail_index[key] = len(details)
            details.append(info)
        if colour not in colour_index:
            colour_index[colour] = len(colour_list)
            colour_list.append(colour)
        out_spans.append([row_of[(s.rank, row)], s.start * 1e6, s.end * 1e6, colour_index[colour], label,
                          detail_index[key]])
    messages = [
        [row_of[(m.src, m.src_stream)], row_of[(m.dst, m.dst_stream)], m.start * 1e6, m.end * 1e6]
        for m in trace.messages
        if (m.src, m.src_stream) in row_of and (m.dst, m.dst_stream) in row_of
    ]
    return {"rows": rows, "spans": out_spans, "colours": colour_list, "details": details, "messages": messages}


def is_annotation(span: Span) -> bool:
    """Whether ``span`` is an NVTX range (not device work, not communication)."""
    return stream_kind(span.stream) == ANNOTATION


def _row_name(span: Span) -> str:
    """The timeline row of ``span``: its stream, or for a nested NVTX range its stream and depth (``nvtx 1``), so
    nested ranges lie under one another instead of on top."""
    depth = span.args.get("depth", 0) if stream_kind(span.stream) == ANNOTATION else 0
    return f"{span.stream} {depth}" if depth else span.stream


def memory_series(trace: Trace) -> dict[int, list[tuple[float, float]]]:
    """Each rank's live bytes over time, [(seconds, bytes)], from the run's "memory" counter track."""
    out: dict[int, list[tuple[float, float]]] = {}
    for c in trace.counters:
        if c.name == "memory":
            out.setdefault(c.rank, []).append((c.time, float(sum(c.values.values()))))
    return out


#: call sites in a message: ``path.py:LINE`` (how simdist names sites) and ``File "path", line LINE`` (tracebacks)
_SITE = re.compile(r'(?P<path>[^\s(),:\'"]+\.py):(?P<line>\d+)|File "(?P<tb_path>[^"]+)", line (?P<tb_line>\d+)')
#: torch's files are named relative to torch's parent directory in sites (``torch/distributed/...``)
_TORCH_PARENT = os.path.dirname(TORCH_DIR.rstrip(os.sep))
#: call sites listed with their code per message, and the longest code line shown (characters)
MAX_CODE_LINES = 40
MAX_CODE_CHARS = 200


def code_lines(text: str) -> list[tuple[str, str]]:
    """(``path:line``, that line's source, stripped) for each call site in ``text``, first-seen order, each once;
    sites whose file cannot be read (gone, generated code) and frames of simdist's own files are left out."""
    out: list[tuple[str, str]] = []
    seen: set[tuple[str, int]] = set()
    for m in _SITE.finditer(text):
        traceback_frame = m.group("tb_path") is not None
        path = m.group("tb_path") if traceback_frame else m.group("path")
        line = int(m.group("tb_line") if traceback_frame else m.group("line"))
        if (path, line) in seen:
            continue
        seen.add((path, line))
        if traceback_frame and is_simulator_frame(os.path.abspath(path)):  # how the rank ran, not where it failed
            continue
        file = os.path.join(_TORCH_PARENT, path) if path.startswith("torch" + os.sep) else path
        code = linecache.getline(file, line).strip()
        if code:
            out.append((f"{path}:{line}", code if len(code) <= MAX_CODE_CHARS else code[: MAX_CODE_CHARS - 3] + "..."))
            if len(out) == MAX_CODE_LINES:
                break
    return out
