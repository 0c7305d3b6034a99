"""A simulated run beside a real run's timeline: each rank's operations matched by order and op, predicted
against measured time, and the real spans as timeline rows on the simulated run's time scale."""

from __future__ import annotations

import difflib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simdist.report import data
from simdist.trace.trace import Span, Trace
from simdist_base.timeline import UNOBSERVED, CommRecord, Timeline, load

#: what a row's ``note`` says when one side has no counterpart
ONLY_SIMULATED, ONLY_REAL = "only in the simulated run", "only in the real run"


@dataclass
class Pair:
    """One rank's operation in the simulated run and its counterpart in the real one (either may be missing).

    ``predicted`` is the simulated span's length, ``measured`` the real one's, issue to completion (seconds).
    """

    rank: int
    op: str
    group: str
    nbytes: int
    site: str
    sim: Span | None
    real: CommRecord | None
    note: str = ""

    @property
    def predicted(self) -> float | None:
        """Simulated seconds, or None where the simulated run has no such operation."""
        return None if self.sim is None else self.sim.duration

    @property
    def measured(self) -> float | None:
        """Measured seconds, or None where the real run has none or its completion was not observed."""
        return None if self.real is None else self.real.duration

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, or None where either is missing (or nothing was measured)."""
        p, m = self.predicted, self.measured
        return None if p is None or not m else (p - m) / m


@dataclass
class Comparison:
    """Every rank's pairs, in issue order, and what did not match, in words."""

    pairs: list[Pair]
    mismatches: list[str] = field(default_factory=list)
    clock: str = ""

    @property
    def matched(self) -> int:
        """Operations found in both runs."""
        return sum(1 for p in self.pairs if p.sim is not None and p.real is not None)

    def median_error(self) -> float | None:
        """The median of |predicted - measured| / measured over the matched operations with a measured time."""
        errors = [abs(e) for p in self.pairs if (e := p.error) is not None]
        return statistics.median(errors) if errors else None

    def summary(self) -> str:
        """One line: how many matched, the median error, and whether anything did not match."""
        median = self.median_error()
        text = f"{self.matched} operations matched"
        if median is not None:
            text += f"; median |predicted - measured| / measured {median:.0%}"
        return text + (f"; {len(self.mismatches)} mismatches" if self.mismatches else "")


def as_timeline(real: Timeline | str | Path) -> Timeline:
    """``real`` as a :class:`Timeline`: itself, or the one recorded in that directory."""
    return real if isinstance(real, Timeline) else load(real)


def compare(trace: Trace, real: Timeline, world_size: int, sites: dict[tuple[int, str, int], str] | None = None,
            p2p_sites: dict[tuple[int, str, float, float], str] | None = None) -> Comparison:  # fmt: skip
    """Match each rank's operations in ``trace`` with ``real``'s by issue order and op (an all-gather variant
    matches any all-gather), then list what has no counterpart."""
    sites, p2p_sites = sites or {}, p2p_sites or {}
    pairs: list[Pair] = []
    mismatches: list[str] = []
    extra = [r for r in real.ranks if r >= world_size]
    if extra:
        mismatches.append(f"the real run recorded ranks {_ranks(extra)}, which the simulated run of {world_size} "
                          f"ranks does not have")  # fmt: skip
    missing = [r for r in range(world_size) if r not in real.records]
    if missing:
        mismatches.append(f"no real timeline for ranks {_ranks(missing)} (their processes did not write one)")
    for rank in range(world_size):
        spans = _issued(trace, rank)
        records = real.records.get(rank)
        if records is None:
            continue
        sim_keys = [data.base_op(data.op_name(s)) for s in spans]
        real_keys = [data.base_op(r.op) for r in records]
        blocks = difflib.SequenceMatcher(None, sim_keys, real_keys, autojunk=False).get_opcodes()
        for tag, i0, i1, j0, j1 in blocks:
            if tag == "equal":
                pairs += [_pair(rank, s, r, sites, p2p_sites) for s, r in zip(spans[i0:i1], records[j0:j1])]
                continue
            pairs += [_pair(rank, s, None, sites, p2p_sites, ONLY_SIMULATED) for s in spans[i0:i1]]
            pairs += [_pair(rank, None, r, sites, p2p_sites, ONLY_REAL) for r in records[j0:j1]]
        if sim_keys != real_keys:
            mismatches.append(_difference(rank, spans, records, blocks, sites, p2p_sites))
    for p in pairs:
        if p.real is not None and p.real.completion == UNOBSERVED and not p.note:
            p.note = "its completion was not observed (never waited for)"
    return Comparison(pairs, mismatches, real.describe_clock())


def _issued(trace: Trace, rank: int) -> list[Span]:
    """``rank``'s collective and point-to-point spans in issue order (a collective's issue time is recorded;
    a send's or receive's span begins where it was issued or later)."""
    spans = trace.collectives(rank)
    return sorted(spans, key=lambda s: (s.args.get("issued", s.start), s.start))


def _site(span: Span, sites: dict, p2p_sites: dict) -> str:
    """The call site the simulated run kept for ``span``."""
    key = (span.rank, str(span.args.get("Process Group Name", "")), span.args.get("Seq", -1))
    return sites.get(key) or p2p_sites.get((span.rank, span.name, span.start, span.end), "")


def _pair(rank: int, span: Span | None, record: CommRecord | None, sites: dict, p2p_sites: dict,
          note: str = "") -> Pair:  # fmt: skip
    """A pair, its op, group, size and site taken from the simulated side where there is one."""
    if span is not None:
        group = str(span.args.get("Process Group Name", record.group if record else ""))
        return Pair(rank, data.op_name(span), group, data.span_bytes(span), _site(span, sites, p2p_sites), span,
                    record, note)  # fmt: skip
    assert record is not None
    return Pair(rank, record.op, record.group, record.nbytes, record.site, None, record, note)


def _difference(rank: int, spans: list[Span], records: list[CommRecord], blocks: list, sites: dict,
                p2p_sites: dict) -> str:  # fmt: skip
    """The first place where ``rank``'s two sequences part, in words."""
    tag, i0, i1, j0, j1 = next(b for b in blocks if b[0] != "equal")
    sim = ", ".join(
        f"{data.op_name(s)} at {_site(s, sites, p2p_sites) or 'an unknown site'}" for s in spans[i0:i1]
    )
    real = ", ".join(f"{r.op} at {r.site or 'an unknown site'}" for r in records[j0:j1])
    head = f"rank {rank}: {len(spans)} operations simulated, {len(records)} recorded; "
    if tag == "insert":
        return (
            head + f"the real run has {real} (its #{j0}) where the simulated run has none (before its #{i0})"
        )
    if tag == "delete":
        return (
            head + f"the simulated run has {sim} (its #{i0}) where the real run has none (before its #{j0})"
        )
    return head + f"the simulated run's #{i0} is {sim} where the real run's #{j0} is {real}"


def timeline_rows(payload: dict[str, Any], comparison: Comparison, colours: dict[str, str]) -> None:
    """Add each drawn rank's real operations to the timeline ``payload`` (rows "real comm" and "real p2p" under
    the rank's own rows), on the simulated run's time scale; a matched span shares its simulated call's key, so
    hovering one outlines both."""
    shown = {r for r, _ in payload["rows"]}
    drawn = [p for p in comparison.pairs if p.real is not None and p.real.end is not None and p.rank in shown]
    # each rank's real rows go right after its simulated ones: renumber the rows, then the spans and messages
    order = [(r, s) for r, s in payload["rows"]]
    for key in sorted({(p.rank, _real_stream(p.real.op)) for p in drawn if p.real is not None}):
        order.insert(max(i for i, (r, _) in enumerate(order) if r == key[0]) + 1, key)
    index = {key: i for i, key in enumerate(order)}
    moved = [index[(r, s)] for r, s in payload["rows"]]
    payload["rows"] = [[r, s] for r, s in order]
    payload["spans"] = [[moved[s[0]], *s[1:]] for s in payload["spans"]]
    payload["messages"] = [[moved[m[0]], moved[m[1]], *m[2:]] for m in payload["messages"]]
    colour_index = {c: i for i, c in enumerate(payload["colours"])}
    for p in drawn:
        rec = p.real
        assert rec is not None and rec.end is not None
        colour = data.colour_of(rec.op, colours)
        if colour not in colour_index:
            colour_index[colour] = len(payload["colours"])
            payload["colours"].append(colour)
        info: dict[str, Any] = {
            "op": f"{rec.op} (real)",
            "bytes": rec.nbytes,
            "group": rec.group,
            "site": rec.site,
        }
        if rec.peer is not None:
            info["peer"] = rec.peer
        if p.sim is not None and "Seq" in p.sim.args:  # the simulated call's key: hovering outlines both
            info["seq"] = p.sim.args["Seq"]
            info["group"] = str(p.sim.args.get("Process Group Name", rec.group))
        payload["details"].append(info)
        row = index[(p.rank, _real_stream(rec.op))]
        detail = len(payload["details"]) - 1
        payload["spans"].append([row, rec.start * 1e6, rec.end * 1e6, colour_index[colour], rec.op, detail])


def _real_stream(op: str) -> str:
    """The timeline row of a real operation: sends and receives apart from collectives, as simulated."""
    return "real p2p" if op in ("send", "recv") else "real comm"


def _ranks(ranks: list[int]) -> str:
    """``[0, 2]`` as ``"0, 2"``."""
    return ", ".join(str(r) for r in ranks)
