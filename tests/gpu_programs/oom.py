"""Out of memory as GPU scripts handle it: a batch too large for the device raises
``torch.cuda.OutOfMemoryError``, and the script falls back to a smaller one and trains on it under DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_programs.common import device, host, init, report

#: rows of the batch that fits (and that the CPU twin uses from the start)
SMALL = 8


def main(kind: str = "cuda") -> dict:
    """Try a batch of twice the device's memory, fall back; returns whether it fell back, and the trained
    parameters."""
    init(kind)
    dev = device(kind)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(dev)
    extra = {"device_ids": [dev.index]} if kind == "cuda" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **extra)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    fell_back = False
    batch = SMALL
    if kind == "cuda":
        rows = 2 * torch.cuda.get_device_properties(dev).total_memory // (64 * 4)
        try:
            torch.empty(rows, 64, device=dev)
            batch = rows
        except torch.cuda.OutOfMemoryError:
            fell_back = True
    data = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, 64, generator=data).to(dev)
    ddp(x).pow(2).mean().backward()
    opt.step()
    out = host({"fell_back": fell_back, "params": list(model.parameters())})
    return out


if __name__ == "__main__":
    report("oom", main())
    dist.destroy_process_group()
