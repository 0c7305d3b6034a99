"""Training functions for the equivalence oracle's tests: a reference and its data-parallel versions.

Every function is plain torch.distributed code. The model, the data and the optimizer are described by a
:class:`Setup`; the reference trains on the full batch, each parallel version on its rank's slice of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from simdist.strategies import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP


@dataclass(frozen=True)
class Setup:
    """A small MLP, its data and optimizer; the batch splits evenly over the ranks."""

    widths: tuple[int, ...] = (6, 8, 3)
    batch: int = 8
    steps: int = 3
    optimizer: str = "sgd"
    dtype: torch.dtype = torch.float64
    #: (step, parameter index, element index, rank or None for every rank): add `delta` to that gradient element
    perturb: tuple[int, int, int, int | None] | None = None
    delta: float = 0.0


def layers(widths: tuple[int, ...]) -> list[nn.Module]:
    """Linear layers of the given widths with a tanh between each two."""
    out: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        out.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            out.append(nn.Tanh())
    return out


def model(setup: Setup) -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(*layers(setup.widths)).to(setup.dtype)


def data(setup: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(setup.batch, setup.widths[0], generator=g, dtype=setup.dtype)
    return x, torch.randn(setup.batch, setup.widths[-1], generator=g, dtype=setup.dtype)


def optimizer(setup: Setup, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if setup.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(setup: Setup) -> None:
    """The single-process model trained on the full batch."""
    m = model(setup)
    opt = optimizer(setup, list(m.parameters()))
    for step in range(setup.steps):
        x, y = data(setup, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def _shard(setup: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = setup.batch // world
    x, y = data(setup, step)
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _perturb(setup: Setup, step: int, params: list[nn.Parameter]) -> None:
    if setup.perturb is None or setup.perturb[0] != step:
        return
    _, index, element, rank = setup.perturb
    if rank is None or rank == dist.get_rank():
        grad = params[index].grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel():
            local.view(-1)[element % local.numel()] += setup.delta


#: data-parallel wrappers: name -> (wrap the model, finish the gradient synchronisation before the step)
STRATEGIES = ("torch_ddp", "naive", "flat", "overlap", "bucketed", "fsdp2", "allreduce")


def parallel(setup: Setup, strategy: str) -> None:
    """``setup`` trained with ``strategy`` on every rank's slice of each batch."""
    m = model(setup)
    finish = None
    if strategy == "torch_ddp":
        net: nn.Module = DistributedDataParallel(m)
    elif strategy == "fsdp2":
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        net = fully_shard(m)
    elif strategy == "allreduce":
        net = m
    else:
        net = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP}[strategy](m)
        finish = net.finish_gradient_synchronization
    params = list(m.parameters())
    opt = optimizer(setup, params)
    for step in range(setup.steps):
        x, y = _shard(setup, step)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        if finish is not None:
            finish()
        if strategy == "allreduce":
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        _perturb(setup, step, params)
        opt.step()
