"""Mixed precision as GPU scripts write it: ``torch.autocast`` with float16 and ``GradScaler``, under DDP; the
first step's scale is set high enough to overflow, so the scaler skips a step and backs off as on a GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_programs.common import device, host, init, report

#: the scale's first value overflows float16's gradients; one back-off by this factor brings it in range
INIT_SCALE, BACKOFF = 2.0**24, 2.0**-8


def main(kind: str = "cuda", steps: int = 4) -> dict:
    """Train; returns the parameters, the losses, the scales and which steps the scaler skipped."""
    init(kind)
    dev = device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
    extra = {"device_ids": [dev.index]} if kind == "cuda" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **extra)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(kind, init_scale=INIT_SCALE, backoff_factor=BACKOFF)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses, scales = [], []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data).to(dev)
        with torch.autocast(kind, dtype=torch.float16):
            out = ddp(x)
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
        scales.append(scaler.get_scale())
    out = host({"params": list(model.parameters()), "losses": losses, "scales": scales})
    return out


if __name__ == "__main__":
    report("amp", main())
    dist.destroy_process_group()
