"""DDP on GPUs: ``device_ids=[local_rank]``, AdamW, three steps, each rank its own data."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_programs.common import device, host, init, report


def main(kind: str = "cuda", steps: int = 3) -> dict:
    """Train; returns the parameters and the losses."""
    init(kind)
    dev = device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
    extra = {"device_ids": [dev.index]} if kind == "cuda" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **extra)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data).to(dev)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out = host({"params": list(model.parameters()), "losses": losses, "device": str(model[0].weight.device)})
    return out


if __name__ == "__main__":
    report("ddp", main())
    dist.destroy_process_group()
