"""A simulation other than ``simdist.run`` that ``simdist.explore`` can drive: a :class:`Target`.

A target is a frozen dataclass of JSON fields, defined at the top level of a module (or of the script being
run), whose :meth:`Target.run` runs it once under a perturbation. It travels to worker processes and into
replay tokens as a reference (its module, its class's name and its fields), never as a pickle, and is rebuilt
from that reference where it runs: so a target's whole identity is its fields, and two equal targets must run
alike under one perturbation.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from typing import Any

from simdist.clock.perturbation import Perturbation
from simdist.explore.errors import ExplorationError


@dataclass(frozen=True)
class Ran:
    """What one run of a target gave: ``value`` (what ``check`` receives and ``Outcome.value`` keeps: keep it
    small, it travels back from worker processes) and the hash of what the run did (its trace)."""

    value: Any
    trace_hash: str


class Target:
    """Base of a simulation ``simdist.explore(target, ...)`` drives instead of ``simdist.run``.

    Subclass it as a frozen dataclass with JSON fields and implement :meth:`run`. An exception the run raises is a
    failure; it should carry the trace's hash up to the failure as ``trace_hash`` (the determinism self-check
    compares it across the failure's replays). :meth:`kind` may name a failure's kind for the summary.
    """

    def run(self, perturbation: Perturbation) -> Ran:
        """Run once under ``perturbation`` (its seed and tie order); raises on failure."""
        raise NotImplementedError(
            f"{type(self).__name__} must define run(perturbation) -> simdist.explore.Ran"
        )

    def kind(self, error: Exception) -> str | None:
        """The kind a failure is grouped under in the summary; None: the exception's type, as for programs."""
        return None


def fields_json(target: Target) -> dict[str, Any]:
    """``target``'s fields as JSON; a clear error if it is not a dataclass of JSON fields."""
    if not dataclasses.is_dataclass(target) or isinstance(target, type):
        raise ExplorationError(
            f"a Target is shipped and replayed by its fields: {type(target).__name__} must be a frozen dataclass"
        )
    out = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
    try:
        json.dumps(out)
    except TypeError as e:
        raise ExplorationError(
            f"{type(target).__name__} has a field that is not a JSON value ({e}): a target travels to workers "
            "and into replay tokens as JSON"
        ) from None
    return out


def from_fields(cls: Any, fields: Any, where: str) -> Target:
    """The target of class ``cls`` rebuilt from the fields :func:`fields_json` wrote."""
    if not (isinstance(cls, type) and issubclass(cls, Target) and dataclasses.is_dataclass(cls)):
        raise ExplorationError(f"{where} names {cls!r:.60}, which is not a simdist.explore.Target dataclass")
    if not isinstance(fields, dict):
        raise ExplorationError(f"{where}: a target's fields are a JSON object, got {fields!r:.60}")
    hints = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    values = {
        k: tuple(v) if isinstance(v, list) and "tuple" in hints.get(k, "") else v for k, v in fields.items()
    }
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ExplorationError(
            f"{where}: {cls.__name__} cannot be rebuilt from {fields!r:.80}: {e}"
        ) from None


def import_class(module: str, name: str) -> Any:
    """``module``'s attribute ``name`` (a qualified name)."""
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def refuse(target: Target, strategy: str, cluster: Any, run_options: dict[str, Any]) -> None:
    """A clear error for what an exploration of ``target`` cannot take: a cluster, run options, a strategy other
    than random."""
    name = type(target).__name__
    if cluster is not None:
        raise ExplorationError(
            f"{name} is a Target: it holds its own configuration, so explore(target, ...) takes no cluster "
            f"(got {cluster!r:.60})"
        )
    if run_options:
        raise ExplorationError(
            f"{name} is a Target: simdist.run's options {sorted(run_options)} do not apply; make them fields of "
            "the target"
        )
    if strategy != "random":
        raise ExplorationError(
            f"a Target is explored with strategy='random' only, got {strategy!r}: PCT needs the number of tie "
            "decisions an unperturbed run meets and exhaustive search drives each decision, and a target reports "
            "neither"
        )
