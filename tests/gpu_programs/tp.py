"""Tensor parallelism on a CUDA device mesh: an MLP's first linear column-wise, its second row-wise, SGD."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gpu_programs.common import device, host, init, report


def main(kind: str = "cuda", steps: int = 3) -> dict:
    """Train; returns the full parameters and the losses (every rank feeds the same data, as TP requires)."""
    init(kind)
    dev = device(kind)
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(dev)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 16, generator=data).to(dev)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    full = [p.full_tensor() for p in model.parameters()]
    out = host({"params": full, "losses": losses, "device": str(model[0].weight.to_local().device)})
    return out


if __name__ == "__main__":
    report("tp", main())
    dist.destroy_process_group()
