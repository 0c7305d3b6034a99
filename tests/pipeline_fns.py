"""Pipeline-parallel training with ``PipelineOptimizer``, for tests/test_pipeline_optimizer.py (simulated and real).

The model is a chain of ``Linear + Tanh`` blocks, one per pipeline stage; with ``tie`` it starts with an
embedding and ends with an output projection that shares the embedding's weight (a language model's tied
embedding). Each rank builds the whole model from the same seed and deletes what its stage does not own, as
torchtitan does, so a stage keeps the reference model's qualified names (``layers.1.0.weight``). A hand-written
GPipe loop (all forwards, then all backwards, activations and their gradients sent with ``dist.send``/``recv``)
trains ``dp`` replicas of a ``p``-stage pipeline; rank = replica * p + stage. The reference is the whole model
on the full batch in one process.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from simdist.strategies import GradientSyncMode, PipelineOptimizer, PipelineOptimizerConfig

#: rows of one microbatch; the vocabulary of the tied model; the learning rate; optimizer steps
ROWS, VOCAB, LR, STEPS = 2, 5, 0.1, 2
SEED = 1234


@dataclasses.dataclass(frozen=True)
class Layout:
    """``p`` stages (one per rank) x ``dp`` replicas, ``m`` microbatches per replica and step.

    ``widths[i]`` is the input width of block ``i`` (``widths[-1]`` the model's output width); with ``tie``
    the model embeds token ids of a vocabulary of ``VOCAB`` and projects back onto it with the same weight.
    """

    p: int
    dp: int = 1
    m: int = 2
    widths: tuple[int, ...] = ()
    tie: bool = False

    def __post_init__(self) -> None:
        if not self.widths:
            object.__setattr__(self, "widths", (4,) * (self.p + 1))
        assert len(self.widths) == self.p + 1, "one block per stage"
        assert not self.tie or self.widths[0] == self.widths[-1], "a tied projection has the embedding's shape"

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.p * self.dp


class Net(nn.Module):
    """Blocks ``layers.i`` of Linear + Tanh; with ``tie``, an embedding before and a tied projection after."""

    def __init__(self, widths: tuple[int, ...], tie: bool) -> None:
        super().__init__()
        self.embed: nn.Embedding | None = nn.Embedding(VOCAB, widths[0]) if tie else None
        self.layers = nn.ModuleDict(
            {str(i): nn.Sequential(nn.Linear(widths[i], widths[i + 1]), nn.Tanh()) for i in range(len(widths) - 1)}
        )
        self.head: nn.Linear | None = nn.Linear(widths[-1], VOCAB, bias=False) if tie else None
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def build(layout: Layout) -> Net:
    """The whole model, the same on every rank."""
    torch.manual_seed(SEED)
    return Net(layout.widths, layout.tie).double()


def build_stage(layout: Layout, stage: int) -> Net:
    """The whole model with every block but ``stage``'s deleted (and the embedding / head but at the ends)."""
    model = build(layout)
    for name in list(model.layers):
        if name != str(stage):
            del model.layers[name]
    if stage != 0:
        model.embed = None
    if stage != layout.p - 1:
        model.head = None
    return model


def batch(layout: Layout, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``step``: ``dp * m * ROWS`` rows of inputs and targets."""
    g = torch.Generator().manual_seed(100 + step)
    rows = layout.dp * layout.m * ROWS
    if layout.tie:
        return torch.randint(0, VOCAB, (rows,), generator=g), torch.randint(0, VOCAB, (rows,), generator=g)
    return (torch.randn(rows, layout.widths[0], generator=g, dtype=torch.float64),
            torch.randn(rows, layout.widths[-1], generator=g, dtype=torch.float64))


def loss_fn(layout: Layout, out: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy over the vocabulary (tied model) or mean squared error."""
    if layout.tie:
        return F.cross_entropy(out, target, reduction=reduction)
    return F.mse_loss(out, target, reduction=reduction)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """SGD with momentum, or Adam."""
    if name == "adam":
        return torch.optim.Adam(params, lr=LR / 10)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(layout: Layout, steps: int = STEPS, fixed_data: bool = False, optimizer: str = "sgd") -> list[float]:
    """The whole model on the full batch (the first one at every step with ``fixed_data``); each step's loss."""
    model = build(layout)
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(layout, 0 if fixed_data else step)
        opt.zero_grad()
        loss = loss_fn(layout, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def gpipe(stage: nn.Module, layout: Layout, position: int, first_rank: int, x: torch.Tensor,
          y: torch.Tensor) -> list[float]:
    """One GPipe step of this stage over ``layout.m`` microbatches; the last stage returns their losses.

    Gradients are left summed over the microbatches (the caller divides by ``m``).
    """
    p, m = layout.p, layout.m
    prev, nxt = first_rank + position - 1, first_rank + position + 1
    inputs, outputs = [], []
    for mb in range(m):
        if position == 0:
            inp = x[mb * ROWS : (mb + 1) * ROWS]
        else:
            inp = torch.empty(ROWS, layout.widths[position], dtype=torch.float64)
            dist.recv(inp, src=prev)
            inp.requires_grad_()
        out = stage(inp)
        if position < p - 1:
            dist.send(out.detach(), dst=nxt)
        inputs.append(inp)
        outputs.append(out)
    losses = []
    for mb in range(m):
        if position == p - 1:
            loss = loss_fn(layout, outputs[mb], y[mb * ROWS : (mb + 1) * ROWS])
            loss.backward()
            losses.append(loss.item())
        else:
            grad = torch.empty_like(outputs[mb])
            dist.recv(grad, src=nxt)
            outputs[mb].backward(grad)
        if position > 0:
            dist.send(inputs[mb].grad, dst=prev)
    return losses


def groups(layout: Layout) -> tuple[list[dist.ProcessGroup], list[dist.ProcessGroup]]:
    """Every pipeline group (one per replica) and every data-parallel group (one per stage), on every rank."""
    p, world = layout.p, layout.world
    pp = [dist.new_group(list(range(d * p, (d + 1) * p))) for d in range(layout.dp)]
    dp = [dist.new_group(list(range(s, world, p))) for s in range(p)]
    return pp, dp


def tie_list(layout: Layout) -> list[dict[int, str]]:
    """One tie per pipeline: the first stage's embedding and the last stage's projection."""
    if not layout.tie or layout.p == 1:
        return []
    return [{d * layout.p: "embed.weight", d * layout.p + layout.p - 1: "head.weight"} for d in range(layout.dp)]


def train(
    layout: Layout,
    mode: str = "stage_wise",
    *,
    use_dp_group: bool = True,
    use_ties: bool = True,
    broadcast: bool = True,
    steps: int = STEPS,
    torch_schedule: bool = False,
    fixed_data: bool = False,
    optimizer: str = "sgd",
) -> dict[str, Any]:
    """Train ``layout`` with a PipelineOptimizer in ``mode``; returns this rank's parameters and losses.

    ``use_dp_group=False`` leaves dp_group out, ``use_ties=False`` the ties; ``torch_schedule`` runs torch's
    ``PipelineStage`` and ``ScheduleGPipe`` instead of the hand-written loop (no tie, one replica);
    ``fixed_data`` trains on the first batch at every step; ``optimizer`` is "sgd" (with momentum) or "adam".
    """
    rank = dist.get_rank()
    assert dist.get_world_size() == layout.world, (dist.get_world_size(), layout)
    pp_groups, dp_groups = groups(layout)
    replica, position = divmod(rank, layout.p)
    module = build_stage(layout, position)
    config = PipelineOptimizerConfig(sync_mode=mode, broadcast_parameters=broadcast)
    base = make_optimizer(optimizer, module.parameters())
    first, last = position == 0, position == layout.p - 1
    schedule = None
    if torch_schedule:
        stage = PipelineStage(module, position, layout.p, torch.device("cpu"), group=pp_groups[replica])
        schedule = ScheduleGPipe(stage, layout.m, loss_fn=lambda out, target: loss_fn(layout, out, target))
        stages: list[Any] = [stage]
    else:
        stages = [module]
    opt = PipelineOptimizer(
        base, stages, config, pp_group=pp_groups[replica],
        dp_group=dp_groups[position] if use_dp_group else None,
        ties=tie_list(layout) if use_ties else [],
    )
    rows = layout.m * ROWS
    losses: list[float] = []
    for step in range(steps):
        x, y = batch(layout, 0 if fixed_data else step)
        x, y = x[replica * rows : (replica + 1) * rows], y[replica * rows : (replica + 1) * rows]
        opt.zero_grad()
        if schedule is not None:
            out: list[torch.Tensor] = []
            schedule.step(*([x] if first else []), **({"target": y, "losses": out} if last else {}))
            losses.append(sum(t.item() for t in out) / layout.m if last else float("nan"))
        else:
            mb_losses = gpipe(module, layout, position, replica * layout.p, x, y)
            losses.append(sum(mb_losses) / layout.m if last else float("nan"))
            with torch.no_grad():
                for param in module.parameters():
                    if param.grad is not None:
                        param.grad.div_(layout.m)  # the mean over microbatches (torch's scale_grads)
        opt.step()
    return {
        "params": {name: p.detach().clone() for name, p in module.named_parameters()},
        "losses": losses,
        "mode": GradientSyncMode(mode).value,
    }


def reference_params(layout: Layout, steps: int = STEPS, fixed_data: bool = False) -> dict[str, torch.Tensor]:
    """The reference model's parameters after ``steps`` steps (tied ones under both names)."""
    model = build(layout)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        x, y = batch(layout, 0 if fixed_data else step)
        opt.zero_grad()
        loss_fn(layout, model(x), y).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def stalls(seconds: float) -> None:
    """Rank 1 sleeps ``seconds`` of wall time before the second step; the others time out waiting for it."""
    rank = dist.get_rank()
    module = build(Layout(1))
    opt = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=LR), [module],
                            PipelineOptimizerConfig(sync_mode="average", communication_timeout_ms=500))
    # Both ranks enter the first step together (the barrier has the group's long default timeout): on a busy
    # machine, building the model could otherwise keep one rank 500 ms behind and make step 0, not the stall,
    # time out, on whichever rank arrived first.
    dist.barrier()
    for step in range(2):
        if rank == 1 and step == 1:
            time.sleep(seconds)
        for param in module.parameters():
            param.grad = torch.ones_like(param)
        opt.step()


def patient(timeout_ms: int, seconds: float) -> float:
    """Rank 1 sleeps ``seconds`` before the step of a tied pair of stages whose collectives may take
    ``timeout_ms``; the others wait for it. Returns the tied weight's sum after the step (equal on both ranks)."""
    rank = dist.get_rank()
    module = build(Layout(1))
    config = PipelineOptimizerConfig(sync_mode="stage_wise", communication_timeout_ms=timeout_ms)
    tie = {0: "layers.0.0.weight", 1: "layers.0.0.weight"}
    opt = PipelineOptimizer(torch.optim.SGD(module.parameters(), lr=LR), [module], config, ties=[tie])
    if rank == 1:
        time.sleep(seconds)
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    opt.step()
    return float(module.layers["0"][0].weight.detach().sum())


def in_turn(calls: list[tuple[str, tuple]]) -> list[Any]:
    """Each (function of this module, its arguments) in turn, on one launch's ranks; what each returned."""
    return [globals()[name](*args) for name, args in calls]
