"""Cases of a scenario checked against one process by the equivalence oracle: variants, outcomes, verdicts.

A case has variants; each variant runs a layout of a parallel program and expects one of three things: it
equals the single-process model ("equal"), it diverges (the oracle must report the first divergence of a kind
and name some tensors, "diverges") or it raises (an error of a type whose text names some things, "raises").
The programs return ``{"losses": [...], "params": {name: tensor}}`` on every rank (losses only where the loss
is computed), and so do their references.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from verdicts import difference, drift_series

import simdist
import simdist.report
from real import RealRunError


@dataclass(frozen=True)
class Variant:
    """A layout and what must happen to it: "equal", "diverges" (with the tensors the oracle must name among its
    divergences) or "raises" (with a text the error must contain)."""

    label: str
    layout: Any
    expect: str
    names: tuple[str, ...] = ()
    #: the first divergence's kind when it diverges, or the error's type name when it raises
    kind: str = ""
    #: for "diverges": the factor by which the gradients are the reference's, if the bug predicts one
    scale: float | None = None
    #: for "diverges": the replicas of a parameter must be reported unequal too
    replicas: bool = False


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    variants: tuple[Variant, ...] = field(default_factory=tuple)


@dataclass
class Outcome:
    """What one variant did under simdist."""

    report: simdist.EquivalenceReport | None = None
    error: BaseException | None = None

    def text(self) -> str:
        if self.error is not None:
            lines = str(self.error).splitlines()
            return f"{type(self.error).__name__}: {' / '.join(line.strip() for line in lines[:3])}"
        assert self.report is not None
        return "equals one process" if self.report.ok else str(self.report.first)


def outcome_of(check: Callable[[], simdist.EquivalenceReport]) -> Outcome:
    """The oracle's report, or the program's error (the rank's own exception if one raised) as the outcome."""
    try:
        return Outcome(report=check())
    except simdist.RankError as e:
        return Outcome(error=e.exc)
    except simdist.SimdistError as e:
        return Outcome(error=e)


def drift(rep: simdist.EquivalenceReport, names: Mapping[str, str] | None = None) -> float:
    """Largest |parameter - reference| after the last step, over every rank's copy (``names``: parallel -> reference)."""
    ref = rep.reference.returns[0]["params"]
    worst = 0.0
    for out in rep.parallel.returns:
        for name, value in out["params"].items():
            want = ref[(names or {}).get(name, name)]
            worst = max(worst, (value - want).abs().max().item())
    return worst


def differing(rep: simdist.EquivalenceReport) -> str:
    """The tensors of the first divergent step that differ, by kind, in the report's order."""
    kinds: dict[str, list[str]] = {}
    for d in rep.divergences:
        names = kinds.setdefault("replicas of" if d.kind == "replica" else d.kind, [])
        if d.name not in names:
            names.append(d.name)
    return "; ".join("the loss" if kind == "loss" else f"{kind} {', '.join(names)}" for kind, names in kinds.items())


def losses(rep: simdist.EquivalenceReport) -> str:
    """The loss by step, the mean over the ranks that computed one, against the reference's."""
    lasts = [out["losses"] for out in rep.parallel.returns if out["losses"]]
    mine = [sum(ls[k] for ls in lasts) / len(lasts) for k in range(min(map(len, lasts)))]
    theirs = rep.reference.returns[0]["losses"]
    return " ".join(f"{a:.4f}" for a in mine) + "  (ref " + " ".join(f"{b:.4f}" for b in theirs) + ")"


def verdict(v: Variant, o: Outcome) -> tuple[bool, str]:
    """Whether the outcome is what the variant expects, and a short account of it."""
    if v.expect == "raises":
        if o.error is None:
            return False, "raised nothing"
        text = str(o.error)
        missing = [n for n in v.names if n not in text]
        ok = type(o.error).__name__ == v.kind and not missing
        return ok, f"{type(o.error).__name__}" + (f"; missing {missing}" if missing else "")
    if o.error is not None:
        return False, f"raised {type(o.error).__name__}"
    rep = o.report
    assert rep is not None
    if v.expect == "equal":
        return rep.ok, f"{rep.steps} steps equal" if rep.ok else str(rep.first)
    if rep.ok:
        return False, "reported equal"
    named = {d.name for d in rep.divergences}
    missing = [n for n in v.names if n not in named]
    ok = rep.first.kind == v.kind and not missing
    detail = f"step {rep.first.step}, {rep.first.kind} {rep.first.name!r}"
    if v.replicas:
        drifted = sorted({d.name for d in rep.divergences if d.kind == "replica"})
        ok = ok and bool(drifted)
        detail += f"; replicas differ: {', '.join(drifted) or 'none'}"
    if v.scale is not None:
        grad = next((d for d in rep.divergences if d.kind == "grad"), None)
        scale = None if grad is None or grad.difference is None else grad.difference.scale
        ok = ok and scale is not None and abs(scale - v.scale) < 1e-9 * v.scale
        detail += f"; gradients {scale:.4g} x the reference's" if scale is not None else "; gradients not a multiple"
    return ok, detail + (f"; not named: {missing}" if missing else "")


def show(v: Variant, o: Outcome, names: Mapping[str, str] | None = None) -> None:
    """Print the variant's outcome: the first divergence or error, what differs, the drift and the loss by step."""
    print(f"  {v.label:30s} {o.text()}")
    if o.report is not None and not o.report.ok:
        print(f"  {'':30s} differing at step {o.report.first.step}: {differing(o.report)}")
    if o.report is not None:
        print(f"  {'':30s} max |param - ref| {difference(drift(o.report, names))}; loss {losses(o.report)}")


class CaseSections:
    """What a case scenario's HTML report shows: a row per variant, the loss difference per step, and the
    simulated time and idle share of every variant that ran to completion."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.drift: dict[str, list[tuple[float, float]]] = {}
        self.times: dict[str, dict[str, float]] = {}

    def add(self, case: Case, v: Variant, o: Outcome, ok: bool, detail: str) -> None:
        """Record one variant's outcome and verdict."""
        label = f"({case.key}) {v.label}"
        self.rows.append([f"({case.key})", case.title, v.label, v.expect, o.text(), ("PASS", "pass") if ok else ("FAIL", "fail"),
                          detail])
        rep = o.report
        if rep is None or rep.parallel is None:
            return
        if series := drift_series(rep):
            self.drift[label] = series
        res = rep.parallel
        busy = [res.trace.busy_time(r, "compute") for r in range(res.world_size)]
        self.times[label] = {"simulated time": res.sim_time,
                             "idle compute (mean over ranks)": res.sim_time - sum(busy) / len(busy)}

    def write(self, page: simdist.report.ScenarioReport, note: str) -> None:
        """Add the variant table and the plots to ``page``."""
        page.table("Every variant", ["case", "what", "variant", "expects", "outcome", "verdict", "detail"], self.rows,
                   note=note, nav="variants")
        if self.drift:
            page.line_plot("Parameter drift per step", self.drift, x_label="optimizer step",
                           y_label="max |param - reference|", log=True, nav="drift per step",
                           note="The largest difference of any parameter from the single-process reference's after "
                                "each step (the oracle's history), per variant that ran to completion; 0 is bitwise "
                                "equal, the equal variants stay at rounding.")
        if self.times:
            page.bar_plot("Simulated time per variant", self.times, y_label="simulated time", unit="time",
                          nav="time per variant",
                          note="The whole run's simulated time, and how much of it a rank's compute stream is idle "
                               "on average (pipeline bubble, exposed communication, waiting).")


#: diagnoses only the simulation makes: on real processes the same program errs inside the backend or hangs until
#: the launcher's timeout, so such a variant is not launched there
SIMULATED_DIAGNOSES = ("CollectiveMismatchError", "DeadlockError")


def on_real_gloo(
    cases: list[Case],
    check: Callable[[list[Variant]], list[simdist.EquivalenceReport]],
    simulated_ok: Mapping[tuple[str, str], bool],
    verdicts: list,
    keys: str | None = None,
    page: simdist.report.ScenarioReport | None = None,
) -> None:
    """Every variant (of the cases ``keys``) on real gloo processes: errors as errors, the rest by final state.

    ``check(variants)`` runs them (``real.oracle.check_final_states``: as few launches as their world sizes
    allow), a report per variant; ``simulated_ok`` says which variants equalled one process under simdist. The
    verdict is whether every launched variant agrees with the simulation.
    """
    print("Real gloo: every variant on real processes (one per rank)")
    chosen = [(case, v) for case in cases if keys is None or case.key in keys for v in case.variants]
    # A variant that raises fails its launch, so each runs alone; the others share launches (starting the
    # processes costs more than a variant's training).
    launched = [v for _, v in chosen if v.expect != "raises"]
    try:
        shared: dict[int, simdist.EquivalenceReport | RealRunError] = (
            dict(zip(map(id, launched), check(launched))) if launched else {}
        )
    except RealRunError as e:
        shared = {id(v): e for v in launched}
    agree = total = 0
    rows: list[list[str]] = []
    for case, v in chosen:
        if v.expect == "raises" and v.kind in SIMULATED_DIAGNOSES:
            print(f"({case.key}) {v.label:40s} not launched: it would fail inside gloo or hang until the "
                  f"launcher's timeout (the simulation reports a {v.kind})")
            rows.append([f"({case.key})", v.label, f"raises {v.kind}", "not launched", "-"])
            continue
        total += 1
        try:
            rep = shared[id(v)] if v.expect != "raises" else check([v])[0]
            if isinstance(rep, RealRunError):
                raise rep
        except RealRunError as e:
            raised = v.expect == "raises" and v.kind in str(e)
            agree += raised
            print(f"({case.key}) {v.label:40s} {'raised ' + v.kind if raised else 'failed: ' + str(e).splitlines()[0]}")
            rows.append([f"({case.key})", v.label, f"raises {v.kind}" if v.expect == "raises" else "runs",
                         "raised " + v.kind if raised else "failed: " + str(e).splitlines()[0],
                         ("yes", "pass") if raised else ("no", "fail")])
            continue
        same = v.expect != "raises" and rep.ok == simulated_ok[(case.key, v.label)]
        agree += same
        print(f"({case.key}) {v.label:40s} {'equals one process' if rep.ok else rep.first}")
        rows.append([f"({case.key})", v.label,
                     "equals one process" if simulated_ok[(case.key, v.label)] else "diverges",
                     "equals one process" if rep.ok else str(rep.first), ("yes", "pass") if same else ("no", "fail")])
    print()
    if page is not None:
        page.table("Simulated vs real gloo", ["case", "variant", "simulated", "on real processes", "agree"], rows,
                   nav="sim vs real",
                   note="Every variant on real gloo processes (one per rank): errors as errors, the rest by final "
                        "state against the reference.")
    verdicts.append(("real gloo agrees with the simulation", agree == total, f"{agree} of {total} variants"))
