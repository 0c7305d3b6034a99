"""Training functions for the ZeRO-1 tests: the single-process reference and its sharded-optimizer versions.

Plain torch.distributed code, importable by real worker processes. The model and data come from
:mod:`tests.oracle_fns`; the reference trains on the full batch, each rank on its slice of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from simdist.strategies import ShardedOptimizer
from tests.oracle_fns import Setup, data, model

#: optimizer name -> (class, settings); momentum and weight decay so that state and decay both matter
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


@dataclass(frozen=True)
class ZeroSetup:
    """A :class:`Setup` plus the optimizer and whether weights and biases get groups with their own settings."""

    base: Setup = field(
        default_factory=lambda: Setup(widths=(6, 9, 5, 3), batch=8, steps=3, dtype=torch.float32)
    )
    optimizer: str = "adam"
    groups: bool = False


def param_groups(net: nn.Module, groups: bool) -> list[dict[str, Any]] | list[nn.Parameter]:
    """The parameters, or two groups: weights with the defaults, biases with half the lr and no weight decay."""
    if not groups:
        return list(net.parameters())
    lr = OPTIMIZERS["sgd"][1]["lr"]
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": lr / 20, "weight_decay": 0.0}]


def unsharded(setup: ZeroSetup, net: nn.Module) -> torch.optim.Optimizer:
    """The torch optimizer the sharded one must equal."""
    cls, settings = OPTIMIZERS[setup.optimizer]
    return cls(param_groups(net, setup.groups), **settings)


def sharded(setup: ZeroSetup, net: nn.Module) -> ShardedOptimizer:
    """The same optimizer, its state sharded over the default group."""
    cls, settings = OPTIMIZERS[setup.optimizer]
    return ShardedOptimizer(param_groups(net, setup.groups), cls, **settings)


def reference(setup: ZeroSetup) -> None:
    """The single-process model trained on the full batch with the unsharded optimizer."""
    m = model(setup.base)
    opt = unsharded(setup, m)
    for step in range(setup.base.steps):
        x, y = data(setup.base, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def zero_ddp(setup: ZeroSetup) -> None:
    """torch DDP averages the gradients; the ShardedOptimizer steps each rank's share and broadcasts it."""
    m = model(setup.base)
    net = DistributedDataParallel(m)
    opt = sharded(setup, m)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = setup.base.batch // world
    for step in range(setup.base.steps):
        x, y = data(setup.base, step)
        opt.zero_grad()
        F.mse_loss(net(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        opt.step()


def average_gradients(params: list[nn.Parameter]) -> None:
    """Hand-written data parallelism: each gradient summed over the ranks and divided by their number."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
