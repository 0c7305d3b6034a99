"""HTML reports: one self-contained page per run (timeline, collectives, step breakdown, memory, findings), and
an index page linking every report in a directory."""

from simdist.report.index import build_index
from simdist.report.page import render_run_report, write_equivalence_report, write_run_report
from simdist.report.scenario import ScenarioReport

__all__ = ["ScenarioReport", "build_index", "render_run_report", "write_equivalence_report", "write_run_report"]
