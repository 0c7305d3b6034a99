"""Geometry of the small SVG plots of a report (line plots and grouped bars), drawn by the templates.

simdist draws its plots itself rather than inlining a plotting library: a plot is a few kilobytes of SVG,
where a plotting library's inlined JavaScript adds 4.8 MB to every page (Plotly: plotly.min.js of the
plotly wheel), about 200 KB (Chart.js) or about 50 KB (uPlot), and start-up time; SVG also shows without any script.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from simdist.report.data import PALETTE
from simdist.units import format_size, format_time

#: how plot values are written on axes and in hover titles
FORMATS: dict[str, Callable[[float], str]] = {
    "time": format_time,
    "bytes": format_size,
    "number": lambda v: f"{v:.3g}",
    "percent": lambda v: f"{v * 100:.1f}%",
}

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 220, 64, 16, 12, 34


def _formatter(unit: str) -> Callable[[float], str]:
    if unit not in FORMATS:
        raise ValueError(f"plot unit {unit!r} is not one of {sorted(FORMATS)}")
    return FORMATS[unit]


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values (1, 2 or 5 x 10^k apart) covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(math.ceil((hi - start) / step) + 1)]


def line_plot(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    x_label: str,
    y_label: str,
    unit: str = "number",
    log: bool = False,
    marks: Mapping[float, str] | None = None,
) -> dict[str, Any]:
    """Lines of (x, y) points, one per series, with axes, ticks and a legend's colours.

    ``log`` draws y on a log scale; values of 0 (bitwise equal, no drift) then lie on a floor line labelled
    "0" below the smallest positive value. ``marks`` draws labelled vertical lines at the given x values.
    """
    fmt = _formatter(unit)
    if not series or not any(series.values()):
        raise ValueError("line_plot needs at least one series with points")
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    positive = [y for y in ys if y > 0]
    floor = None
    if log:
        if not positive:
            lo, hi = 0.0, 1.0  # every value 0: one floor line
        else:
            lo, hi = math.floor(math.log10(min(positive))) - 1, math.ceil(math.log10(max(positive)))
            hi = max(hi, lo + 1)
        floor = lo

        def yv(v: float) -> float:
            return lo if v <= 0 else math.log10(v)

        ticks = [(float(k), "0" if k == lo else fmt(10.0**k)) for k in range(int(lo), int(hi) + 1)]
        step = max(1, math.ceil(len(ticks) / 6))
        ticks = [t for i, t in enumerate(ticks) if i % step == 0 or i == len(ticks) - 1]
    else:
        lo, hi = min(0.0, min(ys)), max(ys)
        hi = hi if hi > lo else lo + 1.0

        def yv(v: float) -> float:
            return v

        values = _nice_ticks(lo, hi)
        hi = max(hi, values[-1])
        ticks = [(v, fmt(v)) for v in values]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def py(v: float) -> float:
        return TOP + (1 - (yv(v) - lo) / (hi - lo)) * plot_h

    lines = []
    for i, (label, pts) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        dots = [{"x": px(x), "y": py(y), "title": f"{label}: {x:g}, {fmt(y) if y > 0 or not log else '0'}"}
                for x, y in pts]
        lines.append({"label": label, "colour": colour, "points": " ".join(f"{d['x']:.1f},{d['y']:.1f}" for d in dots),
                      "dots": dots})
    x_ticks = [(px(v), f"{v:g}") for v in _nice_ticks(x0, x1) if x0 <= v <= x1]
    if all(float(x).is_integer() for x in xs):
        x_ticks = [(p, t) for p, t in x_ticks if float(t).is_integer()]
    return {
        "width": WIDTH, "height": HEIGHT, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP, "base": TOP + plot_h,
        "lines": lines, "x_ticks": x_ticks, "y_ticks": [(TOP + (1 - (v - lo) / (hi - lo)) * plot_h, t) for v, t in ticks],
        "x_label": x_label, "y_label": y_label, "floor": None if floor is None else py(0.0),
        "marks": [{"x": px(x), "label": text} for x, text in (marks or {}).items()],
    }


def bar_plot(groups: Mapping[str, Mapping[str, float]], *, y_label: str, unit: str = "number") -> dict[str, Any]:
    """Grouped bars: one group per key of ``groups`` (x axis), one bar per series within each, from 0."""
    fmt = _formatter(unit)
    if not groups:
        raise ValueError("bar_plot needs at least one group")
    names = list(dict.fromkeys(s for bars in groups.values() for s in bars))
    top = max([v for bars in groups.values() for v in bars.values()] + [0.0])
    ticks = _nice_ticks(0.0, top if top > 0 else 1.0)
    top = ticks[-1]
    plot_w, plot_h = max(WIDTH, 24 * len(names) * len(groups)) - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(groups)
    width = slot * 0.8 / max(1, len(names))
    bars, labels = [], []
    for g, (group, values) in enumerate(groups.items()):
        labels.append({"x": LEFT + (g + 0.5) * slot, "text": group})
        for i, name in enumerate(names):
            if name not in values:
                continue
            h = values[name] / top * plot_h
            bars.append({"x": LEFT + g * slot + slot * 0.1 + i * width, "y": TOP + plot_h - h, "w": width * 0.92,
                         "h": h, "colour": PALETTE[i % len(PALETTE)], "title": f"{group}, {name}: {fmt(values[name])}"})
    return {
        "width": LEFT + plot_w + RIGHT, "height": HEIGHT, "left": LEFT, "right": LEFT + plot_w, "top": TOP,
        "base": TOP + plot_h, "bars": bars, "labels": labels, "y_label": y_label,
        "y_ticks": [(TOP + (1 - v / top) * plot_h, fmt(v)) for v in ticks],
        "series": [{"label": n, "colour": PALETTE[i % len(PALETTE)]} for i, n in enumerate(names)],
    }


__all__ = ["FORMATS", "bar_plot", "line_plot"]
