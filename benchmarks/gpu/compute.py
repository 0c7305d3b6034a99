"""Time the ops simdist's cost model prices, on this machine's GPU: ``compute.json``.

``python benchmarks/gpu/compute.py [--out DIR] [--dry-run]``. Each case of ``ops.py`` runs a few times to warm
up, then ``reps`` times, each between its own pair of CUDA events with the calls queued ahead of the device
(``median_s``: the kernels' time), and ``reps`` times back to back (``loop_s``: per call, host launches
included). Inputs rotate over as many copies as it takes to exceed the L2 cache, so a call does not find
its operands cached by the previous one. Records are saved as they are measured.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from common import Results, device, host_seconds, loop_seconds, machine, median_seconds, parser, summary
from ops import OpCase, cases, precision

#: bytes of input copies to rotate over: twice the H100's 50 MB L2, so each call starts with a cold cache
ROTATE_BYTES = 128 << 20
MAX_COPIES = 64
#: wall seconds of timed calls to aim for per case (the repeat count follows from a first timing)
CASE_SECONDS = 0.15
MAX_REPS = 100
#: calls shorter than this (seconds) are timed with the device queue filled first (common.median_seconds)
QUEUE_BELOW = 1e-3


def _nbytes(inputs: tuple) -> int:
    """Bytes of the tensors and module parameters in one input set."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    modules = [m for m in inputs if isinstance(m, torch.nn.Module)]
    params = [p for m in modules for p in m.parameters()]
    return sum(t.numel() * t.element_size() for t in tensors + params)


def measure(case: OpCase, dev: torch.device, dry_run: bool) -> dict:
    """Warm up, time and return one case's record."""
    first = case.make(dev, 0)
    copies = 1 if dry_run else max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(1, _nbytes(first)))))
    inputs = [first] + [case.make(dev, 100 * i) for i in range(1, copies)]

    def call(i: int) -> None:
        """The op once, on input set ``i`` (rotating)."""
        case.run(inputs[i % copies])

    with precision(case.dtype):
        for i in range(3):
            call(i)
        host = host_seconds(call, 3)
        guess = statistics.median(median_seconds(call, 3, dev))
        reps = 3 if dry_run else max(10, min(MAX_REPS, int(CASE_SECONDS / max(guess, host, 1e-6))))
        # Queued behind a sleep only where launch gaps would show: calls of a millisecond or more hide them.
        times = median_seconds(call, reps, dev, host if guess < QUEUE_BELOW else None)
        loop = loop_seconds(call, reps, dev)
    return {
        "id": case.id,
        "class": case.cls,
        "op": case.op,
        "dtype": case.dtype,
        "shape": case.shape,
        **summary(times),
        "loop_s": loop,
        "host_s": host,
        "reps": reps,
        "copies": copies,
        "flops": case.flops,
        "bytes": case.bytes,
    }


def main() -> None:
    """Measure every case of ops.py and write compute.json."""
    options = parser(__doc__.splitlines()[0]).parse_args()
    dev = device()
    results = Results(options.out / "compute.json", {**machine(), "dry_run": options.dry_run})
    all_cases = cases(options.dry_run)
    start = time.perf_counter()
    for n, case in enumerate(all_cases, 1):
        with results.guard(case.id):
            record = measure(case, dev, options.dry_run)
            results.add(record)
            rate = f"{case.flops / record['median_s'] / 1e12:7.1f} TFLOP/s" if case.flops else ""
            if not case.flops and case.bytes:
                rate = f"{case.bytes / record['median_s'] / 1e9:7.0f} GB/s"
            print(
                f"[{n}/{len(all_cases)}] {case.id:48s} {record['median_s'] * 1e6:11.1f} us  {rate}",
                flush=True,
            )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"compute: {len(results.data['records'])} cases, {len(results.data['errors'])} errors, "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
