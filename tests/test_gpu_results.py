"""The GPU measurements kept in benchmarks/gpu/results: the H100 and H200 presets follow from the H100's by the
stated rule, the two H200 runs agree with the H200 preset, and docs/gpu-measurements.md shows what compare.py and
summary.py print for them."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from simdist.compute import get_device

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
RESULTS = GPU / "results" / "h100-2026-11-26"
#: the H200 run (run_all.sh), and a second H200 machine's compute.py and memory_trace.py
RESULTS_H200 = GPU / "results" / "h200-2026-11-27"
SECOND_H200 = RESULTS_H200 / "second-machine"
sys.path.insert(0, str(GPU))

import calibrate
import compare
import summary
from ops import by_id
from predict import op_seconds

H100 = get_device("H100")
H200 = get_device("H200")
#: the H100 SXM datasheet's HBM bandwidth, the reference the H200's unmeasured bandwidth is scaled by
H100_DATASHEET_BANDWIDTH = 3.35e12


def measured(folder: Path = RESULTS) -> list[dict]:
    """The compute records of a kept measurement (the H100's unless ``folder`` names another)."""
    return json.loads((folder / "compute.json").read_text())["records"]


def test_the_h100_preset_is_what_the_rule_gives_for_the_measurement() -> None:
    rule = calibrate.figures(measured())
    assert rule == {
        "bf16": H100.flops_for(torch.bfloat16),
        "fp16": H100.flops_for(torch.float16),
        "fp32": H100.flops_for(torch.float32),
        "tf32": H100.tf32_flops,
        "bandwidth": H100.memory_bandwidth,
    }
    # the source quotes each figure and where it came from
    assert "benchmarks/gpu/results/h100-2026-11-26" in H100.source
    for figure in ("688 TF", "643 TF", "51.3 TF", "363 TF", "3.02 TB/s"):
        assert f"-> {figure}" in H100.source, figure


def test_the_h200_shares_the_h100s_compute_and_scales_its_datasheet_bandwidth() -> None:
    assert dict(H200.peak_flops) == dict(H100.peak_flops) and H200.tf32_flops == H100.tf32_flops
    assert H200.memory_bandwidth == pytest.approx(4.8e12 * H100.memory_bandwidth / H100_DATASHEET_BANDWIDTH)
    assert "3.02/3.35" in H200.source and "benchmarks/gpu/results/h200-2026-11-27" in H200.source


@pytest.mark.parametrize("folder", [RESULTS_H200, SECOND_H200], ids=["first", "second"])
def test_both_h200_machines_give_the_h200_preset_within_three_percent(folder: Path) -> None:
    # The rule applied to an H200's own measurement, against the preset inferred from the H100: the compute rates
    # of the same die within the spread of two runs, and the scaled datasheet bandwidth within 1%.
    rule = calibrate.figures(measured(folder))
    preset = {
        "bf16": H200.flops_for(torch.bfloat16),
        "fp16": H200.flops_for(torch.float16),
        "fp32": H200.flops_for(torch.float32),
        "tf32": H200.tf32_flops,
    }
    for dtype, rate in preset.items():
        assert rule[dtype] == pytest.approx(rate, rel=0.035), dtype
    assert rule["bandwidth"] == pytest.approx(H200.memory_bandwidth, rel=0.01)
    # the figures the source quotes for this machine
    column = 0 if folder == RESULTS_H200 else 1
    for dtype, quoted in (
        ("bf16", "667/688"),
        ("fp16", "631/627"),
        ("fp32", "50.9/50.7"),
        ("TF32", "359/358"),
    ):
        assert f"{dtype} {quoted}" in H200.source
        assert calibrate.significant(rule[dtype.lower()] / 1e12) == float(quoted.split("/")[column]), dtype
    assert calibrate.significant(rule["bandwidth"] / 1e12) == (4.31, 4.33)[column]


def test_the_rule_takes_the_median_of_the_large_matmuls_and_of_the_largest_elementwise_ops() -> None:
    def mm(dtype: str, n: int, seconds: float) -> dict:
        return {"op": "mm", "class": "matmul", "dtype": dtype, "flops": 2.0 * n**3, "median_s": seconds}

    def ew(n: int, nbytes: float, seconds: float) -> dict:
        return {"op": "add", "class": "elementwise", "shape": {"n": n}, "bytes": nbytes, "median_s": seconds}

    big = 2.0 * 4096**3
    records = [
        mm("bf16", 4096, big / 700e12),
        mm("bf16", 4096, big / 600e12),
        mm("bf16", 8192, 8 * big / 650e12),
        mm("bf16", 2048, 1.0),  # below 2 * 4096**3 FLOPs: not part of the rule
        ew(1 << 20, 1e9, 1.0),  # not the largest size
        ew(1 << 27, 3e12, 1.0),
        ew(1 << 27, 2e12, 1.0),
    ]
    assert calibrate.figures(records) == {"bf16": pytest.approx(650e12), "bandwidth": 2.5e12}
    assert calibrate.significant(3024.92e9) == 3.02e12 and calibrate.significant(51.2689e12) == 51.3e12


DOCS = Path(__file__).resolve().parents[1] / "docs" / "gpu-measurements.md"


def printed(call: Callable[[], object]) -> list[str]:
    """The non-empty lines ``call`` prints."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        call()
    return [line for line in buffer.getvalue().splitlines() if line.strip()]


#: printed lines whose figures are this CPU's round-off (the simulated twin's parameters, summed by the CPU kernels
#: torch picks for the machine): shown with the figures of the machine the docs were written on
ROUND_OFF = re.compile(r"largest relative loss difference .*; parameter checksum difference .*: ")
_FIGURE = re.compile(r"\d\.\d\de[-+]\d\d")
#: a row of a program's table: step, measured loss, the twin's loss (this CPU's round-off), measured and simulated ms
PROGRAM_ROW = re.compile(r"\| (\d+) \| (\d+\.\d{6}) \| (\d+\.\d{6}) \| (\d+\.\d{3}) \| (\d+\.\d{3}) \|")
#: how far the twin's loss may move with the CPU's kernels (relative): float32 round-off over a few steps
LOSS_ROUND_OFF = 1e-5


def _shows(doc_line: str, line: str) -> bool:
    """Whether ``doc_line`` shows printed ``line``: round-off figures as any figure of the same form, the twin's
    loss in a program's row to within :data:`LOSS_ROUND_OFF`, everything else as printed."""
    if ROUND_OFF.match(line):
        pattern = _FIGURE.pattern.join(re.escape(part) for part in _FIGURE.split(line))
        return re.fullmatch(pattern, doc_line) is not None
    row, shown = PROGRAM_ROW.fullmatch(line), PROGRAM_ROW.fullmatch(doc_line)
    if row is None or shown is None:
        return doc_line == line
    same = all(row.group(i) == shown.group(i) for i in (1, 2, 4, 5))
    twin, doc_twin = float(row.group(3)), float(shown.group(3))
    return same and abs(twin - doc_twin) <= LOSS_ROUND_OFF * abs(doc_twin)


def assert_shown_in_order(lines: list[str], after: str | None = None) -> None:
    """Every line appears in docs/gpu-measurements.md as a whole line, in the order printed (prose may come between),
    below the line ``after`` when given (a run's heading: the H100's and the H200's tables share many lines); the
    twin's results, this CPU's round-off, as :func:`_shows` compares them."""
    doc = DOCS.read_text().splitlines()
    at = doc.index(after) + 1 if after is not None else 0
    for line in lines:
        found = next((i for i, d in enumerate(doc[at:]) if _shows(d, line)), None)
        assert found is not None, (
            f"docs/gpu-measurements.md does not show, after its line {at}, what compare.py prints:\n{line}"
        )
        at += found + 1


def test_round_off_lines_match_only_lines_of_their_form() -> None:
    line = "largest relative loss difference 1.12e-07; parameter checksum difference 5.50e-07: equal within 0.001"
    assert _shows(line.replace("5.50e-07", "6.39e-07"), line)
    assert not _shows(line.replace("equal", "DIFFERENT"), line)
    assert not _shows(line.replace("5.50e-07", "5.5e-07"), line)
    assert not _shows("| 0 | 1.000000 |", "| 0 | 1.000001 |")
    row = "| 7 | 8.512009 | 8.512010 | 3.593 | 3.873 |"
    assert _shows(row, row.replace("8.512010", "8.512008"))  # the twin's loss under another CPU's kernels
    assert not _shows(row, row.replace("8.512010", "8.513010"))
    assert not _shows(row, row.replace("8.512009 |", "8.512008 |"))  # the measured loss, as printed
    assert not _shows(row, row.replace("3.873", "3.874"))  # the simulated time: no round-off of data in it


#: each kept run, its device preset and the docs heading its tables sit under
RUNS = {
    "h100": (RESULTS, "H100", "### H100 SXM, 26 November 2026"),
    "h200": (RESULTS_H200, "H200", "### H200 SXM, 27 November 2026"),
}


def section(name: str, folder: Path = RESULTS) -> dict:
    """One JSON file of a kept measurement."""
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.parametrize("run", RUNS)
def test_the_docs_show_the_compute_and_memory_tables_compare_prints(run: str) -> None:
    # The op, class and memory tables as this version of simdist predicts them; the program's part, which
    # simulates a training run, is the slow test below.
    folder, device, heading = RUNS[run]
    assert_shown_in_order(
        printed(lambda: compare.compare_compute(section("compute", folder), device)), heading
    )
    assert_shown_in_order(printed(lambda: compare.compare_memory(section("memory", folder), device)), heading)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_the_docs_show_everything_compare_prints(run: str) -> None:
    folder, _, heading = RUNS[run]
    assert_shown_in_order(printed(lambda: compare.main([str(folder)])), heading)


def test_the_docs_show_what_is_live_at_the_gpu_programs_peak() -> None:
    trace = section("memory_trace", RESULTS_H200 / "third-machine")
    heading = "#### Program: gpu_program on NVIDIA H200 vs simdist (H200 preset), world size 1"
    program = next(r for r in trace["records"] if "program" in r)  # after the blocks, traced again there
    assert_shown_in_order(printed(lambda: summary.memory_trace({"records": [program]})), heading)
    labels = [summary.allocating_op(b["frames"]) for b in program["live_at_peak"]]
    sizes = [b["size"] for b in program["live_at_peak"]]
    # what the docs say is not the program's tensors: the two cuBLAS workspaces, cuBLASLt's, the reduction's scratch
    not_tensors = sum(s for s, label in zip(sizes, labels, strict=True) if ", scratch of " in label)
    assert round(not_tensors / 2**20) == 97
    assert f"{(program['replayed_peak'] - not_tensors) / 2**20:.1f}" == "141.9"


def test_the_docs_show_what_is_live_at_the_h200s_backward_peak() -> None:
    trace = section("memory_trace", SECOND_H200)
    assert_shown_in_order(
        printed(lambda: summary.memory_trace(trace)), "#### What is live at the backward peak"
    )
    fp32 = next(r for r in trace["records"] if r["dtype"] == "fp32")
    # the replayed peak is the allocator's own (to its rounding of a few small blocks to 512 bytes), and less the
    # reduction's staging buffer it is simdist's peak for the same step, as compare.py prints it
    assert abs(fp32["replayed_peak"] - fp32["max_memory_allocated"]) < 4096
    scratch = [
        b
        for b in fp32["live_at_peak"]
        if "scratch of at::native::gpu_reduce_kernel" in summary.allocating_op(b["frames"])
    ]
    # the kernel's staging buffer, and its few bytes of semaphores
    assert (
        max(b["size"] for b in scratch) == 64 * 2**20 and sum(b["size"] for b in scratch) < 64 * 2**20 + 1024
    )
    simdist_peak = next(
        line
        for line in printed(lambda: compare.compare_memory(section("memory", RESULTS_H200), "H200"))
        if line.startswith("| d1024 h16 b8 s1024 | fp32 | backward |")
    )
    assert f"{(fp32['replayed_peak'] - scratch[0]['size']) / 2**20:.1f}" == simdist_peak.split("|")[5].strip()


def matmul_errors(device: object) -> dict[str, list[float]]:
    """simdist / measured - 1 of every matmul of the kept measurement on ``device``, by dtype label."""
    catalogue = by_id(False)
    errors: dict[str, list[float]] = {}
    for record in measured():
        if record["class"] == "matmul":
            predicted, _ = op_seconds(catalogue[record["id"]], device)
            errors.setdefault(record["dtype"], []).append(predicted / record["median_s"] - 1)
    return errors


def test_the_gemm_shape_model_follows_the_measured_matmuls_closer_than_the_roofline() -> None:
    model = matmul_errors(H100)
    roofline = matmul_errors(dataclasses.replace(H100, gemm=None))

    def median(errors: list[float]) -> float:
        return statistics.median(abs(e) for e in errors)

    # the medians and worst errors docs/compute.md reports, before and after the shape model
    assert {d: round(median(e) * 100) for d, e in roofline.items()} == {
        "fp32": 3,
        "tf32": 17,
        "bf16": 12,
        "fp16": 10,
    }
    assert {d: round(median(e) * 100) for d, e in model.items()} == {
        "fp32": 3,
        "tf32": 12,
        "bf16": 4,
        "fp16": 3,
    }
    assert round(max(abs(e) for e in itertools.chain(*roofline.values())) * 100) == 71
    assert round(max(abs(e) for e in itertools.chain(*model.values())) * 100) == 33
