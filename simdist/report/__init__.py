"""HTML reports: one self-contained page per run (timeline, collectives, step breakdown, memory, findings), and
an index page linking every report in a directory."""

from simdist.engine.runner import install_report_writer
from simdist.oracle.report import install_report_writer as install_equivalence_writer
from simdist.report.index import build_index
from simdist.report.page import render_run_report, write_equivalence_report, write_run_report
from simdist.report.scenario import ScenarioReport

install_report_writer(write_run_report)
install_equivalence_writer(write_equivalence_report)

__all__ = ["ScenarioReport", "build_index", "render_run_report", "write_equivalence_report", "write_run_report"]
