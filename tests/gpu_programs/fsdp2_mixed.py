"""FSDP2 on a CUDA device mesh: per-layer ``fully_shard`` with ``MixedPrecisionPolicy`` (bf16 parameters, fp32
reduction), AdamW, three steps."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gpu_programs.common import device, host, init, report


def main(kind: str = "cuda", steps: int = 3) -> dict:
    """Train; returns the full parameters and the losses."""
    init(kind)
    dev = device(kind)
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=data).to(dev)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    full = [p.full_tensor() for p in model.parameters()]
    out = host({"params": full, "losses": losses, "device": str(next(model.parameters()).to_local().device)})
    return out


if __name__ == "__main__":
    report("fsdp2_mixed", main())
    dist.destroy_process_group()
