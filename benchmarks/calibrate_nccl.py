"""simdist calibrate on published nccl-tests tables: NCCL's model fitted on half the sizes predicts the other half.

Prints figures; it is not a test. Usage: ``python benchmarks/calibrate_nccl.py``.

Each table of ``benchmarks/fidelity/collectives.csv`` with a sweep of sizes (an H200 node, an A100 node, two H100
nodes) is split by size: every other row is fitted (``simdist.calibrate.fit_nccl``), and the rows in between
are predicted by NCCL's model as transcribed and by the fitted one. nccl-tests' time is used where the table
prints it, else the size over the algbw its busbw gives.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from simdist import calibrate
from simdist.calibrate import Sample
from simdist.calibrate.fit import BANDS
from simdist.calibrate.nccl_model import nccl_cluster, predict

TABLES = Path(__file__).resolve().parent / "fidelity" / "collectives.csv"
#: the tables with a sweep of sizes, and the device each is fitted on
SWEEPS = {"h200-1node": "H200", "a100-1node": "A100", "h100-2node": "H100"}


def samples(name: str) -> list[Sample]:
    """A table's rows as samples, by size."""
    out = []
    for row in csv.DictReader(TABLES.open()):
        if row["table"] != name:
            continue
        n, size = int(row["gpus"]), int(row["size_bytes"])
        if row["time_us"]:
            seconds = float(row["time_us"].lstrip("~")) * 1e-6
        else:  # all-reduce's busbw is its algbw times 2(n-1)/n
            seconds = size / (float(row["busbw_gbps"]) * 1e9 * n / (2 * (n - 1)))
        out.append(Sample(row["collective"], size, n, seconds, f"{name}: {size} B", int(row["nodes"])))
    return sorted(out, key=lambda s: s.nbytes)


def band(nbytes: int) -> str:
    """The residual band of a size."""
    return [label for label, low in BANDS if nbytes >= low][-1]


def main() -> None:
    """Fit, predict, print."""
    for name, device in SWEEPS.items():
        rows = samples(name)
        seen, held_out = rows[0::2], rows[1::2]
        n, nodes = rows[0].ranks, rows[0].nodes
        fit = calibrate.fit_nccl(seen, device, name)
        print(fit.report())
        ranks = list(range(n))
        plain = predict(nccl_cluster(device, n, nodes, name).nccl_fabric(ranks), held_out)
        fitted = predict(fit.cluster.nccl_fabric(ranks), held_out)
        print(f"held out ({len(held_out)} sizes): |error| of NCCL's model as transcribed -> fitted")
        print(f"  {'band':<16} {'sizes':>5} {'median':>17} {'max':>17}")
        for label in [*(b for b, _ in BANDS), "all"]:
            idx = [i for i, s in enumerate(held_out) if label in ("all", band(s.nbytes))]
            if not idx:
                continue
            before = [abs(plain[i].seconds / held_out[i].seconds - 1) for i in idx]
            after = [abs(fitted[i].seconds / held_out[i].seconds - 1) for i in idx]
            print(f"  {label:<16} {len(idx):>5} {statistics.median(before):>7.1%} -> {statistics.median(after):>6.1%} "
                  f"{max(before):>7.1%} -> {max(after):>6.1%}")  # fmt: skip
        print()


if __name__ == "__main__":
    main()
