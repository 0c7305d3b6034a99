"""The verdict table every scenario ends with, and the exit status it implies."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from simdist import EquivalenceReport
from simdist.report import ScenarioReport, build_index

#: (expectation, whether it held, detail)
Verdict = tuple[str, bool, str]

#: differences smaller than this are float64 round-off: their digits depend on the order of each sum, which
#: torch's SIMD kernels (ATEN_CPU_CAPABILITY, the CPU) choose, so printed output shows the bound instead
ROUND_OFF = 1e-12


def difference(value: float) -> str:
    """A difference as printed output shows it on any CPU: "below 1e-12" for round-off, else three digits."""
    return f"below {ROUND_OFF:g}" if abs(value) < ROUND_OFF else f"{value:.2e}"


def report(verdicts: list[Verdict]) -> int:
    """Print one line per expectation (PASS/FAIL and detail); 0 if all held, else 1 (the script's exit status)."""
    width = max([len("expectation"), *(len(name) for name, _, _ in verdicts)])
    print(f"{'expectation':{width}s} {'verdict':8s} detail")
    for name, ok, detail in verdicts:
        print(f"{name:{width}s} {'PASS' if ok else 'FAIL':8s} {detail}")
    return 0 if all(ok for _, ok, _ in verdicts) else 1


def drift_series(rep: EquivalenceReport, kind: str = "param") -> list[tuple[float, float]]:
    """(optimizer step from 1, largest |parallel - reference| of ``kind``) at every step the oracle measured, for a
    plot; steps where nothing of the kind was compared, or the difference is infinite (a NaN), are left out."""
    return [(d.step + 1, v) for d in rep.history if (v := d.of(kind)) is not None and math.isfinite(v)]


def finish(page: ScenarioReport, verdicts: list[Verdict], out_dir: Path, name: str) -> int:
    """Write the scenario's HTML report ``out_dir/name.html`` (and the directory's index), then print the verdict
    table; returns the exit status."""
    path = page.save(Path(out_dir) / f"{name}.html", verdicts)
    build_index(out_dir)
    print(f"report: {path} (index: {Path(out_dir) / 'index.html'})")
    print()
    return report(verdicts)


@contextlib.contextmanager
def importable_by_rank_processes(directory: Path) -> Iterator[None]:
    """``directory`` (a scenario's) on ``sys.path`` while real rank processes start.

    They receive this process's ``sys.path`` and import the scenario's programs by module name when the scenario
    was imported rather than run, as the tests do.
    """
    here = str(Path(directory).resolve())
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added:
            sys.path.remove(here)
