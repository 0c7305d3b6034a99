"""Rank functions for tests/test_real_timeline.py, importable by the spawned rank processes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_step() -> torch.Tensor:
    """One DDP step (its construction's all-gather and broadcasts, the gradient all-reduce), a message from
    rank 0 to rank 1, and an async all-reduce waited for later; returns the model's gradient."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    model(torch.randn(8, 16)).sum().backward()
    t = torch.full((5,), float(dist.get_rank()))
    if dist.get_rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    return model.module.weight.grad


def ddp_step_and_more() -> torch.Tensor:
    """``ddp_step`` followed by a barrier the other does not have."""
    grad = ddp_step()
    dist.barrier()
    return grad


def ddp_step_on_cuda() -> torch.Tensor:
    """``ddp_step``'s DDP step written for GPUs (run on emulated ones)."""
    torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4).cuda())
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    t = torch.ones(5, device="cuda")
    dist.all_reduce(t)
    return model.module.weight.grad
