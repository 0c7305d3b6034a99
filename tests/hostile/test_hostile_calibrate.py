"""Hostile inputs to ``simdist calibrate``: files that are not nccl-tests output, tables edited or cut, runs that
cannot be fitted, a command line without input, and profiler traces a device cannot be fitted to.

Each case ends in a clear error (a ``simdist.CalibrationError`` naming the file, the line and what was
expected) or in a fit checked against the parameters that made its times."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
from hostile_cases import Case, check, params

from simdist import algorithms, calibrate
from simdist.calibrate import CalibrationError, Sample
from simdist.cli import main as simdist_main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "calibrate"
H20 = (FIXTURES / "h20_all_reduce.txt").read_text()
ONE_MM = Path(__file__).resolve().parent.parent / "data" / "profiles" / "hta_backward_thread.json"


def _text(text: str) -> calibrate.Fit:
    return calibrate.fit(calibrate.parse_nccl_tests(text, "run.txt"))


def _cli(*argv: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = simdist_main(["calibrate", *argv])
    assert status == 2, out.getvalue()
    raise CalibrationError(out.getvalue())


def _exact_all_to_all() -> list[Sample]:
    alpha, beta = 7e-6, 1 / 25e9
    out = []
    for k in range(10):
        m = 8 << (2 * k)
        algo = algorithms.choose("all_to_all", 2, m, (alpha, beta), (alpha, beta))
        out.append(Sample("all_to_all", m, 2, algo.estimate(2, m, alpha, beta), f"row {k}"))
    return out


def _exact(n: int) -> list[Sample]:
    alpha, beta = 7e-6, 1 / 25e9
    out = []
    for k in range(3, 27):
        m = (1 << k) // n * n
        algo = algorithms.choose("all_gather", n, m, (alpha, beta), (alpha, beta))
        out.append(Sample("all_gather", m, n, algo.estimate(n, m, alpha, beta), f"row {k}"))
    return out


def _trace(scale: float = 1.0) -> Path:
    """A CPU trace of adds over 2^8 to 2^20 elements timed at 2 us + bytes / 20 GB/s (times ``scale``)."""
    events, ts = [], 0.0
    for k in range(8, 21, 2):
        dur = (2e-6 + 3 * 4 * (1 << k) / 20e9) * 1e6 * scale
        args = {"Input Dims": [[1 << k], [1 << k], []], "Input type": ["float", "float", "Scalar"],
                "Concrete Inputs": ["", "", "1"]}  # fmt: skip
        for _ in range(2):
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": ts,
                           "dur": dur, "args": args})  # fmt: skip
            ts += dur + 1
    path = Path(tempfile.mkdtemp()) / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _recovered(fit: calibrate.Fit) -> None:
    assert fit.alpha == pytest.approx(7e-6, rel=1e-6) and fit.bandwidth == pytest.approx(25e9, rel=1e-6)


CASES: list[Case] = [
    Case(
        "calibrate-not-nccl-tests",
        "a CSV handed to simdist calibrate",
        lambda: _text("size,time\n8,12.5\n"),
        error=CalibrationError,
        match=r"run.txt: not nccl-tests output: no '#  size  count  type",
    ),
    Case(
        "calibrate-empty-file",
        "an empty file",
        lambda: _text(""),
        error=CalibrationError,
        match=r"not nccl-tests output",
    ),
    Case(
        "calibrate-algbw-edited",
        "a table whose time was edited (algbw no longer size / time)",
        lambda: _text(H20.replace("  121.33  138.28", "  12.33  138.28")),
        error=CalibrationError,
        match=r"run.txt:\d+: size 16777216 B in 12.33 us is .* but the row's algbw is 138.28",
    ),
    Case(
        "calibrate-row-cut",
        "a row cut short (a terminal's line limit)",
        lambda: _text(
            H20.replace("   700.25  191.67  335.43       0   701.01  191.46  335.06       0", "   700.25")
        ),
        error=CalibrationError,
        match=r"run.txt:\d+: 6 columns where the header names 13",
    ),
    Case(
        "calibrate-separate-runs",
        "nccl-tests without MPI launched by mpirun: every process is rank 0",
        lambda: _text(H20.replace("#  Rank  1 Group", "#  Rank  0 Group")),
        error=CalibrationError,
        match=r"rank 0 is listed twice: this is the output of several separate runs",
    ),
    Case(
        "calibrate-one-size",
        "an nccl-tests run of one size (-b 1G -e 1G)",
        lambda: calibrate.fit([s for s in calibrate.parse_nccl_tests(H20, "run.txt") if s.nbytes == 1 << 30]),
        error=CalibrationError,
        match=r"1 distinct non-zero size \(1073741824 bytes\); .* at least 3",
    ),
    Case(
        "calibrate-no-input",
        "simdist calibrate with no input and no --measure",
        lambda: _cli(),
        error=CalibrationError,
        match=r"give nccl-tests output files, real timeline directories, --measure, or --compute TRACE.json",
    ),
    Case(
        "calibrate-missing-file",
        "simdist calibrate on a file that does not exist",
        lambda: _cli("/nonexistent/all_reduce.txt"),
        error=CalibrationError,
        match=r"/nonexistent/all_reduce.txt: cannot be read",
    ),
    Case(
        "calibrate-compute-one-kernel",
        "simdist calibrate --compute on a trace of one matmul (the HTA trace profile replay's tests use)",
        lambda: _cli("--compute", str(ONE_MM), "--device", "A100", "--cluster", "dgx-a100"),
        error=CalibrationError,
        match=r"hta_backward_thread.json: too few usable kernels: 1 ops priced \(0 without FLOPs",
    ),
    Case(
        "calibrate-compute-nanoseconds",
        "a profiler trace whose durations are nanoseconds where Kineto writes microseconds",
        lambda: calibrate.fit_device(_trace(scale=1e3)),
        error=CalibrationError,
        match=r"trace.json: the fit gives memory bandwidth .* which no device reaches: the trace's durations are "
        r"not in microseconds",
    ),
    Case(
        "calibrate-compute-cpu-trace-as-gpu",
        "a CPU-only profiler trace fitted onto an H100",
        lambda: _cli("--compute", str(_trace()), "--device", "H100", "--cluster", "dgx-h100"),
        error=CalibrationError,
        match=r"trace.json is a CPU trace \(no GPU kernels in it\): it fits this machine's CPU, not a H100",
    ),
    Case(
        "calibrate-compute-no-cluster",
        "simdist calibrate --compute with neither network measurements nor --cluster",
        lambda: _cli("--compute", str(_trace())),
        error=CalibrationError,
        match=r"fits a device, and a cluster file needs a network too: .* \(--cluster dgx-a100",
    ),
    Case(
        "calibrate-compute-recovers",
        "a CPU trace whose times a 20 GB/s, 2 us device made",
        lambda: calibrate.fit_device(_trace()).device,
        check=lambda d: (
            (d.memory_bandwidth == pytest.approx(20e9, rel=0.01))
            and (d.launch_overhead == pytest.approx(2e-6, rel=0.01))
        ),
    ),
    Case(
        "calibrate-exact-times",
        "times made by the model itself, at 5 ranks (not a power of two)",
        lambda: calibrate.fit(_exact(5)),
        check=_recovered,
    ),
    Case(
        "calibrate-gloo-all-to-all",
        "an all-to-all sweep fitted under the gloo model (which has no all-to-all of its own)",
        lambda: calibrate.fit(_exact_all_to_all(), collective_model="gloo"),
        check=_recovered,
    ),
    Case(
        "calibrate-shared-medium-4-ranks",
        "a shared medium asked of four ranks' measurements",
        lambda: calibrate.fit(_exact(4), collective_model="gloo", medium="shared"),
        error=CalibrationError,
        match="a shared medium is fitted on 2 ranks.*medium='switch'",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
