"""A scenario's report: its verdict table, then tables, plots, texts and side-by-side runs in the order added.

A scenario script builds one :class:`ScenarioReport` as it goes and saves it with its verdicts at the end::

    page = ScenarioReport("DDP with tied weights", description=__doc__, seed=args.seed)
    page.runs("Buggy vs fixed", {"buggy": res_a, "fixed": res_c})
    page.line_plot("Parameter drift per step", {"buggy": [(1, 0.0), (2, 3e-3)]}, x_label="step",
                   y_label="max |param - ref|", log=True)
    page.save(out_dir / "ddp_tied_weights.html", verdicts)     # verdicts: [(expectation, held, detail), ...]
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simdist.engine.runner import RunResult
from simdist.network.cluster import Cluster
from simdist.ranks import ranges
from simdist.report import data, plot
from simdist.report.page import environment, static, versions
from simdist.units import format_size, format_time

#: ranks drawn per run in a side-by-side comparison; more are sampled evenly (first and last kept)
MAX_COMPARED_RANKS = 8

Verdict = tuple[str, bool, str]


def _sample(world_size: int, limit: int) -> list[int]:
    if world_size <= limit:
        return list(range(world_size))
    return sorted({round(i * (world_size - 1) / (limit - 1)) for i in range(limit)})


def _slug(title: str, taken: set[str]) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "section"
    slug, k = base, 2
    while slug in taken:
        slug, k = f"{base}-{k}", k + 1
    taken.add(slug)
    return slug


_NUMBERED = re.compile(r"(\d+\.|-)\s+")
_LETTERED = re.compile(r"\([a-zA-Z]\)\s")


def _paragraphs(text: str) -> list[dict[str, Any]]:
    """A docstring's paragraphs as blocks: plain text, or the items of a list where its lines start with "1.",
    "-" (marker dropped) or "(a)" (marker kept); usage lines dropped."""
    out: list[dict[str, Any]] = []
    for para in text.strip().split("\n\n"):
        # reStructuredText's ``literal`` quotes read as plain text on the page
        lines = [line.strip().replace("``", "") for line in para.strip().splitlines()]
        if not lines or lines[0].startswith("Usage"):
            continue
        kind = "ol" if _NUMBERED.match(lines[0]) and lines[0][0].isdigit() else (
            "ul" if _NUMBERED.match(lines[0]) else ("cases" if _LETTERED.match(lines[0]) else ""))
        items: list[str] = []
        for line in lines:
            starts = bool(_NUMBERED.match(line) if kind in ("ol", "ul") else _LETTERED.match(line) if kind else False)
            if starts or not items:
                items.append(_NUMBERED.sub("", line, count=1) if kind in ("ol", "ul") else line)
            else:
                items[-1] += " " + line
        out.append({"list": kind, "items": items} if kind else {"list": "", "text": " ".join(items)})
    return out


class ScenarioReport:
    """Collects a scenario's sections; :meth:`save` writes them with the verdict table as one HTML page."""

    def __init__(
        self,
        title: str,
        *,
        description: str = "",
        program: str = "",
        seed: int | None = None,
        cluster: Cluster | None = None,
        command: str | None = None,
    ) -> None:
        self.title = title
        self.description = _paragraphs(description)
        self.program = program or Path(sys.argv[0]).name
        self.seed = seed
        self.cluster = cluster
        self.command = command if command is not None else " ".join(shlex.quote(a) for a in ["python", *sys.argv])
        self.sections: list[dict[str, Any]] = []
        self._ids: set[str] = {"verdicts-section", "facts"}

    def _add(self, kind: str, title: str, note: str, nav: str | None = None, **fields: Any) -> None:
        self.sections.append({"kind": kind, "title": title, "note": note, "id": _slug(title, self._ids),
                              "nav": nav or title, **fields})

    def table(
        self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, note: str = "", nav: str | None = None
    ) -> None:
        """A sortable table; numeric cells sort by value. A cell may be ``(text, css class)``, e.g. ``("FAIL",
        "fail")``, to colour it."""
        cells = []
        for row in rows:
            if len(row) != len(columns):
                raise ValueError(f"table {title!r}: a row has {len(row)} cells for {len(columns)} columns: {row!r}")
            cells.append([self._cell(c) for c in row])
        types = ["num" if all(isinstance(r[i].get("value"), (int, float)) for r in cells) and cells else "text"
                 for i in range(len(columns))]
        self._add("table", title, note, nav, columns=list(columns), rows=cells, types=types)

    @staticmethod
    def _cell(value: Any) -> dict[str, Any]:
        cls = ""
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
            value, cls = value
        if isinstance(value, bool):
            return {"text": "yes" if value else "no", "value": None, "cls": cls}
        if isinstance(value, float):
            return {"text": f"{value:.4g}", "value": value, "cls": cls}
        if isinstance(value, int):
            return {"text": str(value), "value": value, "cls": cls}
        return {"text": str(value), "value": None, "cls": cls}

    def line_plot(
        self,
        title: str,
        series: Mapping[str, Sequence[tuple[float, float]]],
        *,
        x_label: str,
        y_label: str,
        unit: str = "number",
        log: bool = False,
        marks: Mapping[float, str] | None = None,
        note: str = "",
        nav: str | None = None,
    ) -> None:
        """A line per series of (x, y) points (see :func:`simdist.report.plot.line_plot`)."""
        self._add("line", title, note, nav,
                  plot=plot.line_plot(series, x_label=x_label, y_label=y_label, unit=unit, log=log, marks=marks))

    def bar_plot(
        self, title: str, groups: Mapping[str, Mapping[str, float]], *, y_label: str, unit: str = "number",
        note: str = "", nav: str | None = None,
    ) -> None:
        """Grouped bars: per group (x axis) one bar per series (see :func:`simdist.report.plot.bar_plot`)."""
        self._add("bars", title, note, nav, plot=plot.bar_plot(groups, y_label=y_label, unit=unit))

    def text(self, title: str, text: str, *, error: bool = False, note: str = "", nav: str | None = None) -> None:
        """Preformatted text, e.g. a diagnosis (``error=True`` draws it as an error); the source line of every call
        site the text names (``path:line``, traceback frames) is listed under it."""
        self._add("text", title, note, nav, text=text, error=error, code=data.code_lines(text))

    def runs(
        self, title: str, runs: Mapping[str, RunResult], *, ranks: Sequence[int] | None = None, note: str = "",
        nav: str | None = None,
    ) -> None:
        """Runs side by side: their figures in one table, then each one's timeline on a shared time scale.

        ``ranks`` picks the ranks drawn (default: all up to :data:`MAX_COMPARED_RANKS`, else a sample)."""
        if not runs:
            raise ValueError(f"runs {title!r}: give at least one RunResult to compare")
        colours: dict[str, str] = {}
        end = max(r.sim_time for r in runs.values()) * 1e6
        out = []
        for label, res in runs.items():
            shown = list(ranks) if ranks is not None else _sample(res.world_size, MAX_COMPARED_RANKS)
            bad = [r for r in shown if not 0 <= r < res.world_size]
            if bad:
                raise ValueError(f"runs {title!r}: ranks {bad} are not ranks of {label!r} ({res.world_size} ranks)")
            rows = data.collective_rows(res.trace)
            for row in rows:
                data.colour_of(row.op, colours)
            parts = data.breakdowns(res.trace, res.finish_times)
            worst = max(parts, key=lambda b: (b.exposed, -b.rank))
            timeline = data.timeline(res.trace, shown, colours, res.call_sites, res.p2p_sites)
            timeline["end"] = end
            out.append({
                "label": label, "world_size": res.world_size, "sampled": len(shown) < res.world_size,
                "ranks_text": ranges(shown), "timeline": timeline,
                "facts": {
                    "simulated time": format_time(res.sim_time),
                    "collectives": str(len(rows)),
                    "collective buffers (sum)": format_size(sum(r.nbytes for r in rows)),
                    "exposed communication (worst rank)": f"{format_time(worst.exposed)} (rank {worst.rank})",
                    "race findings": str(len(res.races)),
                    "messages": str(res.messages),
                    "trace hash": res.trace_hash[:16],
                },
            })
        self._add("runs", title, note, nav, runs=out, facts=list(out[0]["facts"]),
                  colours={"compute": data.COMPUTE_COLOUR, **colours})

    def summary(self, verdicts: Sequence[Verdict]) -> str:
        """One line for the index: how many expectations held, and the first that did not."""
        failed = [name for name, ok, _ in verdicts if not ok]
        if not verdicts:
            return "no expectations checked"
        if not failed:
            return f"PASS: {len(verdicts)} of {len(verdicts)} expectations held"
        return f"FAIL: {len(failed)} of {len(verdicts)} expectations failed, first: {failed[0]}"

    def render(self, verdicts: Sequence[Verdict]) -> str:
        """The page's HTML text."""
        verdicts = [(str(n), bool(ok), str(d)) for n, ok, d in verdicts]
        failed = sum(not ok for _, ok, _ in verdicts)
        return environment().get_template("scenario.html.j2").render(
            title=self.title, description=self.description, program=self.program, command=self.command,
            seed=self.seed, cluster=self.cluster, versions=versions(), sections=self.sections, verdicts=verdicts,
            failed=failed, summary=self.summary(verdicts), status="fail" if failed or not verdicts else "pass",
            **static(),
        )

    def save(self, path: str | Path, verdicts: Sequence[Verdict]) -> Path:
        """Write the page to ``path`` (parent directories created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.render(verdicts), encoding="utf-8")
        return path


__all__ = ["MAX_COMPARED_RANKS", "ScenarioReport"]
