"""The record of a simulated run: compute spans, collectives and messages, in simulated seconds.

Exported as Chrome/Perfetto trace JSON (``pid`` = rank, one ``tid`` per stream, flow events for messages,
counter tracks such as live memory, argument names as torch's profiler writes them). :meth:`Trace.hash` is a digest of every recorded event, so
two runs with the same (program, cluster, seed, options) have the same hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simdist.errors import RunArgumentError
from simdist.options import TRACE_LEVELS

#: the stream of a rank's device work (CUDA's default stream)
COMPUTE = "compute"
#: streams whose spans are device work: the compute stream and the rank's side streams (``compute:stream<n>``)
_SIDE_PREFIX = "compute:stream"
#: annotation streams: NVTX ranges on the host's timeline, and the same ranges projected onto the device (from
#: where the stream was at ``range_push`` to where it was at ``range_pop``, as Nsight Systems projects them)
NVTX = "nvtx"
NVTX_DEVICE = "nvtx:device"
#: each kind of stream, as the Chrome trace's category names it (torch's profiler's ``user_annotation`` for
#: ranges)
KERNEL, COMM, ANNOTATION = "kernel", "comm", "user_annotation"


def side_stream_name(stream: int) -> str:
    """The trace's name for a rank's side stream number ``stream`` (``torch.cuda.Stream``)."""
    return f"{_SIDE_PREFIX}{stream}"


def stream_kind(stream: str) -> str:
    """What runs on ``stream``: device work (:data:`KERNEL`), communication (:data:`COMM`), or annotations."""
    if stream == COMPUTE or stream.startswith(_SIDE_PREFIX):
        return KERNEL
    if stream in (NVTX, NVTX_DEVICE):
        return ANNOTATION
    return COMM


@dataclass
class Span:
    """One interval on one rank's stream (seconds)."""

    rank: int
    stream: str
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """Length of the span in seconds."""
        return self.end - self.start


@dataclass
class Message:
    """One point-to-point transfer between global ranks (seconds, bytes)."""

    src: int
    dst: int
    src_stream: str
    dst_stream: str
    start: float
    end: float
    nbytes: int
    name: str


@dataclass
class Counter:
    """The values of one rank's counter track from ``time`` (seconds) on, e.g. live bytes per category."""

    rank: int
    name: str
    time: float
    values: dict[str, float]


class Trace:
    """Spans, messages and counter samples of one run."""

    def __init__(self, level: str = "messages") -> None:
        if level not in TRACE_LEVELS:
            raise RunArgumentError(f"trace level must be one of {TRACE_LEVELS}, got {level!r}")
        self.level = level
        # compute spans are by far the most numerous: they are kept as plain tuples until first read
        self._items: list[Span | tuple] = []
        self.messages: list[Message] = []
        self.counters: list[Counter] = []

    @property
    def record_messages(self) -> bool:
        """Whether individual messages are recorded."""
        return self.level == "messages"

    @property
    def spans(self) -> list[Span]:
        """Every recorded span, in recording order."""
        items = self._items
        for i, it in enumerate(items):
            if type(it) is tuple:
                items[i] = Span(it[0], "compute", it[1], it[2], it[3])
        return items  # type: ignore[return-value]

    def span(self, rank: int, stream: str, name: str, start: float, end: float, args: dict | None = None) -> None:
        """Record an interval on ``rank``'s ``stream``."""
        self._items.append(Span(rank, stream, name, start, end, args or {}))

    def add(self, span: Span) -> None:
        """Record a span."""
        self._items.append(span)

    def compute(self, rank: int, name: str, start: float, end: float) -> None:
        """Record a compute span on ``rank`` (cheap: called for every charged op)."""
        self._items.append((rank, name, start, end))

    def message(self, msg: Message) -> None:
        """Record a transfer."""
        self.messages.append(msg)

    def message_batch(self, msgs: Iterable[Message]) -> None:
        """Record transfers, in order (a batched schedule's group of messages)."""
        self.messages.extend(msgs)

    def counter(self, rank: int, name: str, time: float, values: dict[str, float]) -> None:
        """Record a counter sample: ``rank``'s track ``name`` reads ``values`` from ``time`` (seconds) on."""
        self.counters.append(Counter(rank, name, time, values))

    # ------------------------------------------------------------------ queries
    def busy_time(self, rank: int, stream_prefix: str) -> float:
        """Seconds of spans on ``rank`` whose stream name starts with ``stream_prefix`` (overlaps counted once)."""
        ivs = sorted((s.start, s.end) for s in self.spans if s.rank == rank and s.stream.startswith(stream_prefix))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in ivs:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    def collectives(self, rank: int | None = None) -> list[Span]:
        """Collective spans (on communication streams), optionally of one rank."""
        return [s for s in self.spans if stream_kind(s.stream) == COMM and (rank is None or s.rank == rank)]

    # ------------------------------------------------------------------ identity
    def hash(self) -> str:
        """SHA-256 of every event, stable across processes and ``PYTHONHASHSEED``."""
        h = hashlib.sha256()
        for s in self.spans:
            h.update(repr((s.rank, s.stream, s.name, s.start, s.end, sorted(s.args.items()))).encode())
        for m in self.messages:
            h.update(repr((m.src, m.dst, m.src_stream, m.dst_stream, m.start, m.end, m.nbytes, m.name)).encode())
        # a run without counters hashes as it did before counters existed
        for c in self.counters:
            h.update(repr((c.rank, c.name, c.time, sorted(c.values.items()))).encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ export
    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace-event JSON object (timestamps in microseconds)."""
        tids: dict[tuple[int, str], int] = {}
        per_rank: dict[int, int] = {}
        events: list[dict[str, Any]] = []

        def tid(rank: int, stream: str) -> int:
            key = (rank, stream)
            if key not in tids:
                if stream == "compute":
                    tids[key] = 0
                else:
                    tids[key] = per_rank[rank] = per_rank.get(rank, 0) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[key], "args": {"name": stream}})
            return tids[key]

        ranks = sorted(
            {s.rank for s in self.spans}
            | {m.src for m in self.messages}
            | {m.dst for m in self.messages}
            | {c.rank for c in self.counters}
        )
        for r in ranks:
            events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": stream_kind(s.stream),
                    "pid": s.rank,
                    "tid": tid(s.rank, s.stream),
                    "ts": s.start * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": s.args,
                }
            )
        for i, m in enumerate(self.messages):
            common = {"name": m.name, "cat": "message", "id": i}
            src_tid, dst_tid = tid(m.src, m.src_stream), tid(m.dst, m.dst_stream)
            events.append({**common, "ph": "s", "pid": m.src, "tid": src_tid, "ts": m.start * 1e6})
            events.append({**common, "ph": "f", "bp": "e", "pid": m.dst, "tid": dst_tid, "ts": m.end * 1e6})
        for c in self.counters:
            events.append({"ph": "C", "name": c.name, "pid": c.rank, "ts": c.time * 1e6, "args": dict(c.values)})
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def save_chrome(self, path: str | Path) -> Path:
        """Write the Chrome/Perfetto JSON to ``path`` (opens in ui.perfetto.dev or chrome://tracing)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            json.dump(self.to_chrome(), f)
        return path
