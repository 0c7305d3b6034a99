"""``simdist.shrink``: a failing run reduced to the fewest departures from the unperturbed order that still fail.

A failure's run is first re-expressed as explicit decisions (``ties="choices"``: the option its strategy took at
each decision) with the same jitter, which replays it exactly: every scheduling point draws from its own stream,
so the tie order no longer drawing leaves the jitter's draws as they were. Then, keeping only changes after
which the run still fails with the same kind, it drops the latency and compute jitter and the drawn callback
order, and delta-debugs the decisions toward all zeros (option 0 at a decision is insertion order: what the
unperturbed run takes), as ddmin does (Zeller and Hildebrandt, *Simplifying and Isolating Failure-Inducing
Input*, 2002): zero chunks of the decisions that differ, halving the chunks until each single one is needed;
then lower each one left to the smallest option that still fails. Every run is deterministic, so the result is a
pure function of the token, the program and ``max_runs``.

Candidates are run with ``wrap`` (a choice past the agents tied at its decision counts round them), since zeroing
an early decision changes which agents later ones see; the kept case is the run's own record of the options it
took, trailing zeros dropped, so its token replays it exactly without ``wrap``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from simdist.clock.perturbation import Perturbation
from simdist.clock.schedule import ScheduleDivergence
from simdist.engine.runner import Observed, RunResult
from simdist.explore import token
from simdist.explore.api import _reference, token_options
from simdist.explore.divergence import Departure, TieDecision, departure, departures
from simdist.explore.errors import ExplorationError, NondeterminismError, ReplayWarning
from simdist.explore.exploration import Exploration, Failure
from simdist.explore.program import Program, code_hash
from simdist.explore.runs import NONDETERMINISM, Outcome, execute
from simdist.explore.target import Target
from simdist.network.cluster import Cluster
from simdist.options import RunOptions

#: the most runs one :func:`shrink` makes by default (each is one run of the program)
DEFAULT_MAX_RUNS = 200


class ShrinkError(ExplorationError):
    """:func:`simdist.shrink` was given a run it cannot shrink: a token whose run passes, a token of another
    program, a failure of another kind than its replay gives."""


@dataclass
class Shrunk:
    """A failing run reduced by :func:`simdist.shrink`: its token replays the same kind of failure."""

    #: the failure's kind, as the exploration grouped it
    kind: str
    #: what the shrunk run raised (or its failed check)
    error: BaseException
    perturbation: Perturbation
    #: the shrunk run's replay token (JSON text): ``simdist.replay(fn, cluster, shrunk.replay)``
    replay: str
    trace_hash: str
    #: the decisions that take another option than the unperturbed order, each with its time and tied agents
    decisions: tuple[TieDecision, ...]
    #: where the shrunk run departs from the unperturbed run
    departure: Departure
    #: how many decisions of the given run took another option than the unperturbed order
    before: int
    #: the runs shrinking made
    runs: int
    #: False when ``max_runs`` stopped it before every departure left was shown to be needed
    complete: bool = True
    #: what was kept and why (jitter the failure needs, a re-expression that took another trace)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """The minimal case as text: how many decisions differ, each one, and where the run departs."""
        p = self.perturbation
        n = len(self.decisions)
        lines = [
            (
                f"shrunk to {n} decision{'s' if n != 1 else ''} off the unperturbed order (from {self.before}) in "
                f"{self.runs} runs{'' if self.complete else ' (stopped at max_runs: may not be minimal)'}: {self.kind}"
            ),
            f"choices={list(p.choices)}"
            + (f" latency={p.latency:g}" if p.latency else "")
            + (f" compute={p.compute:g}" if p.compute else "")
            + (f" callbacks drawn (seed {p.seed})" if p.callbacks else "")
            + f", trace {self.trace_hash[:16]}",
        ]
        lines += [f"  {d}" for d in self.decisions]
        if not self.decisions and not (p.latency or p.compute or p.callbacks):
            lines.append("the unperturbed run itself fails so: no reordering is needed")
        lines += self.notes
        lines += self.departure.lines()
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


@dataclass
class _Run:
    """One run shrinking made: its perturbation, outcome and record."""

    perturbation: Perturbation
    outcome: Outcome
    observed: Observed

    @property
    def choices(self) -> tuple[int, ...]:
        """The options it took, trailing zeros (insertion order) dropped."""
        taken = list(self.outcome.decisions)
        while taken and taken[-1] == 0:
            taken.pop()
        return tuple(taken)

    def exact(self) -> Perturbation:
        """The perturbation that replays this run without ``wrap``: its own decisions."""
        return dataclasses.replace(self.perturbation, choices=self.choices, wrap=False)


class _Shrinker:
    """The runs of one :func:`shrink`, bounded by ``max_runs``, each judged against the failure's kind."""

    def __init__(
        self,
        fn: Callable[..., Any],
        cluster: Cluster,
        options: RunOptions,
        check: Callable[[RunResult], Any] | None,
        max_runs: int,
    ) -> None:
        self.fn, self.cluster, self.options, self.check = fn, cluster, options, check
        self.max_runs = max_runs
        self.runs = 0
        self.kind: str | None = None
        #: a candidate was left untried because the runs were spent
        self.truncated = False

    @property
    def spent(self) -> bool:
        """Whether the search's runs are spent (two are kept for the replay of the result and the unperturbed
        run)."""
        return self.runs >= self.max_runs - 2

    def run(self, p: Perturbation) -> _Run:
        self.runs += 1
        observed = Observed()
        outcome = execute(self.fn, self.cluster, self.options, p, self.check, 0, observed=observed)
        return _Run(p, outcome, observed)

    def fails(self, p: Perturbation) -> _Run | None:
        """The run under ``p`` if it fails with the failure's kind (None once ``max_runs`` is spent)."""
        if self.spent:
            self.truncated = True
            return None
        r = self.run(p)
        return r if r.outcome.kind == self.kind else None


def _nonzero(choices: tuple[int, ...]) -> list[int]:
    return [i for i, c in enumerate(choices) if c]


def _chunks(items: list[int], n: int) -> Iterator[list[int]]:
    size, extra = divmod(len(items), n)
    start = 0
    for k in range(n):
        end = start + size + (k < extra)
        yield items[start:end]
        start = end


def _with(choices: tuple[int, ...], zero: set[int], at: int = -1, value: int = 0) -> tuple[int, ...]:
    """``choices`` with the positions in ``zero`` set to 0 and position ``at`` set to ``value``."""
    out = [0 if i in zero else c for i, c in enumerate(choices)]
    if at >= 0:
        out[at] = value
    return tuple(out)


def _ddmin(s: _Shrinker, best: _Run) -> _Run:
    """Zero chunks of ``best``'s departures while the run still fails (ddmin over the positions that differ)."""
    n = 2
    while not s.spent:
        differ = _nonzero(best.choices)
        if not differ:
            return best
        n = min(n, len(differ))
        chunks = list(_chunks(differ, n))
        # ddmin's subset step (keep one chunk, zero the rest), then its complement step (zero one chunk); with
        # two chunks the two are the same
        steps = [(set(differ) - set(c), 2) for c in chunks] if n > 2 else []
        steps += [(set(c), max(n - 1, 2)) for c in chunks]
        for zero, next_n in steps:
            r = s.fails(dataclasses.replace(best.perturbation, choices=_with(best.choices, zero), wrap=True))
            if r is not None:
                best, n = r, next_n
                break
        else:
            if n >= len(differ):
                return best
            n = min(2 * n, len(differ))
    return best


def _lower(s: _Shrinker, best: _Run) -> _Run:
    """Lower each departure left to the smallest option that still fails."""
    for i in _nonzero(best.choices):
        for value in range(1, best.choices[i] if i < len(best.choices) else 0):
            p = dataclasses.replace(
                best.perturbation, choices=_with(best.choices, set(), i, value), wrap=True
            )
            r = s.fails(p)
            if r is not None:
                best = r
                break
    return best


def _drop_draws(s: _Shrinker, best: _Run) -> tuple[_Run, list[str]]:
    """Drop the latency and compute jitter and the drawn callback order where the failure does not need them."""
    notes = []
    p = best.perturbation
    if p.latency or p.compute:
        r = s.fails(dataclasses.replace(p, latency=0.0, compute=0.0, wrap=True))
        if r is not None:
            best = r
        else:
            for name in ("latency", "compute"):
                if getattr(best.perturbation, name):
                    r = s.fails(dataclasses.replace(best.perturbation, **{name: 0.0}, wrap=True))
                    if r is not None:
                        best = r
                    else:
                        notes.append(f"{name} jitter kept: the run does not fail so without it")
    if best.perturbation.callbacks:
        r = s.fails(dataclasses.replace(best.perturbation, callbacks=False, wrap=True))
        if r is not None:
            best = r
        else:
            notes.append("drawn then() callback order kept: the run does not fail so without it")
    return best, notes


def _nothing_drawn(p: Perturbation) -> Perturbation:
    """``p`` with seed 0 when nothing draws from its seed (explicit choices, no jitter, callbacks in order)."""
    if p.ties == "choices" and not (p.latency or p.compute or p.callbacks):
        return dataclasses.replace(p, seed=0)
    return p


def _explicit(p: Perturbation, choices: tuple[int, ...]) -> Perturbation:
    """``p`` as explicit decisions, with its jitter and callback draws."""
    return Perturbation(
        seed=p.seed,
        ties="choices",
        choices=choices,
        latency=p.latency,
        compute=p.compute,
        callbacks=p.callbacks,
    )


def shrink(
    fn: Callable[..., Any] | Program,
    cluster: Cluster | str,
    failure: Failure | str | dict[str, Any],
    *,
    check: Callable[[RunResult], Any] | None = None,
    max_runs: int = DEFAULT_MAX_RUNS,
    **run_options: Any,
) -> Shrunk:
    """Reduce a failing run to the fewest decisions off the unperturbed order that fail with the same kind.

    ``failure`` is an :class:`Exploration`'s failure or its replay token (text or parsed); ``check`` is the
    exploration's check, where it had one (a ``"check failed"`` run fails only by it). Makes at most ``max_runs``
    runs. Returns a :class:`Shrunk`: its token, the decisions that differ (time, tied ranks, which went first
    instead of which) and where the run departs from the unperturbed run. A token whose run passes, a token of
    another program, or a failure whose replay fails otherwise raises :class:`ShrinkError`.
    """
    if isinstance(fn, Target):
        raise ShrinkError(
            f"{type(fn).__name__} is a target: shrinking replays a run's tie decisions, which a target does not report "
            "(a target is explored with strategy='random'; its failure replays from its token with simdist.replay)"
        )
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 3:
        raise ShrinkError(
            "max_runs must be an int >= 3 (the token's run, the shrunk run's replay and the unperturbed run), got "
            f"{max_runs!r:.40}"
        )
    if check is not None and not callable(check):
        raise ShrinkError(f"check must be a function of a run's result (or None), got {type(check).__name__}")
    if isinstance(failure, Failure):
        expected: str | None = failure.kind
        text: str | dict[str, Any] = failure.replay
    elif isinstance(failure, (str, dict)):
        expected, text = None, failure
    else:
        raise ShrinkError(
            f"shrink takes a failure (Exploration.failures[i]) or its replay token, got {type(failure).__name__}"
        )
    if expected == NONDETERMINISM:
        raise ShrinkError(
            "this failure is simdist's determinism self-check: its replays gave other traces, so no run of it can be "
            "kept while shrinking; report it with its replay token"
        )
    data = token.read(text)
    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    if not isinstance(cluster, Cluster):
        raise ShrinkError(
            f"shrink needs a simdist.Cluster, a preset name or a cluster file; got {type(cluster).__name__}"
        )
    if isinstance(fn, Program):
        ref, code = fn.to_json(), fn.code_hash()
    elif callable(fn):
        ref, code = _reference(fn, False), code_hash(fn)
    else:
        raise ShrinkError(f"shrink needs the function every rank runs, got {type(fn).__name__} {fn!r:.60}")
    if ref != data["program"]:
        raise ShrinkError(
            f"the token records a run of {_name(data['program'])}, not of {_name(ref)}: shrink the token with the "
            "program it was recorded with"
        )
    changed = token.changes(data, code, cluster)
    if changed:
        warnings.warn(
            ReplayWarning("shrinking a token recorded in other conditions: " + "; ".join(changed)),
            stacklevel=2,
        )
    options = token_options(data, run_options)
    if isinstance(fn, Program):
        with fn.loaded() as (loaded, _):
            return _shrink(loaded, cluster, options, check, max_runs, data, expected, code)
    return _shrink(fn, cluster, options, check, max_runs, data, expected, code)


def _name(program: dict[str, Any]) -> str:
    if "script" in program:
        entry = f" (entry {program['entry']})" if program.get("entry") else ""
        return f"script {program['script']}{entry}"
    return f"{program.get('module', '')}.{program.get('name', '')}"


def _shrink(
    fn: Callable[..., Any],
    cluster: Cluster,
    options: RunOptions,
    check: Callable[[RunResult], Any] | None,
    max_runs: int,
    data: dict[str, Any],
    expected: str | None,
    code: str,
) -> Shrunk:
    """:func:`shrink` once the token is read and ``fn`` loaded."""
    s = _Shrinker(fn, cluster, options, check, max_runs)
    given = s.run(data["perturbation"])
    kind = given.outcome.kind
    if isinstance(given.outcome.error, ScheduleDivergence):
        raise ShrinkError(f"the token's decisions do not fit this program's run: {given.outcome.error}")
    if kind is None:
        raise ShrinkError(
            f"the token's run (run {data['run']} of a {data['strategy']} exploration) passes"
            + (" with this check" if check is not None else " (pass check= if the exploration had one)")
            + ": there is no failure to shrink"
        )
    if expected is not None and kind != expected:
        raise ShrinkError(
            f"replaying the token fails with {kind!r}, but the failure given is {expected!r}: the program, its check "
            "or simdist changed since the token was recorded"
        )
    s.kind = kind
    before = len(_nonzero(given.choices))
    notes: list[str] = []
    best = given
    exact = _explicit(given.perturbation, given.choices)
    again = s.fails(exact)
    if again is None and s.truncated:
        notes.append("max_runs left no run to shrink with: the given perturbation was kept")
    elif again is None:
        notes.append(
            "as explicit decisions the run did not fail the same way, so the given perturbation was kept unshrunk"
        )
    else:
        if again.outcome.trace_hash != given.outcome.trace_hash:
            notes.append(
                f"as explicit decisions the run took another trace ({again.outcome.trace_hash[:16]}, "
                f"{given.outcome.trace_hash[:16]} given), failing the same way"
            )
        best, kept = _drop_draws(s, again)
        notes += kept
        best = _lower(s, _ddmin(s, best))
    final_p = _nothing_drawn(best.exact()) if best is not given else given.perturbation
    final = s.run(final_p)
    if final.outcome.kind != kind or (
        best is not given and final.outcome.trace_hash != best.outcome.trace_hash
    ):
        raise NondeterminismError(
            f"the shrunk run gave another trace when replayed from its own perturbation ({final_p.to_json()}): "
            f"hashes {best.outcome.trace_hash[:16]}, {final.outcome.trace_hash[:16]}; report this as a simdist bug",
            [best.outcome.trace_hash, final.outcome.trace_hash],
        )
    plain = s.run(Perturbation(ties="fifo", callbacks=False))
    assert final.observed.trace is not None and plain.observed.trace is not None
    assert final.outcome.error is not None
    replay = token.make(
        perturbation=final_p,
        strategy=data["strategy"],
        seed=data["seed"],
        run=data["run"],
        cluster=cluster,
        options=options,
        faults=data["faults"],
        program=data["program"],
        code=code,
    )
    return Shrunk(
        kind=kind,
        error=final.outcome.error,
        perturbation=final_p,
        replay=replay,
        trace_hash=final.outcome.trace_hash,
        decisions=tuple(departures(final.outcome.decisions, final.observed.ties)),
        departure=departure(
            final.outcome.decisions, final.observed.ties, final.observed.trace, plain.observed.trace
        ),
        before=before,
        runs=s.runs,
        complete=not s.truncated,
        notes=tuple(notes),
    )


def shrink_kinds(
    ex: Exploration,
    fn: Callable[..., Any] | Program,
    cluster: Cluster | str,
    *,
    check: Callable[[RunResult], Any] | None = None,
    max_runs: int = DEFAULT_MAX_RUNS,
    **run_options: Any,
) -> dict[str, Shrunk | ShrinkError]:
    """Shrink the first failure of each kind of ``ex`` and keep the result as the failure's ``shrunk`` (a
    failure that cannot be shrunk keeps the error that says why)."""
    out: dict[str, Shrunk | ShrinkError] = {}
    for kind, found in ex.by_kind().items():
        try:
            result: Shrunk | ShrinkError = shrink(
                fn, cluster, found[0], check=check, max_runs=max_runs, **run_options
            )
        except ShrinkError as e:
            result = e
        found[0].shrunk = result
        out[kind] = result
    return out
