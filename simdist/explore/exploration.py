"""What an exploration found: its runs, the distinct interleavings they took, and its failures."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from simdist.explore.runs import Outcome

if TYPE_CHECKING:  # shrink builds on this module
    from simdist.explore.shrink import ShrinkError, Shrunk


@dataclass
class Failure:
    """A run that failed: its error (the exception, or the failed check) and the token that replays it."""

    run: int
    kind: str
    #: the exception the run raised, the check's exception, or a :class:`CheckFailed`
    error: BaseException
    #: the replay token (JSON text): ``simdist.replay(fn, cluster, failure.replay)`` runs it again
    replay: str
    #: the hash of the run's trace (up to the failure)
    trace_hash: str
    #: the run shrunk to a minimal case (``simdist.explore.shrink.shrink_kinds`` fills it in for the first failure
    #: of each kind), or the error that says why it could not be
    shrunk: Shrunk | ShrinkError | None = None

    def __str__(self) -> str:
        return f"run {self.run}: {self.kind}: {str(self.error).splitlines()[0] if str(self.error) else ''}"


@dataclass
class Exploration:
    """The outcome of :func:`simdist.explore`."""

    strategy: str
    #: every run's outcome, by run number (an exhaustive search's cut-short runs included)
    outcomes: list[Outcome] = field(default_factory=list)
    #: the failing runs, by run number
    failures: list[Failure] = field(default_factory=list)
    #: Ctrl-C stopped the exploration: what it holds is what was found until then
    interrupted: bool = False

    @property
    def runs(self) -> int:
        """How many runs completed (cut-short exhaustive runs included)."""
        return len(self.outcomes)

    @property
    def interleavings(self) -> int:
        """How many distinct interleavings the runs took: distinct trace hashes."""
        return len({o.trace_hash for o in self.outcomes if not o.pruned})

    @property
    def pruned(self) -> int:
        """Exhaustive runs cut short: every order from their state on had been explored already."""
        return sum(o.pruned for o in self.outcomes)

    def by_kind(self) -> dict[str, list[Failure]]:
        """Failures grouped by kind, most frequent first."""
        groups: dict[str, list[Failure]] = {}
        for f in self.failures:
            groups.setdefault(f.kind, []).append(f)
        return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))

    def summary(self) -> str:
        """Runs, distinct interleavings, failures by kind, and a table of them."""
        head = f"{self.runs} runs ({self.strategy}), {self.interleavings} distinct interleavings"
        if self.pruned:
            head += f", {self.pruned} cut short (orders explored already)"
        head += f", {len(self.failures)} failures"
        if self.interrupted:
            head += " (interrupted: what was found until then)"
        lines = [head]
        groups = self.by_kind()
        if groups:
            width = max(len(k) for k in groups)
            lines.append(f"  {'kind':<{width}}  runs  first  example")
            for kind, found in groups.items():
                first = found[0]
                message = str(first.error).splitlines()[0] if str(first.error) else ""
                lines.append(f"  {kind:<{width}}  {len(found):>4}  {first.run:>5}  {message[:80]}")
        hashes = Counter(o.trace_hash for o in self.outcomes if not o.pruned)
        if hashes and self.runs > 1:
            top = hashes.most_common(1)[0][1]
            lines.append(f"  most frequent interleaving: {top} of {sum(hashes.values())} runs")
        return "\n".join(lines)
