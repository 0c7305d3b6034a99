"""What GPU scripts measure: memory statistics around known allocations, and a step timed with CUDA events.

Its oracle is the tensors' own sizes: a GPU program has no CPU twin for ``torch.cuda.memory_allocated``."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from gpu_programs.common import device, host, init, report


def main(kind: str = "cuda") -> dict:
    """Allocate, free and time; returns the memory figures (bytes above the starting point), the tensors' sizes
    that should explain them, and what the events answered."""
    init(kind)
    dev = device(kind)
    # what earlier programs of the same process left in reference cycles goes now, not between the readings below
    # (a garbage collection there frees their tensors and moves memory_allocated as this program's own do not)
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    a = torch.empty(1024, 256, device=dev)
    after_a = torch.cuda.memory_allocated() - base
    b = torch.ones(512, 256, device=dev)
    after_b = torch.cuda.memory_allocated() - base
    sizes = {"a": a.nbytes, "b": b.nbytes}
    del a
    after_free = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    free, total = torch.cuda.mem_get_info()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    c = b @ b.T
    end.record()
    torch.cuda.synchronize()
    elapsed = start.elapsed_time(end)
    out = host(
        {
            "memory": [after_a, after_b, after_free, peak],
            "sizes": sizes,
            "total": total,
            "capacity": torch.cuda.get_device_properties(dev).total_memory,
            "free_below_total": free < total,
            "elapsed_positive": elapsed > 0,
            "end_reached": end.query(),
            "devices": torch.cuda.device_count(),
            "name": torch.cuda.get_device_name(),
            "product": c.sum(),
        }
    )
    return out


if __name__ == "__main__":
    report("events_memory", main())
    dist.destroy_process_group()
