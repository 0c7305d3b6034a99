"""Pipeline parallelism as GPU scripts write it: ``torch.distributed.pipelining``'s ``PipelineStage`` on the
rank's GPU, four microbatches under ``ScheduleGPipe``, SGD; rank 0 holds the first half of an MLP, rank 1 the
second."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from gpu_programs.common import device, host, init, report


def main(kind: str = "cuda", steps: int = 2) -> dict:
    """Train; returns this rank's stage's parameters and, on the last stage, the losses."""
    init(kind)
    dev = device(kind)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(2 * world)])
    part = torch.nn.Sequential(*list(full)[2 * rank : 2 * rank + 2]).to(dev)
    stage = PipelineStage(part, rank, world, dev)
    schedule = ScheduleGPipe(stage, 4, loss_fn=lambda out, target: (out - target).pow(2).mean())
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, target = torch.randn(8, 16, generator=data).to(dev), torch.randn(8, 16, generator=data).to(dev)
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target, losses=step_losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        losses.extend(step_losses)
    return host({"params": list(part.parameters()), "losses": losses})


if __name__ == "__main__":
    report("pipeline", main())
    dist.destroy_process_group()
