"""What the equivalence oracle found: divergences per step, the difference at every step, and the report that names
the first divergence."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simdist.engine.runner import RunResult
from simdist.errors import SimdistError
from simdist.oracle.localize import Localization
from simdist.oracle.tolerance import Difference
from simdist.ranks import ranges

#: kinds of divergence, in the order they are reported within a step (computation order: the forward's loss,
#: backward's gradients, the optimizer's parameters and state, then buffers and replicas)
KINDS = ("steps", "structure", "loss", "grad", "param", "optimizer", "buffer", "replica")

#: how a tensor of each kind is named in a sentence
LABELS = {
    "grad": "the gradient of {name!r}",
    "param": "parameter {name!r}",
    "optimizer": "optimizer state {name!r}",
    "buffer": "buffer {name!r}",
}


#: kinds whose largest difference from the reference is recorded at every step (:class:`StepDifference`)
HISTORY_KINDS = ("loss", "grad", "param", "optimizer", "buffer")


def label(kind: str, name: str) -> str:
    """``name`` as a sentence names a tensor of ``kind`` ("the gradient of 'fc.weight'")."""
    return LABELS[kind].format(name=name)


@dataclass(frozen=True)
class Divergence:
    """One tensor (or the loss, or the step count) of one step that differs from the reference."""

    #: 0-based optimizer step
    step: int
    #: one of :data:`KINDS`
    kind: str
    #: the tensor's name in the parallel program (``"loss"`` for the loss)
    name: str
    #: global ranks whose part of the tensor differs (for a replica: the ranks that differ from the first holder)
    ranks: tuple[int, ...] = ()
    difference: Difference | None = None
    #: a sentence saying more (values of a loss, shapes, which replica)
    detail: str = ""
    #: for a replica mismatch, the kind of tensor whose copies differ ("grad", "param", ...)
    of: str = ""

    def __str__(self) -> str:
        on = f" on ranks {ranges(list(self.ranks))}" if len(self.ranks) > 1 else (
            f" on rank {self.ranks[0]}" if self.ranks else ""
        )
        diff = f" ({self.difference})" if self.difference is not None else ""
        detail = f"; {self.detail}" if self.detail else ""
        if self.kind == "loss":
            return f"step {self.step}: the loss differs from the reference{diff}{detail}"
        if self.kind == "replica":
            what = repr(self.name) if self.of == "param" else label(self.of, self.name)
            who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {ranges(list(self.ranks))}"
            return f"step {self.step}: replicas disagree on {what}: {who} {self.detail}"
        if self.kind in ("steps", "structure"):
            return f"step {self.step}: {self.detail}"
        what = repr(self.name) if self.kind == "param" else label(self.kind, self.name)
        after = " after the optimizer step" if self.kind in ("param", "optimizer") else ""
        return f"step {self.step}: {what}{on} differs from the reference{after}{diff}{detail}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        d = self.difference
        return {
            "step": self.step,
            "kind": self.kind,
            "name": self.name,
            "ranks": list(self.ranks),
            "max_abs": None if d is None else d.max_abs,
            "rel": None if d is None else d.rel,
            "count": None if d is None else d.count,
            "numel": None if d is None else d.numel,
            "detail": self.detail,
            "of": self.of,
            "text": str(self),
        }


@dataclass(frozen=True)
class StepDifference:
    """How far one step of the parallel run is from the reference's: the largest ``|parallel - reference|`` over
    every tensor of each kind (assembled as the comparison assembles it), ``None`` where nothing of a kind was
    compared (no loss, no buffers, or a structure that does not match)."""

    #: 0-based optimizer step
    step: int
    loss: float | None = None
    grad: float | None = None
    param: float | None = None
    optimizer: float | None = None
    buffer: float | None = None

    def of(self, kind: str) -> float | None:
        """The largest difference of ``kind`` (one of :data:`HISTORY_KINDS`) at this step."""
        if kind not in HISTORY_KINDS:
            raise ValueError(f"a step's difference is recorded per kind {HISTORY_KINDS}, got {kind!r}")
        return getattr(self, kind)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (an infinite difference, from a NaN the reference lacks, as the string "inf")."""
        return {"step": self.step, **{k: _json_float(getattr(self, k)) for k in HISTORY_KINDS}}


def _json_float(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


#: writes an equivalence report as HTML: installed by :mod:`simdist.report` (a later layer), called by
#: :meth:`EquivalenceReport.save_report`
_report_writer: Callable[[EquivalenceReport, Path], Path] | None = None


def install_report_writer(writer: Callable[[EquivalenceReport, Path], Path]) -> None:
    """Make ``writer(report, path)`` what :meth:`EquivalenceReport.save_report` calls."""
    global _report_writer
    _report_writer = writer


@dataclass
class EquivalenceReport:
    """The outcome of :func:`simdist.check_equivalence`: equal, or where the parallel run first diverged."""

    #: optimizer steps compared
    steps: int
    #: every divergence of the first divergent step (empty when equivalent)
    divergences: list[Divergence]
    #: the first divergent operation of that step, when localisation ran and found one
    localization: Localization | None
    parallel: RunResult | None
    reference: RunResult | None
    world_size: int
    exact: bool
    #: tensors compared per kind, at each step (parameters, gradients, optimizer state, buffers)
    compared: dict[str, int] = field(default_factory=dict)
    parallel_name: str = "parallel"
    reference_name: str = "reference"
    #: why localisation did not name an op (it was off, or found none), when it did not
    localization_note: str = ""
    #: the largest difference per kind at every step both runs have, past the first divergent step too
    history: list[StepDifference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every compared step matched the reference and every replica its peers."""
        return not self.divergences

    @property
    def first(self) -> Divergence | None:
        """The first divergence (earliest step, then computation order), or ``None``."""
        return self.divergences[0] if self.divergences else None

    @property
    def step(self) -> int | None:
        """The first divergent step, or ``None``."""
        return self.divergences[0].step if self.divergences else None

    def summary(self) -> str:
        """One line: equivalent, or the first divergence."""
        mode = "bitwise" if self.exact else "within tolerance"
        if self.ok:
            counts = ", ".join(f"{n} {k}" for k, n in self.compared.items() if n)
            return (
                f"equivalent: {self.parallel_name} on {self.world_size} ranks matches {self.reference_name} "
                f"{mode} for {self.steps} steps ({counts or 'nothing'} compared per step)"
            )
        return str(self.first)

    def __str__(self) -> str:
        if self.ok:
            return self.summary()
        lines = [str(self.first)]
        if self.localization is not None:
            lines += ["  " + line for line in str(self.localization).splitlines()]
        elif self.localization_note:
            lines.append(f"  ({self.localization_note})")
        rest = self.divergences[1:]
        if rest:
            kinds: dict[str, list[str]] = {}
            for d in rest:
                kinds.setdefault(d.kind, []).append(f"{plural(d.of, 1)} {d.name!r}" if d.of else repr(d.name))
            parts = [f"{len(v)} {plural(k, len(v))} ({_names(v)})" for k, v in kinds.items()]
            lines.append(f"  also diverging at step {self.first.step}: " + "; ".join(parts))
        return "\n".join(lines)

    def save_report(self, path: str | Path) -> Path:
        """Write this comparison as one self-contained HTML page (verdict, divergences, localisation, and the
        parallel run's timeline and collectives) to ``path``."""
        if _report_writer is None:
            raise SimdistError("no report writer is installed: import simdist (or simdist.report) before saving a report")
        return _report_writer(self, Path(path))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form of the report."""
        loc = self.localization
        return {
            "ok": self.ok,
            "steps": self.steps,
            "world_size": self.world_size,
            "exact": self.exact,
            "compared": dict(self.compared),
            "parallel": self.parallel_name,
            "reference": self.reference_name,
            "divergences": [d.to_dict() for d in self.divergences],
            "localization": None if loc is None else loc.to_dict(),
            "history": [h.to_dict() for h in self.history],
            "text": str(self),
        }


def plural(kind: str, n: int) -> str:
    """The word for ``n`` divergences (or tensors) of ``kind``."""
    word = {"grad": "gradient", "param": "parameter", "optimizer": "optimizer state tensor",
            "replica": "replica mismatch"}.get(kind, kind)
    return word if n == 1 else word + ("es" if word.endswith("ch") else "s")


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... {len(names) - most} more" if len(names) > most else "")
