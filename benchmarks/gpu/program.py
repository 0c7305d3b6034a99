"""Run the GPU-style training program through ``real`` at one rank and record what it saw: ``program.json``.

``python benchmarks/gpu/program.py [--out DIR] [--dry-run]``, with this repository on PYTHONPATH. On a GPU,
gpu_program.py runs unchanged through ``real.run(..., backend="nccl")`` at ``nproc=1``: its loss per step,
``torch.cuda.Event`` time per step, ``max_memory_allocated()`` and final parameter checksum. Without CUDA the
device-agnostic twin runs on the CPU through gloo instead (the same record, ``peak_bytes`` null), so the
script and compare.py can be checked on any machine.
"""

from __future__ import annotations

import time

import gpu_program
import torch
import twin_program
from common import Results, machine, parser
from training import DRY_JOB, JOB

import real


def main() -> None:
    """Run the program at one rank and write program.json."""
    options = parser(__doc__.splitlines()[0]).parse_args()
    job = DRY_JOB if options.dry_run else JOB
    results = Results(
        options.out / "program.json", {**machine(), "dry_run": options.dry_run, "job": job.as_dict()}
    )
    start = time.perf_counter()
    if torch.cuda.is_available():
        name, fn, backend, kwargs = "gpu_program", gpu_program.main, "nccl", {"job": job}
    else:
        name, fn, backend, kwargs = (
            "twin_program",
            twin_program.main,
            "gloo",
            {"job": job, "device": "cpu"},
        )
    with results.guard(name):
        result = real.run(
            fn, 1, backend=backend, kwargs=kwargs, timeout=75 if torch.cuda.is_available() else 240
        )
        record = {"program": name, "backend": result.backend, "wall_s": result.wall_time, **result.returns[0]}
        results.add(record)
        steps = ", ".join(f"{s * 1e3:.2f}" for s in record["step_s"])
        print(f"{name}: losses {[round(v, 4) for v in record['losses']]}", flush=True)
        print(
            f"  step ms {steps}; peak {record['peak_bytes']} bytes; checksum {record['checksum']!r}",
            flush=True,
        )
    print(
        f"program: {len(results.data['records'])} runs, {len(results.data['errors'])} errors, "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
