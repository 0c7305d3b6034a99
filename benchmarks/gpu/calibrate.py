"""The device figures a compute measurement supports: ``python benchmarks/gpu/calibrate.py RESULTS_DIR``.

The rule simdist's corrected presets follow (simdist/compute/devices.py quotes it in each device's source):

- a matmul rate per dtype (bf16, fp16, fp32 with TF32 off, tf32): the median achieved FLOP/s of the large
  matmuls, the ``mm`` cases of at least 2 * 4096**3 FLOPs, whose time the tensor cores' sustained rate sets
  rather than launches or memory;
- the memory bandwidth: the median achieved bandwidth of the elementwise cases at the largest size measured,
  the bytes an ideal kernel moves (inputs read once, output written once) over the time.

Each figure is rounded to three significant digits, as the presets hold them. Needs the standard library only.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: FLOPs from which a matmul counts as large: a 4096-cube and up
LARGE_MATMUL_FLOPS = 2 * 4096**3
#: the matmul dtypes the rule gives a rate for (compute.py's labels)
MATMUL_DTYPES = ("bf16", "fp16", "fp32", "tf32")


def significant(x: float, digits: int = 3) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits - 1}e}")


def matmul_samples(records: Sequence[dict[str, Any]], dtype: str) -> list[float]:
    """The achieved FLOP/s of each large ``mm`` case in ``dtype`` (a compute.py label)."""
    return [
        r["flops"] / r["median_s"]
        for r in records
        if r["op"] == "mm" and r["dtype"] == dtype and r["flops"] >= LARGE_MATMUL_FLOPS
    ]


def bandwidth_samples(records: Sequence[dict[str, Any]]) -> list[float]:
    """The achieved bytes/s of each elementwise case at the largest element count measured."""
    elementwise = [r for r in records if r["class"] == "elementwise"]
    largest = max(r["shape"]["n"] for r in elementwise)
    return [r["bytes"] / r["median_s"] for r in elementwise if r["shape"]["n"] == largest]


def figures(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The rule's figures, rounded as the presets hold them: FLOP/s per matmul dtype label, and "bandwidth"."""
    out = {
        dtype: significant(statistics.median(samples))
        for dtype in MATMUL_DTYPES
        if (samples := matmul_samples(records, dtype))
    }
    out["bandwidth"] = significant(statistics.median(bandwidth_samples(records)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the figures of ``RESULTS_DIR/compute.json``, each beside the values it is the median of."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    data = json.loads((Path(args[0]) / "compute.json").read_text())
    records = data["records"]
    print(
        f"# {data['meta'].get('device')}: figures by the rule of calibrate.py (the median of the values shown)"
    )
    for dtype, value in figures(records).items():
        if dtype == "bandwidth":
            shown = ", ".join(f"{b / 1e9:.0f}" for b in sorted(bandwidth_samples(records)))
            print(f"memory bandwidth {value / 1e12:.3g} TB/s    (GB/s: {shown})")
        else:
            shown = ", ".join(f"{f / 1e12:.1f}" for f in sorted(matmul_samples(records, dtype)))
            print(f"matmul {dtype} {value / 1e12:.3g} TFLOP/s    (TFLOP/s: {shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
