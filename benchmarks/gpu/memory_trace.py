"""What is live at the peak of a block's backward pass on a GPU, with where each buffer was allocated: ``memory_trace.json``.

``python benchmarks/gpu/memory_trace.py [--out DIR] [--dry-run]``. memory.py measures the peak after each phase
of a training step; this names the tensors that make it. For each configuration the step runs once untraced
(so that every thread's cuBLAS workspace exists before the trace starts), then again, forward and backward, under
``torch.cuda.memory._record_memory_history``; the allocator's trace is replayed to find the moment of the peak,
and every block live then is written with its size and the innermost frames (Python and C++) of its allocation.
The blocks allocated before the trace (the model, its inputs, the workspaces) are counted as the base.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import gpu_program
import torch
from common import Results, device, machine, parser
from memory import training_step
from model import BlockShape
from summary import allocating_op
from training import DRY_JOB, JOB, Job

import real

#: frames kept per allocation (innermost first), after dropping the allocator's and the recorder's own
FRAMES = 14
#: frames whose function names these are belong to the allocator or the recording, not to the op
_SKIP = (
    "CUDACachingAllocator",
    "record_memory_history",
    "gather_with_cpp",
    "CapturedTraceback",
    "c10::cuda::",
)


def configs(dry_run: bool) -> list[tuple[BlockShape, str]]:
    """(block shape, dtype) of each trace: fp32, whose peak simdist puts under the measured one, and bf16."""
    if dry_run:
        return [(BlockShape(64, 4, 2, 32), "fp32")]
    return [(BlockShape(1024, 16, 8, 1024), "fp32"), (BlockShape(1024, 16, 8, 1024), "bf16")]


def frames(event: dict[str, Any]) -> list[str]:
    """The innermost frames of an allocation, as 'function (file:line)', the allocator's own left out."""
    out = []
    for frame in event.get("frames", []):
        name = str(frame.get("name", "?"))
        if any(skip in name for skip in _SKIP):
            continue
        where = str(frame.get("filename", "")).rsplit("/", 1)[-1]
        out.append(f"{name[:200]} ({where}:{frame.get('line', 0)})")
        if len(out) == FRAMES:
            break
    return out


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, int, list[dict[str, Any]]]:
    """Replay the allocator's trace: (peak bytes above the trace's start, event index of the peak, blocks live then)."""
    live: dict[int, tuple[int, dict[str, Any]]] = {}
    current = peak = 0
    at = -1
    snapshot: dict[int, tuple[int, dict[str, Any]]] = {}
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (index, event)
            current += event["size"]
            if current > peak:
                peak, at, snapshot = current, index, dict(live)
        elif action == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])[1]["size"]
    blocks = [
        {"size": e["size"], "order": i, "frames": frames(e)}
        for i, e in sorted(snapshot.values(), key=lambda p: p[0])
    ]
    return peak, at, blocks


def peak_record(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """What a results record keeps of an allocator trace: its peak, when, how many events, and what was live."""
    peak, at, blocks = live_at_peak(trace)
    return {"replayed_peak": peak, "peak_event": at, "events": len(trace), "live_at_peak": blocks}


def trace_step(shape: BlockShape, dtype: str, dev: torch.device, stacks: str) -> dict[str, Any]:
    """The step's backward peak with the blocks live at it, and the allocator's own peak for comparison."""
    training_step(shape, dtype, dev, "second step")  # untraced: every thread's workspace exists from here on
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=stacks)
    try:
        training_step(shape, dtype, dev, "backward")
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        start = time.perf_counter()
        snap = torch.cuda.memory._snapshot()
        symbolise_s = time.perf_counter() - start
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {
        "max_memory_allocated": measured,
        "stacks": stacks,
        "symbolise_s": symbolise_s,
        **peak_record(snap["device_traces"][0]),
    }


def traced_program(job: Job) -> dict[str, Any]:
    """gpu_program's rank, its allocations traced from before the model exists: its record, and the blocks live at
    its peak (the workspaces cuBLAS creates on first use included, as max_memory_allocated counts them)."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
    try:
        record = gpu_program.main(job)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"record": record, **peak_record(snap["device_traces"][torch.cuda.current_device()])}


def main() -> None:
    """Trace every configuration and write memory_trace.json."""
    options = parser(__doc__.splitlines()[0]).parse_args()
    dev = device()
    results = Results(options.out / "memory_trace.json", {**machine(), "dry_run": options.dry_run})
    for shape, dtype in configs(options.dry_run):
        where = f"block {dtype} {shape.label}"
        with results.guard(where):
            if dev.type != "cuda":  # no caching allocator to trace: the code path up to the trace only
                training_step(shape, dtype, dev, "backward")
                print(f"{where}: (no CUDA: not traced)", flush=True)
                continue
            try:  # C++ frames name the kernels autograd's thread allocates for; Python frames if they fail
                record = trace_step(shape, dtype, dev, "all")
            except Exception as exc:  # noqa: BLE001 - recorded, then the same trace with Python frames only
                results.error(f"{where} (C++ frames)", exc)
                record = trace_step(shape, dtype, dev, "python")
            results.add({"shape": vars(shape), "dtype": dtype, **record})
            mib = 2**20
            print(
                f"{where}: peak {record['max_memory_allocated'] / mib:.1f} MiB "
                f"(replayed {record['replayed_peak'] / mib:.1f}), {len(record['live_at_peak'])} blocks live, "
                f"{record['events']} events, symbolised in {record['symbolise_s']:.1f} s",
                flush=True,
            )
            for block in sorted(record["live_at_peak"], key=lambda b: -b["size"])[:12]:
                print(f"  {block['size'] / mib:8.1f} MiB  {allocating_op(block['frames'])}", flush=True)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if dev.type == "cuda":  # the GPU program, in its own process through real, as program.py runs it
        job = DRY_JOB if options.dry_run else JOB
        with results.guard("gpu_program"):
            # by its module's name, not __main__'s, so that real's worker process can import it
            from memory_trace import traced_program as rank

            traced = real.run(rank, 1, backend="nccl", kwargs={"job": job}, timeout=60).returns[0]
            results.add({"program": "gpu_program", "job": job.as_dict(), **traced})
            print(
                f"gpu_program: peak {traced['record']['peak_bytes'] / 2**20:.1f} MiB "
                f"(replayed {traced['replayed_peak'] / 2**20:.1f}), {len(traced['live_at_peak'])} blocks live",
                flush=True,
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
