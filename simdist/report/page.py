"""Render a run's report as one self-contained HTML page (styles, script and data inlined; no network request)."""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path
from typing import Any

import jinja2
import markupsafe
import torch

from simdist.engine.runner import RunResult
from simdist.errors import safe_str
from simdist.network.cluster import Cluster
from simdist.oracle.report import HISTORY_KINDS, EquivalenceReport, StepDifference
from simdist.ranks import format_ranks, ranges
from simdist.report import data
from simdist.report import real as real_run
from simdist.report.topology import BOX_H, topology_picture
from simdist.units import format_bandwidth, format_size, format_time
from simdist_base.timeline import Timeline

TEMPLATES = Path(__file__).parent / "templates"

#: ranks drawn as separate lines in the memory plot; more are summarised by the ranks with the highest peaks
MAX_MEMORY_LINES = 8

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,  # every string from user code (names, messages, paths, return values) is escaped
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
# simdist's own stylesheet and script, inlined verbatim (the only unescaped text in a page)
_STATIC = {
    kind: markupsafe.Markup((TEMPLATES / f"report.{kind}").read_text(encoding="utf-8")) for kind in ("css", "js")
}
_ENV.filters.update(size=format_size, seconds=format_time, bandwidth=format_bandwidth)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def environment() -> jinja2.Environment:
    """The reports' template environment (autoescaping, strict undefined, size/time/bandwidth filters)."""
    return _ENV


def static() -> dict[str, markupsafe.Markup]:
    """The stylesheet and script every page inlines, as template variables ``css`` and ``js``."""
    return {"css": _STATIC["css"], "js": _STATIC["js"]}


def versions() -> dict[str, str]:
    """simdist's and torch's versions, for a page's header."""
    return {"simdist": _version("simdist"), "torch": torch.__version__}


def _bars(rows: list[data.Breakdown]) -> dict[str, Any]:
    """Geometry of the step-breakdown plot: per rank a compute bar, a communication bar and its exposed part."""
    top = max([max(b.compute, b.communication, b.finish) for b in rows] + [1e-12])
    width, height, pad = max(320, 36 * len(rows)), 180, 40
    slot = (width - pad) / max(1, len(rows))
    bars = []
    for i, b in enumerate(rows):
        x = pad + i * slot
        w = slot * 0.38
        for k, (value, cls, dx) in enumerate(
            ((b.compute, "compute", 0.1), (b.communication, "comm", 0.52), (b.exposed, "exposed", 0.52))
        ):
            h = value / top * (height - 20)
            bars.append({"x": x + slot * dx, "y": height - h, "w": w, "h": h, "cls": cls, "rank": b.rank,
                         "value": value})
    return {"width": width, "height": height + 20, "base": height, "pad": pad, "slot": slot, "bars": bars,
            "top": top, "ranks": [b.rank for b in rows]}


def _memory_plot(series: dict[int, list[tuple[float, float]]], end: float) -> dict[str, Any] | None:
    """Step lines of live bytes over time for at most :data:`MAX_MEMORY_LINES` ranks (those with the highest peaks)."""
    if not series:
        return None
    peaks = sorted(series, key=lambda r: (-max(v for _, v in series[r]), r))
    shown = sorted(peaks[:MAX_MEMORY_LINES])
    top = max(max(v for _, v in series[r]) for r in shown) or 1.0
    end = end or max(t for r in shown for t, _ in series[r]) or 1.0
    width, height, pad = 640, 180, 50
    lines = []
    for i, r in enumerate(shown):
        pts, last = [], None
        for t, v in series[r] + [(end, series[r][-1][1])]:
            x = pad + t / end * (width - pad - 10)
            y = height - v / top * (height - 10)
            if last is not None:
                pts.append(f"{x:.1f},{last:.1f}")
            pts.append(f"{x:.1f},{y:.1f}")
            last = y
        lines.append({"rank": r, "points": " ".join(pts), "colour": data.PALETTE[i % len(data.PALETTE)]})
    return {"width": width, "height": height + 20, "base": height, "pad": pad, "lines": lines, "top": top,
            "end": end, "of": len(series)}


def render_run_report(
    result: RunResult | None,
    *,
    error: BaseException | None = None,
    cluster: Cluster | None = None,
    seed: int | None = None,
    program: str = "",
    title: str | None = None,
    oracle: dict[str, Any] | None = None,
    real: Timeline | str | Path | None = None,
) -> str:
    """The HTML text of a run's report; ``result`` None with ``error`` set reports a run that a diagnosis stopped.

    ``real`` (a real run's timeline, or the directory it was recorded to) adds its operations to the timeline on
    the same time scale, and a table of each one's predicted and measured time.
    """
    if result is None and error is None:
        raise ValueError("render_run_report needs a RunResult, or the error that stopped the run (error=...)")
    cluster = cluster if cluster is not None else (result.cluster if result is not None else None)
    seed = seed if seed is not None else (result.seed if result is not None else None)
    program = program or (result.program if result is not None else "")
    colours: dict[str, str] = {}
    ctx: dict[str, Any] = {
        "title": title or f"simdist run: {program or 'program'}",
        "program": program,
        "cluster": cluster,
        "cluster_text": cluster.describe() if cluster is not None else "",
        "topology": topology_picture(cluster) if cluster is not None else None,
        "box_h": BOX_H,
        "seed": seed,
        "versions": versions(),
        "result": result,
        "error": None if error is None else _error(error),
        "oracle": oracle,
        "real": None,
        "profile": None,
        "unmatched_ops": [],
    }
    if result is not None:
        ranks = data.sampled_ranks(result.world_size)
        table = data.collective_rows(result.trace)
        for row in table:
            data.colour_of(row.op, colours)
        breakdown = data.breakdowns(result.trace, result.finish_times)
        drawn = data.timeline(result.trace, ranks, colours, result.call_sites, result.p2p_sites)
        comparison = None
        if real is not None:
            comparison = real_run.compare(result.trace, real_run.as_timeline(real), result.world_size,
                                          result.call_sites, result.p2p_sites)  # fmt: skip
            real_run.timeline_rows(drawn, comparison, colours)
        ctx.update(
            trace_hash=result.trace_hash,
            timeline=drawn,
            real=comparison,
            sampled=len(ranks) < result.world_size,
            ranks_shown=ranks,
            collectives=table,
            bars=_bars([breakdown[r] for r in ranks]),
            memory_plot=_memory_plot(data.memory_series(result.trace), result.sim_time),
            profile=result.profile,
            unmatched_ops=_unmatched_ops(result),
            returns=[(r, _short_repr(v)) for r, v in enumerate(result.returns[:MAX_RETURNS])],
            races=[
                {"text": str(r), "sites": [(site, data.code_lines(site)) for site in r.sites], "rank": r.rank,
                 "kind": r.kind}
                for r in result.races[:MAX_RACES]
            ],
        )
    legend = {"compute": data.COMPUTE_COLOUR}
    if result is not None and any(data.is_annotation(s) for s in result.trace.spans):
        legend["nvtx range"] = data.ANNOTATION_COLOUR
    ctx["colours"] = {**legend, **colours}
    ctx["summary"] = oracle["summary"] if oracle else summary_line(result, ctx["error"], cluster)
    # for the index: a stopped run or a divergence fails, race findings warn
    failed = result is None or (oracle is not None and not oracle["ok"])
    ctx["status"] = "fail" if failed else "warn" if result.races else "pass"
    return _ENV.get_template("run.html.j2").render(
        **ctx, css=_STATIC["css"], js=_STATIC["js"]
    )


#: rank return values and race findings listed in full; further ones are counted
MAX_RETURNS = 64
MAX_RACES = 50


def _unmatched_ops(result: RunResult) -> list[tuple[str, int, float]]:
    """The ops a run's profile did not hold: (name, count, model seconds), the most time first."""
    if result.profile is None:
        return []
    rows = [(name, int(count), seconds) for name, (count, seconds) in result.profile.unmatched_ops.items()]
    return sorted(rows, key=lambda r: (-r[2], -r[1], r[0]))


def _error(error: BaseException) -> dict[str, Any]:
    """A diagnosis for the page: its type, its text, and the source line of every call site the text names."""
    text = safe_str(error)
    return {"type": type(error).__name__, "text": text, "code": data.code_lines(text)}


def _short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters (a user's ``__repr__`` that raises is named, not raised)."""
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001 - a broken __repr__ must not stop the report
        text = f"<{type(value).__name__}.__repr__ raised {type(e).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summary_line(result: RunResult | None, error: dict[str, str] | None, cluster: Cluster | None) -> str:
    """One line for the index: ranks, simulated time, races or the error."""
    where = f"{cluster.world_size} ranks of {cluster.device_name}" if cluster is not None else "unknown cluster"
    if result is None:
        return f"FAILED ({error['type'] if error else 'error'}) on {where}"
    races = f"; {len(result.races)} race findings" if result.races else ""
    return f"{where}; simulated {format_time(result.sim_time)}; {result.messages} messages{races}"


def write_run_report(result: RunResult | None, path: str | Path, **kwargs: Any) -> Path:
    """Write :func:`render_run_report`'s page to ``path`` (parent directories created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_run_report(result, **kwargs), encoding="utf-8")
    return path


#: colour and legend text of each kind in the per-step difference plot (Okabe-Ito colours, as elsewhere in reports)
HISTORY_STYLE = {
    "loss": ("#1d232b", "loss"),
    "grad": ("#e69f00", "gradients"),
    "param": ("#0072b2", "parameters"),
    "optimizer": ("#009e73", "optimizer state"),
    "buffer": ("#cc79a7", "buffers"),
}


def _history_plot(history: list[StepDifference], first: int | None) -> dict[str, Any] | None:
    """Geometry of the per-step difference plot: log-scale max |diff| per kind, zeros on a floor line below the
    decades, infinite differences (a NaN the reference lacks) on a ceiling line above them."""
    if not history:
        return None
    kinds = [k for k in HISTORY_KINDS if any(h.of(k) is not None for h in history)]
    if not kinds:
        return None
    values = [v for h in history for k in kinds if (v := h.of(k)) is not None]
    finite = [v for v in values if 0 < v < math.inf]
    # whole decades around the measured values; a run with no nonzero difference still gets a scale to sit under
    lo = math.floor(math.log10(min(finite))) if finite else -16
    hi = math.ceil(math.log10(max(finite))) if finite else 0
    every = max(1, math.ceil((hi - lo) / 6))  # at most about seven labelled decades
    hi = lo + every * max(1, math.ceil((hi - lo) / every))
    width, pad, top, band = 680, 96, 22, 150
    floor_y, ceil_y = top + band + 16, top - 14
    n = len(history)
    x0, x1 = pad + 12, width - 16
    steps = [h.step for h in history]

    def x_of(i: int) -> float:
        return (x0 + x1) / 2 if n == 1 else x0 + i * (x1 - x0) / (n - 1)

    def y_of(v: float) -> float:
        if v == 0:
            return floor_y
        if v == math.inf:
            return ceil_y
        return top + band - (math.log10(v) - lo) / (hi - lo) * band

    # with nothing above zero a scale of decades would only be decoration
    ticks = [{"y": y_of(10.0**e), "text": f"1e{e}"} for e in range(lo, hi + 1, every)] if finite else []
    lines = []
    for k in kinds:
        colour, name = HISTORY_STYLE[k]
        segments: list[list[str]] = [[]]
        points = []
        for i, h in enumerate(history):
            v = h.of(k)
            if v is None:
                segments.append([])  # a step where this kind was not compared breaks the line
                continue
            x, y = x_of(i), y_of(v)
            segments[-1].append(f"{x:.1f},{y:.1f}")
            shown = "0 (bitwise equal)" if v == 0 else ("inf (NaN where the reference has a number)" if v == math.inf
                                                        else f"{v:.3g}")
            points.append({"x": x, "y": y, "step": h.step, "title": f"step {h.step}: {name}, max |diff| {shown}"})
        lines.append({"kind": k, "name": name, "colour": colour, "points": points,
                      "segments": [" ".join(seg) for seg in segments if len(seg) > 1]})
    every_x = max(1, math.ceil(n / 12))
    xticks = [{"x": x_of(i), "text": str(s)} for i, s in enumerate(steps) if i % every_x == 0 or i == n - 1]
    marker = None
    if first is not None and first in steps:
        marker = {"x": x_of(steps.index(first)), "step": first}
    return {
        "width": width, "height": floor_y + 30, "pad": pad, "top": top, "base": floor_y, "floor": floor_y,
        "ceiling": ceil_y if math.inf in values else None, "right": x1, "ticks": ticks, "xticks": xticks,
        "lines": lines, "marker": marker, "steps": n, "all_zero": all(v == 0 for v in values),
    }


def _localization(report: EquivalenceReport) -> dict[str, Any] | None:
    """The first divergent op as the page's highlighted line shows it, or why there is none."""
    if report.ok:
        return None
    loc = report.localization
    if loc is None:
        return {"found": False, "note": report.localization_note or "localisation found no op"}
    where = ", ".join(x for x in (loc.phase, f"module {loc.module}" if loc.module else "") if x)
    return {
        "found": True, "op": loc.label or loc.op, "site": loc.site, "where": where,
        "ranks": format_ranks(loc.ranks) if loc.ranks else "",
        "inputs": "its inputs matched the reference" if loc.inputs_matched else "its inputs already differed",
        "difference": "" if loc.difference is None else str(loc.difference), "note": loc.note,
    }


def write_equivalence_report(report: EquivalenceReport, path: str | Path) -> Path:
    """Write an equivalence-oracle report: the verdict, the first divergent op, a plot of the difference from the
    reference per step and kind, and every divergence of the first divergent step, above the parallel run's own
    report."""
    rows = [
        {
            "step": d.step, "kind": d.kind, "of": d.of, "name": d.name, "ranks": ranges(list(d.ranks)) if d.ranks else "",
            "max_abs": "" if d.difference is None else f"{d.difference.max_abs:.3g}",
            "rel": "" if d.difference is None else f"{d.difference.rel:.3g}",
            "scale": "" if d.difference is None or d.difference.scale is None else f"{d.difference.scale:.4g}",
            "detail": d.detail,
        }
        for d in report.divergences
    ]
    oracle = {
        "ok": report.ok, "step": report.step, "steps": report.steps, "world_size": report.world_size,
        "exact": report.exact, "parallel": report.parallel_name, "reference": report.reference_name,
        "compared": ", ".join(f"{n} {k}" for k, n in report.compared.items() if n) or "nothing",
        "text": str(report), "divergences": rows,
        "summary": ("equivalent" if report.ok else "DIVERGED") + f": {report.summary()}",
        "history": _history_plot(report.history, report.step),
        "localization": _localization(report),
    }
    title = f"simdist check: {report.parallel_name} vs {report.reference_name}"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_run_report(report.parallel, title=title, oracle=oracle), encoding="utf-8")
    return path


__all__ = ["render_run_report", "summary_line", "write_equivalence_report", "write_run_report"]
