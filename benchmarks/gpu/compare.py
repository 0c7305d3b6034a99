"""Measured on a GPU against simdist's predictions: ``python benchmarks/gpu/compare.py RESULTS_DIR [--device H100]``.

Reads the JSON files run_all.sh wrote and prints Markdown, the results section of docs/gpu-measurements.md shows it as printed
(tests/test_gpu_results.py checks that for the kept H100 run):

- compute: each op's measured time (CUDA events, the median) beside simdist's roofline time for the same op on
  the device preset, the error (simdist / measured - 1), and per op class the median and worst error;
- memory: ``max_memory_allocated()`` after each phase of the block's training step beside simdist's peak for
  the step cut after that phase (``simdist.run(..., memory=True)``);
- program: the GPU-style program's loss per step, event time per step and peak memory beside the same job
  simulated at world size 1 (twin_program.py), and how far the losses and final parameters differ.

Runs on a CPU machine with simdist installed; the preset follows the measured device's name unless
``--device`` names one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from memory import PHASES
from model import BlockShape
from ops import by_id
from predict import launch_overhead, memory_peak, op_seconds, preset_for, simulate_program
from training import Job

#: relative difference of losses and checksums within which GPU kernels and the CPU count as equal
RESULT_TOLERANCE = 1e-3


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    """The JSON file ``name`` of ``folder``, or None if the section wrote none."""
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def _error(predicted: float, measured: float) -> float:
    """simdist / measured - 1: positive when simdist is slower (or larger) than the measurement."""
    return predicted / measured - 1 if measured > 0 else math.nan


def _pct(x: float) -> str:
    """``x`` as a signed percentage ("n/a" for NaN)."""
    return "n/a" if math.isnan(x) else f"{x * 100:+.0f}%"


def _class_of(record: dict[str, Any]) -> str:
    """Matmuls are split by dtype (each has its own peak); other classes are one row each."""
    return f"matmul {record['dtype']}" if record["class"] == "matmul" else record["class"]


def compare_compute(data: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """Print the per-op and per-class tables; return the rows."""
    catalogue = by_id(bool(data["meta"].get("dry_run")))
    overhead = launch_overhead(device)
    rows = []
    print(f"\n#### Compute: measured vs simdist's roofline on the {device} preset\n")
    print("| op | measured (us) | back to back (us) | simdist (us) | kernels | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for record in data["records"]:
        case = catalogue.get(record["id"])
        if case is None:
            print(f"| {record['id']} | not in ops.py | | | | |")
            continue
        predicted, kernels = op_seconds(case, device)
        error = _error(predicted, record["median_s"])
        rows.append({**record, "predicted_s": predicted, "kernels": kernels, "error": error})
        print(
            f"| {record['id']} | {record['median_s'] * 1e6:.1f} | {record['loop_s'] * 1e6:.1f} | "
            f"{predicted * 1e6:.1f} | {kernels} | {_pct(error)} |"
        )
    print(
        f"\nsimdist adds {overhead * 1e6:g} us of launch overhead per kernel; `measured` is the kernels' time"
        " with the calls queued ahead, `back to back` the time per call with host launches included.\n"
    )
    print("| op class | ops | median error | worst error |")
    print("|---|---:|---:|---:|")
    classes: dict[str, list[float]] = {}
    for row in rows:
        classes.setdefault(_class_of(row), []).append(row["error"])
    for name, errors in classes.items():
        worst = max(errors, key=abs)
        median = statistics.median(abs(e) for e in errors)
        print(f"| {name} | {len(errors)} | {median * 100:.0f}% | {_pct(worst)} |")
    return rows


def compare_memory(data: dict[str, Any], device: str) -> None:
    """Print measured vs simulated peaks per configuration and phase."""
    print(f"\n#### Memory: max_memory_allocated vs simdist's peak (MiB), {device} preset\n")
    print("| block | dtype | phase | measured | simdist | error |")
    print("|---|---|---|---:|---:|---:|")
    for record in data["records"]:
        shape = BlockShape(**record["shape"])
        for phase in PHASES:
            measured = record["peak_bytes"].get(phase)
            predicted = memory_peak(shape, record["dtype"], phase, device)
            cell = "not measured" if measured is None else f"{measured / 2**20:.1f}"
            error = _pct(_error(predicted, measured)) if measured else "n/a"
            print(
                f"| {shape.label} | {record['dtype']} | {phase} | {cell} | {predicted / 2**20:.1f} | {error} |"
            )


def compare_program(data: dict[str, Any], device: str) -> None:
    """Print the GPU program's run beside the simulated twin at world size 1."""
    job = Job(**data["meta"]["job"])
    sim = simulate_program(job, device)
    for real_run in data["records"]:
        print(
            f"\n#### Program: {real_run['program']} on {real_run['device']} vs simdist ({device} preset), world size 1\n"
        )
        print("| step | loss (measured) | loss (simdist) | step ms (measured) | step ms (simdist) |")
        print("|---:|---:|---:|---:|---:|")
        for i, (loss, sim_loss, t, sim_t) in enumerate(
            zip(real_run["losses"], sim["losses"], real_run["step_s"], sim["step_s"])
        ):
            print(f"| {i} | {loss:.6f} | {sim_loss:.6f} | {t * 1e3:.3f} | {sim_t * 1e3:.3f} |")
        loss_diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(real_run["losses"], sim["losses"]))
        sum_diff = abs(real_run["checksum"] - sim["checksum"]) / max(abs(real_run["checksum"]), 1e-12)
        verdict = "equal" if max(loss_diff, sum_diff) <= RESULT_TOLERANCE else "DIFFERENT"
        print(
            f"\nlargest relative loss difference {loss_diff:.2e}; parameter checksum difference {sum_diff:.2e}: "
            f"{verdict} within {RESULT_TOLERANCE:g}"
        )
        steady = slice(1, None) if len(real_run["step_s"]) > 1 else slice(None)
        measured_ms = statistics.median(real_run["step_s"][steady]) * 1e3
        sim_ms = statistics.median(sim["step_s"][steady]) * 1e3
        print(
            f"median step after the first: measured {measured_ms:.3f} ms, simdist {sim_ms:.3f} ms "
            f"({_pct(_error(sim_ms, measured_ms))})"
        )
        peak = real_run["peak_bytes"]
        measured_peak = "not measured" if peak is None else f"{peak / 2**20:.1f} MiB"
        print(f"peak memory: measured {measured_peak}, simdist {sim['peak_bytes'] / 2**20:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    """Print every table for the results folder; 0, or 2 when it holds no results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="the folder run_all.sh wrote ($OUT)")
    p.add_argument("--device", default=None, help="simdist device preset (default: from the measured device)")
    options = p.parse_args(argv)
    found = {
        name: _load(options.results, f"{name}.json") for name in ("real_nccl", "compute", "memory", "program")
    }
    if not any(found.values()):
        print(f"compare.py: no result files in {options.results}", file=sys.stderr)
        return 2
    meta = next(d["meta"] for d in found.values() if d)
    device = options.device or preset_for(meta.get("device"))
    print(
        f"Measured on {meta.get('device')} (driver {meta.get('driver')}, torch {meta.get('torch')}, "
        f"CUDA {meta.get('cuda')}, NCCL {meta.get('nccl')}, Python {meta.get('python')}) vs simdist's {device} preset"
    )
    if found["real_nccl"]:
        nccl = found["real_nccl"]
        failed = [r["check"] for r in nccl["records"] if not r["ok"]]
        print(
            f"\n`real` on {nccl['meta']['backend']}: {len(nccl['records']) - len(failed)} of "
            f"{len(nccl['records'])} checks passed" + (f"; failed: {', '.join(failed)}" if failed else "")
        )
    if found["compute"]:
        compare_compute(found["compute"], device)
    if found["memory"]:
        compare_memory(found["memory"], device)
    if found["program"]:
        compare_program(found["program"], device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
