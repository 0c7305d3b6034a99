"""An exploration's HTML page: its summary, failures by kind (each with its error, call sites, replay token and,
where it was shrunk, its minimal case and first divergent event), failures over runs, and the interleavings the
runs took; one self-contained file the report index links."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simdist.clock.perturbation import Perturbation
from simdist.explore.api import replay
from simdist.explore.errors import CheckFailed
from simdist.explore.exploration import Exploration, Failure
from simdist.explore.program import Program
from simdist.explore.shrink import Shrunk
from simdist.network.cluster import Cluster
from simdist.report.scenario import ScenarioReport

#: interleavings listed on the page, most frequent first
MAX_INTERLEAVINGS = 20


def exploration_page(
    ex: Exploration,
    *,
    program: str,
    cluster: Cluster,
    command: str | None = None,
    fn: Callable[..., Any] | Program | None = None,
) -> ScenarioReport:
    """The page of ``ex``, an exploration of ``program`` (its name as the user gave it) on ``cluster``.

    With ``fn`` (the program explored), each kind of failure whose run ended (a failed ``check``) is replayed and
    its timeline drawn beside the unperturbed run's; a run that raised leaves no timeline to draw."""
    page = ScenarioReport(
        f"simdist explore: {program}",
        description=f"{ex.runs} runs of {program} on {cluster.name} ({cluster.world_size} ranks), each under another "
        f"perturbation ({ex.strategy}). A failing run's replay token runs it again with the same trace.",
        program=program,
        cluster=cluster,
        command=command,
    )
    page.text("Summary", ex.summary())
    groups = ex.by_kind()
    if groups:
        page.table(
            "Failures by kind",
            ["kind", "runs", "first run", "trace hash", "first error"],
            [
                (kind, len(found), found[0].run, found[0].trace_hash[:16], _first_line(found[0].error))
                for kind, found in groups.items()
            ],
        )
    for kind, found in groups.items():
        first = found[0]
        page.text(
            f"{kind}: run {first.run}",
            str(first.error),
            error=True,
            note=f"{len(found)} runs failed so; runs {', '.join(str(f.run) for f in found[:20])}"
            + (" ..." if len(found) > 20 else ""),
        )
        if fn is not None and _completed(first):
            _timelines(page, fn, cluster, first)
        token = json.loads(first.replay)
        page.text(
            f"Replay run {first.run}",
            f"simdist.replay({_call(token['program'])}, cluster, token)\n\ntoken:\n{first.replay}",
            note="the token is JSON: tokens of every failure are written by simdist explore --tokens FILE",
        )
        _shrunk(page, kind, first, token["program"])
    if ex.runs > 1:
        ordered = sorted(ex.outcomes, key=lambda o: o.index)
        seen = 0
        points = []
        for o in ordered:
            seen += o.kind is not None
            points.append((float(o.index), float(seen)))
        page.line_plot(
            "Failures over runs", {"failures found": points}, x_label="run", y_label="failures so far"
        )
    counts = Counter(o.trace_hash for o in ex.outcomes if not o.pruned)
    failing = {o.trace_hash: o.kind for o in ex.outcomes if o.kind is not None}
    page.table(
        "Interleavings",
        ["trace hash", "runs", "outcome"],
        [
            (h[:16] or "(none)", n, (failing[h], "fail") if h in failing else ("passed", "pass"))
            for h, n in counts.most_common(MAX_INTERLEAVINGS)
        ],
        note=f"{len(counts)} distinct trace hashes"
        + (f", the {MAX_INTERLEAVINGS} most frequent shown" if len(counts) > MAX_INTERLEAVINGS else ""),
    )
    return page


def save_exploration_page(
    ex: Exploration,
    path: str | Path,
    *,
    program: str,
    cluster: Cluster,
    command: str | None = None,
    fn: Callable[..., Any] | Program | None = None,
) -> Path:
    """Write :func:`exploration_page` to ``path``; its verdict is whether every run passed."""
    page = exploration_page(ex, program=program, cluster=cluster, command=command, fn=fn)
    held = not ex.failures and not ex.interrupted
    detail = f"{len(ex.failures)} of {ex.runs} runs failed" + (" (interrupted)" if ex.interrupted else "")
    return page.save(path, [("every explored run passes", held, detail)])


def _shrunk(page: ScenarioReport, kind: str, failure: Failure, program: dict) -> None:
    """The failure's minimal case and where it departs from the unperturbed run, where it was shrunk."""
    shrunk = failure.shrunk
    if isinstance(shrunk, Shrunk):
        page.text(
            f"{kind}: the minimal case after shrinking run {failure.run}",
            f"{shrunk.describe()}\n\nsimdist.replay({_call(program)}, cluster, token)\n\ntoken:\n{shrunk.replay}",
            note="simdist.shrink kept only the decisions off the unperturbed order (and the jitter) the failure needs; "
            "the first divergent event compares each rank's timeline with the unperturbed run's",
        )
    elif shrunk is not None:
        page.text(f"{kind}: not shrunk", str(shrunk), error=True)


def _completed(failure: Failure) -> bool:
    """Whether the failing run ended with a result (only its check failed)."""
    return isinstance(failure.error, CheckFailed) or failure.kind.startswith("check raised")


def _timelines(
    page: ScenarioReport, fn: Callable[..., Any] | Program, cluster: Cluster, failure: Failure
) -> None:
    """The failing run, replayed from its token, beside the unperturbed run with the same options."""
    plain = json.loads(failure.replay)
    plain["perturbation"] = Perturbation(ties="fifo", callbacks=False).to_json()
    runs = {
        f"run {failure.run} ({failure.kind})": replay(fn, cluster, failure.replay),
        "the unperturbed run": replay(fn, cluster, json.dumps(plain)),
    }
    page.runs(f"Run {failure.run} beside the unperturbed run", runs)


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0][:160] if text else type(error).__name__


def _call(program: dict) -> str:
    """How the token's program is named in a replay call."""
    if "script" in program:
        argv = ", argv=" + repr(tuple(program.get("argv", ()))) if program.get("argv") else ""
        entry = f", entry={program['entry']!r}" if program.get("entry") else ""
        return f"Program(script={program['script']!r}{entry}{argv})"
    return f"{program.get('module', '')}.{program.get('name', '')}".lstrip(".")
