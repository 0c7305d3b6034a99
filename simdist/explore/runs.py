"""One run of an exploration: what it is (a :class:`Task`, JSON a worker can load) and what it gave (an
:class:`Outcome`), with the determinism self-check every failure goes through."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simdist.clock.perturbation import Perturbation
from simdist.clock.schedule import TieChooser
from simdist.engine.runner import Observed, RunResult, run_observed
from simdist.errors import RankError
from simdist.explore.errors import CheckFailed, ExplorationError, NondeterminismError, RemoteError
from simdist.explore.program import Program
from simdist.explore.target import Ran, Target
from simdist.network.cluster import Cluster
from simdist.options import RunOptions

#: the failure kind of a run whose replays gave other traces: a bug in simdist, not in the program
NONDETERMINISM = "nondeterminism (simdist bug)"


@dataclass
class Outcome:
    """What one run gave."""

    index: int
    #: the perturbation that replays the run (an exhaustive run's decisions as explicit choices)
    perturbation: Perturbation
    #: the trace's hash (of the trace up to the failure, for a run that raised)
    trace_hash: str
    #: None for a run that passed; else the failure's kind (an exception's type, "check failed", ...)
    kind: str | None = None
    error: BaseException | None = None
    #: the option taken at each decision, and how many agents met at decisions
    decisions: list[int] = dataclasses.field(default_factory=list)
    agents: int = 0
    #: an exhaustive run cut short because every order from there on was explored already
    pruned: bool = False
    #: what a :class:`Target`'s run returned (``Ran.value``) for a run that did not raise; None for programs
    value: Any = None

    def key(self) -> tuple[Any, ...]:
        """What must be equal between two explorations that found the same (errors compared by kind)."""
        return (self.index, self.perturbation, self.trace_hash, self.kind, tuple(self.decisions))


def kind_of(error: BaseException) -> str:
    """A failure's kind as the summary groups them: the exception's type (a rank's, inside a RankError)."""
    if isinstance(error, RemoteError):
        return error.kind
    if isinstance(error, CheckFailed):
        return "check failed"
    if isinstance(error, NondeterminismError):
        return NONDETERMINISM
    if isinstance(error, RankError):
        return f"RankError ({type(error.exc).__name__})"
    return type(error).__name__


def execute(
    fn: Callable[..., Any] | Target,
    cluster: Cluster | None,
    options: RunOptions,
    perturbation: Perturbation,
    check: Callable[[RunResult], Any] | None,
    index: int,
    chooser: TieChooser | None = None,
    prune: type[BaseException] | None = None,
    observed: Observed | None = None,
) -> Outcome:
    """Run ``fn`` once under ``perturbation`` and judge it (an exception, or ``check(result)`` False or raising).

    ``prune`` is the exception an exhaustive chooser raises to cut a redundant run short; ``observed`` receives
    the run's trace and decisions (with each decision's time and tied agents). ``fn`` may be a :class:`Target`
    (``cluster``, ``options`` and ``observed`` are then unused)."""
    if isinstance(fn, Target):
        return _execute_target(fn, perturbation, check, index)
    observed = Observed() if observed is None else observed
    error: BaseException | None = None
    kind: str | None = None
    try:
        result = run_observed(fn, cluster, options, perturbation, observed, chooser)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        if prune is not None and isinstance(e, prune):
            return Outcome(
                index, perturbation, "", decisions=observed.decisions, agents=observed.agents, pruned=True
            )
        if not isinstance(e, Exception):
            raise
        error, kind = e, kind_of(e)
    else:
        error, kind = _judge(check, result, index)
    trace_hash = observed.trace.hash() if observed.trace is not None else ""
    return Outcome(index, perturbation, trace_hash, kind, error, observed.decisions, observed.agents)


def _execute_target(
    target: Target, perturbation: Perturbation, check: Callable[[Any], Any] | None, index: int
) -> Outcome:
    """:func:`execute` for a target: its run judged as a program's is, its kind named by the target if it says."""
    try:
        ran = target.run(perturbation)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a target's exception is the run's failure
        kind = target.kind(e) or kind_of(e)
        return Outcome(index, perturbation, str(getattr(e, "trace_hash", "")), kind, e)
    if not isinstance(ran, Ran):
        raise ExplorationError(
            f"{type(target).__name__}.run must return simdist.explore.Ran(value, trace_hash), got "
            f"{type(ran).__name__}"
        )
    error, kind = _judge(check, ran.value, index)
    return Outcome(index, perturbation, ran.trace_hash, kind, error, value=ran.value)


def _judge(
    check: Callable[[Any], Any] | None, result: Any, index: int
) -> tuple[Exception | None, str | None]:
    """``check(result)``'s verdict: (None, None) when it passed, else the error and its kind."""
    if check is None:
        return None, None
    try:
        verdict = check(result)
    except Exception as e:  # noqa: BLE001 - a check that raises fails the run
        return e, f"check raised {type(e).__name__}"
    if verdict is False:
        error = CheckFailed(f"run {index}: check {getattr(check, '__qualname__', check)!s} returned False")
        return error, kind_of(error)
    return None, None


def verify(
    outcome: Outcome,
    fn: Callable[..., Any] | Target,
    cluster: Cluster | None,
    options: RunOptions,
    check: Callable[[RunResult], Any] | None,
) -> Outcome:
    """Replay a failed run twice from its replay token's perturbation: the three traces must agree, else the
    failure is reported as a simdist bug (:data:`NONDETERMINISM`) carrying every hash."""
    p = outcome.perturbation
    hashes = [outcome.trace_hash]
    kinds = [outcome.kind]
    for _ in range(2):
        again = execute(fn, cluster, options, p, check, outcome.index)
        hashes.append(again.trace_hash)
        kinds.append(again.kind)
    if len(set(hashes)) == 1 and len(set(kinds)) == 1:
        return outcome
    error = NondeterminismError(
        f"run {outcome.index} gave other traces when replayed from its own token: hashes {', '.join(h[:16] for h in hashes)} "
        f"(failure kinds {kinds}). The run, its two replays and simdist should be deterministic: report this as a "
        "simdist bug with the replay token, unless the program keeps state between runs (a module-level counter, "
        "the wall clock, an unseeded generator)",
        hashes,
    )
    error.__cause__ = outcome.error
    return dataclasses.replace(outcome, kind=NONDETERMINISM, error=error)


# ---------------------------------------------------------------------- worker processes
@dataclass(frozen=True)
class Task:
    """One run as a worker receives it: JSON values only (the program by reference, never a pickled closure)."""

    index: int
    program: dict[str, Any]
    check: dict[str, Any] | None
    cluster: dict[str, Any]
    options: RunOptions
    perturbation: Perturbation


def run_task(task: Task) -> Outcome:
    """Run ``task`` in a worker process (its failure verified there) and make its outcome fit to send back."""
    cluster = Cluster.from_config(task.cluster) if task.cluster else None  # a target's task has none
    check_ref = Program.from_json(task.check) if task.check is not None else None
    with Program.from_json(task.program).loaded() as (fn, extra):
        options = dataclasses.replace(task.options, **extra) if extra else task.options
        check = None
        if check_ref is not None:
            with check_ref.loaded() as (check_fn, _):
                check = check_fn
        outcome = execute(fn, cluster, options, task.perturbation, check, task.index)
        if outcome.kind is not None:
            outcome = verify(outcome, fn, cluster, options, check)
    return sendable(outcome)


def sendable(outcome: Outcome) -> Outcome:
    """``outcome`` with its error replaced by a :class:`RemoteError` if the error cannot be pickled back."""
    if outcome.error is None:
        return outcome
    try:
        pickle.loads(pickle.dumps(outcome.error))
    except Exception:  # noqa: BLE001 - any exception that does not survive the trip is sent as text
        return dataclasses.replace(outcome, error=RemoteError(outcome.kind or "error", str(outcome.error)))
    return outcome
