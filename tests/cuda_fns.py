"""Training programs written twice, for GPUs and for the CPU, as users write them: the tests run both under
simdist and compare them bit for bit (the CPU twin is the oracle: the same CPU kernels compute both)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def _device(kind: str) -> torch.device:
    """The device a rank trains on: its local GPU (set as current first, as GPU scripts do), or the CPU."""
    if kind == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _register_hook(ddp: torch.nn.parallel.DistributedDataParallel, hook: str) -> None:
    """Register DDP's communication hook ``hook``: "fp16" or "bf16" compression, or "powersgd" (rank 1, from the
    second step)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        ddp.register_comm_hook(
            None, {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[hook]
        )


def ddp_train(
    kind: str, options: dict[str, Any] | None = None, steps: int = 3, hook: str | None = None
) -> tuple[list[torch.Tensor], list[float], str]:
    """A DDP training loop (AdamW, foreach) written for ``kind`` ("cuda" or "cpu"), with communication hook
    ``hook`` (see :func:`_register_hook`) or none; returns the parameters, the losses and the device the
    parameters report."""
    dist.init_process_group("nccl" if kind == "cuda" else None)
    dev = _device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
    extra = {"device_ids": [dev.index]} if kind == "cuda" else {}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **extra, **(options or {}))
    if hook is not None:
        _register_hook(ddp, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data).to(dev)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return [p.detach().cpu() for p in model.parameters()], losses, str(model[0].weight.device)


def fsdp2_train(kind: str, steps: int = 3) -> tuple[list[torch.Tensor], list[float], str]:
    """FSDP2 (per-layer ``fully_shard``, bf16 parameters with fp32 reduction) on ``init_device_mesh(kind)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = _device(kind)
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=data).to(dev)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor().detach().cpu() for p in model.parameters()]
    return full, losses, str(next(model.parameters()).to_local().device)


def fsdp1_train(kind: str, steps: int = 3) -> tuple[list[torch.Tensor], list[float], str]:
    """FSDP1 (``FullyShardedDataParallel`` with ``use_orig_params``, AdamW) on ``device_id`` ``kind``'s device."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("nccl" if kind == "cuda" else None)
    dev = _device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(dev)
    fsdp = FSDP(model, device_id=dev, use_orig_params=True)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = fsdp(torch.randn(4, 16, generator=data).to(dev)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with FSDP.summon_full_params(fsdp):
        full = [p.detach().cpu().clone() for p in fsdp.parameters()]
    return full, losses, str(next(fsdp.parameters()).device)
