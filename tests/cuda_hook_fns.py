"""Rank functions for tests/test_cuda_hooks.py, importable by spawned rank processes: parameters that get hooks
and attributes before or after the model moves to the GPU (or to another dtype there), then one or more backward
passes. The same functions run with ``kind="cpu"`` as their CPU twin, where every move keeps each parameter's
tensor (``param.data = moved``), as moves on a GPU do."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Plan:
    """When hooks and attributes are put on the parameters, how the model moves, and how many backward passes."""

    #: hooks and an attribute before the model moves
    before: bool = True
    #: hooks and an attribute after it moved
    after: bool = True
    #: ``model.cuda()`` instead of ``model.to(device)``
    method_cuda: bool = False
    #: a second move, to float64, after the move to the device
    to_double: bool = False
    #: then each parameter takes host data (``p.data = p.data.cpu()``): on a GPU it becomes a host tensor
    host_data: bool = False
    #: backward passes without zeroing the gradients (the second accumulates into ``.grad``)
    backwards: int = 2


def _device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", torch.cuda.current_device())


def hooked_moves(kind: str, plan: Plan) -> dict[str, Any]:
    """A linear layer moved to ``kind`` with hooks on its parameters as ``plan`` says; returns what each hook saw
    (host values, in firing order), the gradients, the attributes each parameter kept and whether the module still
    holds the objects the hooks were registered on."""
    dev = _device(kind)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    seen: list[tuple[str, str, str, torch.Tensor]] = []
    registered: dict[str, torch.nn.Parameter] = {}

    def hook(when: str) -> None:
        for name, p in model.named_parameters():
            p.register_hook(lambda g, w=when, n=name: seen.append((w, "grad", n, g.detach().cpu().clone())))
            p.register_post_accumulate_grad_hook(
                lambda q, w=when, n=name: seen.append((w, "accumulated", n, q.grad.detach().cpu().clone()))
            )
            setattr(p, f"tagged_{when}", name)
            registered[f"{when}.{name}"] = p

    if plan.before:
        hook("before")
    model = model.cuda() if plan.method_cuda and kind == "cuda" else model.to(dev)
    dtype = torch.float32
    if plan.to_double:
        model = model.to(torch.float64)
        dtype = torch.float64
    if plan.host_data:
        for p in model.parameters():
            p.data = p.data.cpu()
        dev = torch.device("cpu")
    if plan.after:
        hook("after")
    for i in range(plan.backwards):
        x = (torch.arange(6.0).view(2, 3) * (i + 1)).to(dev, dtype)
        model(x).pow(2).sum().backward()
    params = dict(model.named_parameters())
    return {
        "seen": seen,
        "grads": {n: p.grad.detach().cpu() for n, p in params.items()},
        "attributes": {n: sorted(k for k in vars(p) if k.startswith("tagged_")) for n, p in params.items()},
        "kept": sorted(k for k, p in registered.items() if params[k.split(".", 1)[1]] is p),
        "device": str(params["weight"].device),
    }


def hooked_ddp(kind: str) -> dict[str, Any]:
    """Data parallelism as users write it by hand: each parameter's post-accumulate-grad hook all-reduces its
    gradient and divides by the world size. The model is moved to ``kind`` after it was built, each rank has
    its own batch; returns the gradients."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    dev = _device(kind)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dev)

    def average(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x.to(dev)).pow(2).sum().backward()
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


#: the plans one launch of real processes runs
PLANS = (
    Plan(),
    Plan(method_cuda=True, backwards=1),
    Plan(before=False),
    Plan(after=False, to_double=True),
    Plan(host_data=True),
)


def single_process_grads(world: int) -> dict[str, torch.Tensor]:
    """What :func:`hooked_ddp` must give on every rank of ``world``: each rank's gradients, summed, divided."""
    total: dict[str, torch.Tensor] = {}
    for rank in range(world):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).sum().backward()
        for n, p in model.named_parameters():
            total[n] = p.grad if n not in total else total[n] + p.grad
    return {n: g / world for n, g in total.items()}


def all_of_them(kind: str = "cuda") -> dict[str, Any]:
    """Every plan of :data:`PLANS`, then :func:`hooked_ddp`: one launch of real processes runs them all."""
    return {"plans": [hooked_moves(kind, plan) for plan in PLANS], "ddp": hooked_ddp(kind)}
