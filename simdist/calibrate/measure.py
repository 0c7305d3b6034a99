"""A sweep of collectives over sizes timed on real gloo processes of this machine (``simdist calibrate
--measure``): ``python -m real.sweep`` runs in a child process, so the simulator never imports the launcher."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from simdist.calibrate.samples import CalibrationError, Sample

#: what the sweep times by default: the collectives of data-parallel training, 8 B to 2 MiB, x4 apart
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
SIZES = tuple(8 << (2 * k) for k in range(10))
#: timed calls per size (after ``WARMUP`` untimed ones)
ITERS = 15
WARMUP = 3


def measure(
    ranks: int = 2,
    collectives: Sequence[str] = COLLECTIVES,
    sizes: Sequence[int] = SIZES,
    iters: int = ITERS,
    warmup: int = WARMUP,
    timeout: float = 600.0,
) -> list[Sample]:
    """Time ``collectives`` at ``sizes`` (bytes) on ``ranks`` real gloo processes of this machine."""
    command = [sys.executable, "-m", "real.sweep", "--ranks", str(ranks), "--collectives", ",".join(collectives),
               "--sizes", ",".join(map(str, sizes)), "--iters", str(iters), "--warmup", str(warmup)]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise CalibrationError(
            f"the sweep on {ranks} real processes did not finish in {timeout:g} s"
        ) from None
    if done.returncode != 0:
        raise CalibrationError(f"the sweep on {ranks} real processes failed (exit {done.returncode}):\n"
                               f"{done.stderr.strip()[-2000:]}")  # fmt: skip
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return [Sample(c, int(b), ranks, float(s), f"--measure: {c} of {b} B") for c, b, s in data["rows"]]
