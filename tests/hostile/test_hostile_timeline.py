"""Hostile inputs to real runs' timelines and to reports that set them beside a simulated run: bad options and
directories are refused before anything starts, files that are not timelines are named, and a timeline of
another program is reported as differing, never crashed on."""

from __future__ import annotations

import contextlib
import io
import pathlib
import tempfile
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import real
import simdist
from simdist import cli
from simdist.report import real as real_report
from simdist_base.timeline import CommRecord, RankTimeline, Timeline, TimelineError, load, write


def one_all_reduce() -> None:
    """The rank code the cases launch (refused before it runs) or simulate."""
    dist.all_reduce(torch.ones(2))


def _directory(content: str | None) -> pathlib.Path:
    """A fresh directory, holding rank 0's timeline file with ``content`` unless None."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="hostile-timeline-"))
    if content is not None:
        (root / "rank0.timeline.json").write_text(content)
    return root


def _a_file() -> pathlib.Path:
    path = _directory(None) / "not-a-directory"
    path.write_text("")
    return path


def _cli_status(argv: list[str]) -> Callable[[], tuple[int, str]]:
    def run() -> tuple[int, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = cli.main(argv)
        return status, err.getvalue()

    return run


def _valid_directory() -> str:
    root = _directory(None)
    write(RankTimeline(0, "host", 0.0, 0.0), root)
    return str(root)


def _other_program() -> real_report.Comparison:
    """A simulated all-reduce against a real timeline holding a broadcast and then that all-reduce."""
    sim = simdist.run(one_all_reduce, simdist.Cluster.switch(2, device="cpu"))
    records = {
        rank: [
            CommRecord(
                rank, 0, "broadcast", "0", (0, 1), 8, "float32", "x.py:1 in f", 0.0, 1e-3, "completed"
            ),
            CommRecord(
                rank, 1, "all_reduce", "0", (0, 1), 8, "float32", "x.py:2 in f", 2e-3, 3e-3, "completed"
            ),
        ]
        for rank in (0, 1)
    }
    timeline = Timeline(records, "monotonic", {0: "h", 1: "h"}, {})
    return real_report.compare(sim.trace, timeline, 2, sim.call_sites, sim.p2p_sites)


def _reported(comparison: real_report.Comparison) -> None:
    # the oracle: the real run had one operation more on each rank, found before the one both share
    assert comparison.matched == 2
    assert [(p.rank, p.op, p.note) for p in comparison.pairs if p.note] == [
        (0, "broadcast", real_report.ONLY_REAL),
        (1, "broadcast", real_report.ONLY_REAL),
    ]
    assert comparison.mismatches == [
        f"rank {r}: 1 operations simulated, 2 recorded; the real run has broadcast at x.py:1 in f (its #0) where "
        f"the simulated run has none (before its #0)"
        for r in (0, 1)
    ]
    assert all(p.site.startswith(__file__) for p in comparison.pairs if p.op == "all_reduce")


CASES: list[Case] = [
    Case("timeline-is-a-file", "real.run(fn, 2, timeline=<a file>)",
         lambda: real.run(one_all_reduce, 2, timeline=_a_file()),
         error=real.RealConfigError, match=r"timeline directory '.*not-a-directory' is a file; name a directory"),
    Case("timeline-not-a-path", "real.run(fn, 2, timeline=3)", lambda: real.run(one_all_reduce, 2, timeline=3),
         error=real.RealConfigError, match=r"timeline must be True, False or a directory to write to; got 3"),
    Case("timeline-profile-without-directory", "real.run(fn, 2, timeline=True, profile=True)",
         lambda: real.run(one_all_reduce, 2, timeline=True, profile=True),
         error=real.RealConfigError, match=r"timeline=True keeps none: pass timeline=DIR"),
    Case("timeline-profile-not-a-flag", "real.run(fn, 2, timeline=DIR, profile='yes')",
         lambda: real.run(one_all_reduce, 2, timeline=_directory(None), profile="yes"),  # type: ignore[arg-type]
         error=real.RealConfigError, match=r"profile must be True or False; got 'yes'"),
    Case("timeline-file-not-json", "a timeline directory whose rank file is not JSON",
         lambda: load(_directory("{not json")), error=TimelineError,
         match=r"rank0\.timeline\.json: cannot be read as a real timeline"),
    Case("timeline-file-other-format", "a timeline file of another format",
         lambda: load(_directory('{"format": 2, "records": []}')), error=TimelineError,
         match=r"not a real timeline of format 1 \(found format 2\)"),
    Case("timeline-file-missing-field", "a timeline file without its records",
         lambda: load(_directory('{"format": 1, "rank": 0}')), error=TimelineError,
         match=r"a real timeline file with a missing or malformed field"),
    Case("timeline-empty-directory", "simdist.report with real= a directory no run recorded into",
         lambda: load(_directory(None)), error=TimelineError, match=r"holds no rank\*\.timeline\.json file"),
    Case("report-real-without-report", "simdist run SCRIPT --real DIR without --report",
         _cli_status(["run", __file__, "--entry", "one_all_reduce", "--real", _valid_directory()]),
         check=lambda out: (out[0] == 2 and "add --report OUT.html" in out[1]) or pytest.fail(str(out))),
    Case("report-real-other-program", "a report sets a timeline of another program beside a simulated run",
         _other_program, check=_reported),
]  # fmt: skip


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
