"""Where a failing run departs from the unperturbed run: its first decision that took another agent than
insertion order's, and the first event of its trace that differs from the unperturbed trace's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from simdist.trace.trace import Trace
from simdist.units import format_time

#: span arguments that name what a span did (a peer, a collective), in the order they are written
_DETAIL_ARGS = ("Collective name", "src", "dst", "peer")


def agent_name(agent: int) -> str:
    """An agent as a reader knows it: a rank, or an event scheduled before any rank ran (negative numbers)."""
    return f"rank {agent}" if agent >= 0 else f"setup event {-agent}"


@dataclass(frozen=True)
class TieDecision:
    """One decision of a run: at ``time`` (seconds) ``agents`` were tied (in insertion order) and option
    ``choice`` went first; option 0 is what the unperturbed order takes."""

    index: int
    time: float
    agents: tuple[int, ...]
    choice: int

    @property
    def went(self) -> int:
        """The agent that went first."""
        return self.agents[self.choice]

    @property
    def instead_of(self) -> int:
        """The agent insertion order would have taken."""
        return self.agents[0]

    def __str__(self) -> str:
        tied = (
            "ranks " + ", ".join(str(a) for a in self.agents)
            if all(a >= 0 for a in self.agents)
            else ", ".join(agent_name(a) for a in self.agents)
        )
        return (
            f"decision {self.index} at t={format_time(self.time)}: {tied} tied; {agent_name(self.went)} went first "
            f"instead of {agent_name(self.instead_of)}"
        )


def departures(decisions: Sequence[int], ties: Sequence[tuple[float, tuple[int, ...]]]) -> list[TieDecision]:
    """The decisions (``Observed.decisions`` with ``Observed.ties``) that took another option than option 0."""
    return [TieDecision(i, ties[i][0], ties[i][1], c) for i, c in enumerate(decisions) if c and i < len(ties)]


@dataclass(frozen=True)
class TraceEvent:
    """One event of a rank's timeline: a span on one of its streams, or a message arriving at it (seconds)."""

    rank: int
    time: float
    stream: str
    name: str
    #: what the event did beyond its name: its peer, its collective (``"src 2"``, ``"from rank 1"``)
    detail: str = ""

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"rank {self.rank} {self.name}{detail} on stream {self.stream} at t={format_time(self.time)}"


def timelines(trace: Trace) -> dict[int, list[TraceEvent]]:
    """Each rank's events in time order (recording order among events at one time): its spans, and the messages
    that arrive at it."""
    out: dict[int, list[TraceEvent]] = {}
    for s in trace.spans:
        detail = ", ".join(f"{k} {s.args[k]}" for k in _DETAIL_ARGS if k in s.args)
        out.setdefault(s.rank, []).append(TraceEvent(s.rank, s.start, s.stream, s.name, detail))
    for m in trace.messages:
        out.setdefault(m.dst, []).append(
            TraceEvent(m.dst, m.end, m.dst_stream, m.name, f"arrives from rank {m.src}")
        )
    for events in out.values():
        events.sort(key=lambda e: e.time)  # stable: recording order among equal times
    return out


@dataclass(frozen=True)
class Departure:
    """The first point where a failing run departs from the unperturbed run."""

    #: its first decision that took another option than insertion order (None: it took none; jitter or faults
    #: alone made it differ)
    decision: TieDecision | None
    #: the failing run's first event that differs from the unperturbed run's on the same rank (None where the
    #: failing run stopped before it, or the traces agree)
    event: TraceEvent | None
    #: the unperturbed run's event at that place (None where the unperturbed run had none)
    expected: TraceEvent | None

    def lines(self) -> list[str]:
        """The departure as text: the decision, then the event."""
        out = [
            f"first decision off the unperturbed order: {self.decision}"
            if self.decision is not None
            else "first decision off the unperturbed order: none (every tie went in insertion order)"
        ]
        if self.event is None and self.expected is None:
            out.append("first differing trace event: none (the traces agree)")
        elif self.event is None:
            out.append(f"first differing trace event: the failing run stopped before {self.expected}")
        else:
            out.append(f"first differing trace event: {self.event}")
            out.append(
                f"  the unperturbed run had: {self.expected}"
                if self.expected is not None
                else "  the unperturbed run had no event there"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def first_difference(failing: Trace, plain: Trace) -> tuple[TraceEvent | None, TraceEvent | None]:
    """The earliest place where two traces' per-rank timelines differ: (the failing trace's event, the plain
    trace's event); the earliest in simulated time, then the lowest rank. (None, None) when they agree."""
    a, b = timelines(failing), timelines(plain)
    best: tuple[Any, ...] | None = None
    for rank in sorted(set(a) | set(b)):
        xs, ys = a.get(rank, []), b.get(rank, [])
        for i in range(max(len(xs), len(ys))):
            x = xs[i] if i < len(xs) else None
            y = ys[i] if i < len(ys) else None
            if x != y:
                when = min(e.time for e in (x, y) if e is not None)
                if best is None or (when, rank) < best[:2]:
                    best = (when, rank, x, y)
                break
    return (None, None) if best is None else (best[2], best[3])


def departure(
    decisions: Sequence[int], ties: Sequence[tuple[float, tuple[int, ...]]], failing: Trace, plain: Trace
) -> Departure:
    """Where the run that took ``decisions`` (and left ``failing``) departs from the run that left ``plain``."""
    taken = departures(decisions, ties)
    event, expected = first_difference(failing, plain)
    return Departure(taken[0] if taken else None, event, expected)
