"""The H100 measurement kept in benchmarks/gpu/results: the H100 and H200 presets follow from it by the stated rule,
and docs/gpu-measurements.md shows what compare.py prints for it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from simdist.compute import get_device

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
RESULTS = GPU / "results" / "h100-2026-11-26"
sys.path.insert(0, str(GPU))

import calibrate
import compare
from ops import by_id
from predict import op_seconds

H100 = get_device("H100")
H200 = get_device("H200")
#: the H100 SXM datasheet's HBM bandwidth, the reference the H200's unmeasured bandwidth is scaled by
H100_DATASHEET_BANDWIDTH = 3.35e12


def measured() -> list[dict]:
    """The compute records of the kept measurement."""
    return json.loads((RESULTS / "compute.json").read_text())["records"]


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
    assert "not measured on an H200" in H200.source and "3.02/3.35" in H200.source


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


def assert_shown_in_order(lines: list[str]) -> None:
    """Every line appears in docs/gpu-measurements.md as a whole line, in the order printed (prose may come between)."""
    doc = DOCS.read_text().splitlines()
    at = 0
    for line in lines:
        assert line in doc[at:], (
            f"docs/gpu-measurements.md does not show, after its line {at}, what compare.py prints:\n{line}"
        )
        at += doc[at:].index(line) + 1


def section(name: str) -> dict:
    """One JSON file of the kept measurement."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_the_docs_show_the_compute_and_memory_tables_compare_prints() -> None:
    # The op, class and memory tables as this version of simdist predicts them; the program's part, which
    # simulates a training run, is the slow test below.
    assert_shown_in_order(printed(lambda: compare.compare_compute(section("compute"), "H100")))
    assert_shown_in_order(printed(lambda: compare.compare_memory(section("memory"), "H100")))


@pytest.mark.slow
def test_the_docs_show_everything_compare_prints() -> None:
    assert_shown_in_order(printed(lambda: compare.main([str(RESULTS)])))


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
