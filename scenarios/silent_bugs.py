"""Silent bugs of distributed training: each raises nothing, and each is found by comparing with one process.

Every case is a small model trained for a few SGD steps three ways: a single-process reference on the full
batch, a parallel program with a bug that distributed training code really contains, and the same program
corrected. The parallel programs are plain torch.distributed code (hand-written data, tensor and pipeline
parallelism, torch's DistributedDataParallel) on 2 or 4 ranks, float64, written as for torchrun on GPUs: NCCL,
the GPU its LOCAL_RANK names, the model and each batch (made on the host, as a data loader gives it) moved to
it; they run on the first GPUs of a simulated DGX-H100 node. The references run in one process on the CPU.

(a) Loss divided by the world size twice: pre-divided for a SUM all-reduce, then averaged as well.
(b) Every rank reads the same data shard: the global batch is the first shard W times.
(c) Gradients summed instead of averaged by a hand-written data-parallel all-reduce.
(d) Gradient clipping on a tensor-parallel rank's local norm: every shard scaled by another factor.
(e) Dropout masks drawn from one seed on every tensor-parallel rank: each rank's slice of the hidden layer
    gets the same mask instead of its part of the full mask.
(f) BatchNorm statistics never synchronised under DDP: each rank normalises by its own shard's statistics
    (the correction: torch's SyncBatchNorm).
(g) A tied embedding drifting between pipeline stages: the input and output stages each keep a copy of the
    tied weight, and its two gradients are never summed across the stages.
(h) Gradient accumulation without dividing the loss by the number of micro-steps.
(i) ``no_sync()`` left on for the last micro-step: gradients are never all-reduced.
(j) Parameters not broadcast from rank 0: ranks seeded differently build different initial models.
(k) A row-parallel linear that adds its bias on every rank before the all-reduce: the bias counts W times.
(l) One pipeline stage (of two, each data-parallel over two ranks) steps with unsynchronised gradients.
(m) A learning-rate scheduler stepped once per micro-batch instead of once per optimizer step: the
    learning rate decays twice as fast, first visible at the second step.
(n) A sharded optimizer (ZeRO-1) whose updated parameters are never sent back: each rank steps the parameters
    it owns and computes the next step with stale copies of the others; the first step is right, the second's
    loss is not.

For each case the oracle reports the first divergent step, the tensor and ranks, and where localisation
finds it, the first op whose output diverged; the verdicts check the step and tensor of every bug and that
every corrected program equals the reference. With ``--real N`` every program also runs N times on real gloo
processes (one per rank, through ``real``, each emulating its GPU) and the final state is compared with the
reference: the verdict
on real processes must agree with the simulated one. The HTML report silent_bugs.html (in the output
directory, reports/ by default) has the verdicts, a table of every bug and its correction, and the oracle's
reports.

Usage: python scenarios/silent_bugs.py [--seed N] [--real N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from verdicts import drift_series, finish, importable_by_rank_processes

import simdist
from simdist.ranks import ranges

D_IN, HIDDEN, D_OUT = 6, 8, 3
#: rows of the global batch of one optimizer step (every case splits it evenly over ranks and micro-steps)
BATCH = 8
STEPS, LR = 3, 0.1
#: micro-steps of gradient accumulation per optimizer step, in the cases that accumulate
MICRO = 2
#: max_norm of gradient clipping, small enough that every step clips
CLIP = 0.05
P_DROP = 0.25
#: the tied language model of case (g)
VOCAB, DIM, SEQ = 12, 6, 4
#: the learning-rate schedule of case (m): StepLR(step_size=2, gamma=0.1)
LR_STEP, LR_GAMMA = 2, 0.1
REPORTS = Path(__file__).resolve().parent.parent / "reports"


# ------------------------------------------------------------------------------------------- models, data
class MLP(nn.Module):
    """fc1 -> tanh (-> optional dropout mask) -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc2(h if mask is None else h * mask)


class BNMLP(nn.Module):
    """fc1 -> BatchNorm -> tanh -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class TinyLM(nn.Module):
    """Embedding -> tanh(Linear) -> projection to the vocabulary, tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def build(cls: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``cls()`` initialised from ``seed``, in float64 (every program and the reference start from it)."""
    torch.manual_seed(seed)
    return cls().double()


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step``: inputs (BATCH, D_IN) and targets (BATCH, D_OUT)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, D_OUT, generator=g, dtype=torch.float64)


def tokens(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of case (g): input tokens and next tokens, (BATCH, SEQ) each."""
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed * 1000 + step))
    return t[:, :-1], t[:, 1:]


def shard(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Rows ``index`` of ``t`` split in ``parts`` equal blocks."""
    return t.chunk(parts)[index]


def dropout_mask(
    step: int, seed: int, shape: tuple[int, ...], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An inverted-dropout mask drawn on ``device`` from the step's dropout seed (zeros, or 1 / (1 - P_DROP))."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + 500 + step)
    return (torch.rand(shape, generator=g, dtype=torch.float64, device=device) >= P_DROP).double() / (
        1 - P_DROP
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by name, detached copies (what a program returns)."""
    return {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}


# ------------------------------------------------------------------------------------ single-process references
# The references run in one process on the CPU. Their optimizers take the foreach path torch's optimizers take
# on CUDA by default, so that localisation aligns their ops with the GPU programs' optimizer steps.
def reference_mlp(seed: int) -> dict[str, torch.Tensor]:
    """The MLP trained on the full batch in one process."""
    model = build(MLP, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return state(model)


def reference_clipped(seed: int) -> dict[str, torch.Tensor]:
    """The MLP with its gradient norm clipped to CLIP before every step."""
    model = build(MLP, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return state(model)


def reference_dropout(seed: int) -> dict[str, torch.Tensor]:
    """The MLP with the step's dropout mask on its hidden layer."""
    model = build(MLP, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(model(x, dropout_mask(step, seed, (BATCH, HIDDEN))), y).backward()
        opt.step()
    return state(model)


def reference_bn(seed: int) -> dict[str, torch.Tensor]:
    """The BatchNorm MLP: statistics of the full batch."""
    model = build(BNMLP, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return state(model)


def reference_tied(seed: int) -> dict[str, torch.Tensor]:
    """The tied language model: one weight, the sum of both uses' gradients."""
    model = build(TinyLM, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        lm_loss(model(tokens(step, seed)[0]), tokens(step, seed)[1]).backward()
        opt.step()
    return state(model)


def reference_staged(seed: int) -> dict[str, torch.Tensor]:
    """The MLP with each pipeline stage's layer a parameter group of its own: the same steps as
    :func:`reference_mlp`, in one foreach op per stage as the stages of case (l) make them."""
    model = build(MLP, seed)
    groups = [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters()}]
    opt = torch.optim.SGD(groups, lr=LR, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return state(model)


def reference_scheduled(seed: int) -> dict[str, torch.Tensor]:
    """The MLP under StepLR, stepped once per optimizer step."""
    model = build(MLP, seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=LR_STEP, gamma=LR_GAMMA)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return state(model)


# --------------------------------------------------------------------------- hand-written parallel building blocks
def average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """All-reduce every gradient over ``group`` and divide by its size."""
    for p in params:
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)


class ReduceFromTensorParallel(torch.autograd.Function):
    """Sum of the tensor-parallel ranks' partial outputs; its gradient is each partial's gradient."""

    @staticmethod
    def forward(ctx: object, partial: torch.Tensor) -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        # Every rank computes the same loss from the replicated sum, so each partial's gradient is the
        # sum's gradient as it is: reducing it again would count it W times.
        return grad


#: how the hand-written tensor-parallel MLP shards the reference's tensors (dimension of each shard);
#: fc2.bias is replicated
TP_SHARDS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}


class TensorParallelMLP(nn.Module):
    """This rank's part of the MLP: fc1 column-parallel (rows of its weight), fc2 row-parallel (columns)."""

    def __init__(self, full: MLP, rank: int, world: int) -> None:
        super().__init__()
        cols = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        self.fc1 = nn.Linear(D_IN, HIDDEN // world).double()
        self.fc2 = nn.Linear(HIDDEN // world, D_OUT).double()
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[cols])
            self.fc1.bias.copy_(full.fc1.bias[cols])
            self.fc2.weight.copy_(full.fc2.weight[:, cols])
            self.fc2.bias.copy_(full.fc2.bias)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, bias_first: bool = False
    ) -> torch.Tensor:
        """The MLP on the replicated input ``x``; ``bias_first`` adds fc2's bias before the reduction."""
        h = torch.tanh(self.fc1(x))
        if mask is not None:
            h = h * mask
        partial = F.linear(h, self.fc2.weight)
        if bias_first:
            return ReduceFromTensorParallel.apply(partial + self.fc2.bias)
        return ReduceFromTensorParallel.apply(partial) + self.fc2.bias


def tensor_parallel_mlp(seed: int) -> TensorParallelMLP:
    """This rank's part of the MLP built from ``seed`` (every rank builds the full model, keeps its part)."""
    return TensorParallelMLP(build(MLP, seed), dist.get_rank(), dist.get_world_size())


class HiddenStage(nn.Module):
    """First pipeline stage of the MLP: tanh(fc1(x))."""

    def __init__(self, full: MLP) -> None:
        super().__init__()
        self.fc1 = full.fc1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc1(x))


class OutputStage(nn.Module):
    """Last pipeline stage of the MLP: fc2(h)."""

    def __init__(self, full: MLP) -> None:
        super().__init__()
        self.fc2 = full.fc2

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(h)


class EmbedStage(nn.Module):
    """First pipeline stage of the tied language model: tanh(hidden(embed(tokens)))."""

    def __init__(self, full: TinyLM) -> None:
        super().__init__()
        self.embed, self.hidden = full.embed, full.hidden

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.hidden(self.embed(tokens)))


class HeadStage(nn.Module):
    """Last pipeline stage of the tied language model: the projection, holding its own copy of the tied weight."""

    def __init__(self, full: TinyLM) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB, bias=False).double()
        with torch.no_grad():
            self.head.weight.copy_(full.embed.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def hidden_columns() -> slice:
    """This tensor-parallel rank's columns of the hidden layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)


# ----------------------------------------------------------------------------------------- the parallel programs
def setup() -> torch.device:
    """What a script launched by torchrun on GPUs does first: NCCL, and the GPU its LOCAL_RANK names."""
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def a_loss_scaled_twice(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written data parallelism: the loss pre-divided by W for a SUM all-reduce; the bug averages too."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        (F.mse_loss(model(x), y) / world).backward()
        if bug:
            average_gradients(list(model.parameters()))
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
    return state(model)


def b_same_shard(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """torch DDP; the bug indexes the data with a constant instead of the rank."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    part = 0 if bug else rank
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, part, world).to(device), shard(y, part, world).to(device)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return state(model)


def c_summed_gradients(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written data parallelism; the bug all-reduces the gradients and forgets to divide by W."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        F.mse_loss(model(x), y).backward()
        if bug:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        else:
            average_gradients(list(model.parameters()))
        opt.step()
    return state(model)


def d_local_clip_norm(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written tensor parallelism with clipping; the bug clips by the norm of this rank's shards."""
    device = setup()
    part = tensor_parallel_mlp(seed).to(device)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(part(x.to(device)), y.to(device)).backward()
        if bug:
            torch.nn.utils.clip_grad_norm_(part.parameters(), CLIP)
        else:
            # sharded gradients' squares summed over the ranks; the replicated bias counted once
            sharded = torch.stack(
                [p.grad.pow(2).sum() for n, p in part.named_parameters() if n in TP_SHARDS]
            ).sum()
            dist.all_reduce(sharded)
            total = torch.sqrt(sharded + part.fc2.bias.grad.pow(2).sum())
            coef = torch.clamp(CLIP / (total + 1e-6), max=1.0)
            for p in part.parameters():
                p.grad.mul_(coef)
        opt.step()
    return state(part)


def e_tp_dropout_seed(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written tensor parallelism with dropout on the sharded hidden layer; the bug draws each rank's
    mask from the shared seed at its local shape, the fix takes its columns of the full mask."""
    device = setup()
    part = tensor_parallel_mlp(seed).to(device)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    cols = hidden_columns()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        if bug:
            mask = dropout_mask(step, seed, (BATCH, cols.stop - cols.start), device)
        else:
            mask = dropout_mask(step, seed, (BATCH, HIDDEN), device)[:, cols]
        F.mse_loss(part(x.to(device), mask), y.to(device)).backward()
        opt.step()
    return state(part)


def f_unsynced_batchnorm(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """torch DDP over a BatchNorm model; the bug keeps plain BatchNorm1d (statistics of the local shard), the fix
    converts it to torch's SyncBatchNorm."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(BNMLP, seed)
    if not bug:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return state(model)


def g_tied_pipeline(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Two pipeline stages: embedding and hidden layer on rank 0, the tied projection (a copy of the embedding
    weight) on rank 1; the fix sums the two copies' gradients across the stages before stepping."""
    device = setup()
    rank = dist.get_rank()
    full = build(TinyLM, seed)
    stage = (EmbedStage(full) if rank == 0 else HeadStage(full)).to(device)
    tied = stage.embed.weight if rank == 0 else stage.head.weight
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    act = torch.empty(BATCH, SEQ, DIM, dtype=torch.float64, device=device)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = tokens(step, seed)
        if rank == 0:
            h = stage(x.to(device))
            dist.send(h.detach(), 1)
            dist.recv(act, 1)
            h.backward(act)
        else:
            dist.recv(act, 0)
            h = act.clone().requires_grad_()
            lm_loss(stage(h), y.to(device)).backward()
            dist.send(h.grad, 0)
        if not bug:
            dist.all_reduce(tied.grad)
        opt.step()
    return state(stage)


def h_accumulation_unscaled(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """torch DDP with MICRO micro-steps per optimizer step; the bug backpropagates each micro-step's loss
    undivided, so the accumulated gradient is MICRO times the mean."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        for micro in range(MICRO):
            loss = F.mse_loss(ddp(shard(x, micro, MICRO)), shard(y, micro, MICRO))
            if micro < MICRO - 1:
                with ddp.no_sync():
                    (loss if bug else loss / MICRO).backward()
            else:
                (loss if bug else loss / MICRO).backward()
        opt.step()
    return state(model)


def i_no_sync_last(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """torch DDP with MICRO micro-steps; the bug runs every micro-step under ``no_sync()``, the last included."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        for micro in range(MICRO):
            last = micro == MICRO - 1
            with ddp.no_sync() if bug or not last else contextlib.nullcontext():
                (F.mse_loss(ddp(shard(x, micro, MICRO)), shard(y, micro, MICRO)) / MICRO).backward()
        opt.step()
    return state(model)


def j_no_broadcast(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written data parallelism on ranks seeded with their rank; the fix broadcasts rank 0's model."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed + rank).to(device)
    if not bug:
        for t in model.parameters():
            dist.broadcast(t.detach(), 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        F.mse_loss(model(x), y).backward()
        average_gradients(list(model.parameters()))
        opt.step()
    return state(model)


def k_row_parallel_bias(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written tensor parallelism; the bug adds fc2's bias to each rank's partial sum."""
    device = setup()
    part = tensor_parallel_mlp(seed).to(device)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        F.mse_loss(part(x.to(device), bias_first=bug), y.to(device)).backward()
        opt.step()
    return state(part)


def l_pipeline_dp_unsynced(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Two pipeline stages (fc1 on ranks 0-1, fc2 on ranks 2-3), each data-parallel over its two ranks; the
    bug leaves stage 0's gradients unsynchronised."""
    device = setup()
    rank = dist.get_rank()
    stage_index, dp_rank = divmod(rank, 2)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    full = build(MLP, seed)
    stage = (HiddenStage(full) if stage_index == 0 else OutputStage(full)).to(device)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    act = torch.empty(BATCH // 2, HIDDEN, dtype=torch.float64, device=device)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        if stage_index == 0:
            h = stage(shard(x, dp_rank, 2).to(device))
            dist.send(h.detach(), rank + 2)
            dist.recv(act, rank + 2)
            h.backward(act)
            if not bug:
                average_gradients(list(stage.parameters()), groups[0])
        else:
            dist.recv(act, rank - 2)
            h = act.clone().requires_grad_()
            F.mse_loss(stage(h), shard(y, dp_rank, 2).to(device)).backward()
            dist.send(h.grad, rank - 2)
            average_gradients(list(stage.parameters()), groups[1])
        opt.step()
    return state(stage)


def m_scheduler_per_micro(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """torch DDP with MICRO micro-steps and StepLR; the bug steps the scheduler after every micro-step."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=LR_STEP, gamma=LR_GAMMA)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        for micro in range(MICRO):
            last = micro == MICRO - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (F.mse_loss(ddp(shard(x, micro, MICRO)), shard(y, micro, MICRO)) / MICRO).backward()
            if last:
                opt.step()
            if bug:
                sched.step()
        if not bug:
            sched.step()
    return state(model)


def n_sharded_optimizer_no_gather(seed: int, bug: bool) -> dict[str, torch.Tensor]:
    """Hand-written ZeRO-1: gradients averaged, each rank's optimizer steps the parameters it owns (fc1 on rank 0,
    fc2 on rank 1) and the owner broadcasts them; the bug never broadcasts, so the others compute with stale ones."""
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MLP, seed).to(device)
    owned = {"fc1": 0, "fc2": 1}
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if owned[n.split(".")[0]] == rank], lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        model.zero_grad()
        x, y = batch(step, seed)
        x, y = shard(x, rank, world).to(device), shard(y, rank, world).to(device)
        F.mse_loss(model(x), y).backward()
        average_gradients(list(model.parameters()))
        opt.step()
        if not bug:
            for n, p in model.named_parameters():
                dist.broadcast(p.detach(), owned[n.split(".")[0]])
    return state(model)


# --------------------------------------------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Expect:
    """Where the oracle must report a bug: its first divergence (0-based optimizer step, kind, tensor, ranks)."""

    step: int
    kind: str
    name: str
    ranks: tuple[int, ...] | None = None
    #: the relative size of the difference the bug predicts (max|diff| / max|ref|), when it is a plain factor
    rel: float | None = None
    #: other (kind, tensor) divergences of that step that point at the bug: unsynchronised replicas, buffers
    also: tuple[tuple[str, str], ...] = ()
    #: the first divergent op localisation must name (``all_reduce``, ``aten.add_``, ...), and a text its call
    #: site or module must contain (a function name, ``module 'bn'``)
    op: str = ""
    at: str = ""

    def where(self) -> str:
        """Step and tensor."""
        return f"step {self.step}, " + ("the loss" if self.kind == "loss" else f"{self.kind} {self.name!r}")

    def __str__(self) -> str:
        on = f" on rank{'s' if len(self.ranks) > 1 else ''} {ranges(self.ranks)}" if self.ranks else ""
        return self.where() + on + (f", rel {self.rel:.6g}" if self.rel is not None else "")


@dataclass(frozen=True)
class Case:
    """A bug: the program (``bug=True`` or ``False``), its reference, the world size and where the oracle must find it."""

    key: str
    title: str
    program: Callable[[int, bool], dict[str, torch.Tensor]]
    reference: Callable[[int], dict[str, torch.Tensor]]
    world: int
    expect: Expect
    #: ``check_equivalence`` options that describe the program (hand-written shards, renamed tensors, loss)
    options: dict = field(default_factory=dict)


#: micro-steps of accumulation back-propagate loss / MICRO several times per step: a rank's loss is the sum of
#: its backward roots, the step's the mean of the ranks'
MICRO_STEPS = {"loss": "accumulated"}

CASES = [
    Case(
        "a",
        "loss divided by the world size twice",
        a_loss_scaled_twice,
        reference_mlp,
        2,
        Expect(0, "grad", "fc2.bias", (0, 1), rel=1 - 1 / 2, op="aten.div_", at="in average_gradients"),
        {"loss": "sum"},
    ),
    Case(
        "b",
        "every rank reads the same data shard",
        b_same_shard,
        reference_mlp,
        2,
        Expect(0, "loss", "loss", op="aten._to_copy", at="in b_same_shard"),
    ),
    Case(
        "c",
        "gradients summed instead of averaged",
        c_summed_gradients,
        reference_mlp,
        4,
        Expect(0, "grad", "fc2.bias", (0, 1, 2, 3), rel=4 - 1, op="all_reduce", at="in c_summed_gradients"),
    ),
    Case(
        "d",
        "gradient clipping by a tensor-parallel rank's local norm",
        d_local_clip_norm,
        reference_clipped,
        2,
        Expect(
            0,
            "grad",
            "fc2.bias",
            (0, 1),
            also=(("replica", "fc2.bias"),),
            op="aten._foreach_norm",
            at="in d_local_clip_norm",
        ),
        {"shards": TP_SHARDS},
    ),
    Case(
        "e",
        "dropout masks from one seed on every tensor-parallel rank",
        e_tp_dropout_seed,
        reference_dropout,
        2,
        Expect(0, "loss", "loss", op="aten.rand", at="in dropout_mask"),
        {"shards": TP_SHARDS},
    ),
    Case(
        "f",
        "BatchNorm statistics never synchronised",
        f_unsynced_batchnorm,
        reference_bn,
        2,
        Expect(
            0,
            "loss",
            "loss",
            also=(("buffer", "bn.running_mean"), ("replica", "bn.running_mean")),
            op="aten.native_batch_norm",
            at="in module 'bn'",
        ),
    ),
    Case(
        "g",
        "tied embedding drifting between pipeline stages",
        g_tied_pipeline,
        reference_tied,
        2,
        Expect(
            0,
            "grad",
            "head.weight",
            (1,),
            also=(("grad", "embed.weight"),),
            op="aten._foreach_add_",
            at="in g_tied_pipeline",
        ),
        {"names": {"head.weight": "embed.weight"}},
    ),
    Case(
        "h",
        "accumulated micro-steps' loss not divided by their number",
        h_accumulation_unscaled,
        reference_mlp,
        2,
        Expect(0, "loss", "loss", rel=MICRO - 1, op="aten.copy_", at="in h_accumulation_unscaled"),
        MICRO_STEPS,
    ),
    Case(
        "i",
        "no_sync() left on for the last micro-step",
        i_no_sync_last,
        reference_mlp,
        2,
        Expect(
            0,
            "grad",
            "fc2.bias",
            (0, 1),
            also=(("replica", "fc2.bias"),),
            op="aten._foreach_add_",
            at="in i_no_sync_last",
        ),
        MICRO_STEPS,
    ),
    Case(
        "j",
        "parameters not broadcast from rank 0",
        j_no_broadcast,
        reference_mlp,
        2,
        Expect(0, "loss", "loss", also=(("replica", "fc1.weight"),), op="aten.uniform_", at="in __init__"),
    ),
    Case(
        "k",
        "row-parallel bias added on every rank before the all-reduce",
        k_row_parallel_bias,
        reference_mlp,
        2,
        Expect(0, "loss", "loss", op="all_reduce", at="in forward"),
        {"shards": TP_SHARDS},
    ),
    Case(
        "l",
        "one pipeline stage steps with unsynchronised gradients",
        l_pipeline_dp_unsynced,
        reference_staged,
        4,
        Expect(
            0,
            "grad",
            "fc1.bias",
            (0, 1),
            also=(("replica", "fc1.bias"),),
            op="aten._foreach_add_",
            at="in l_pipeline_dp_unsynced",
        ),
    ),
    Case(
        "m",
        "learning-rate scheduler stepped per micro-batch",
        m_scheduler_per_micro,
        reference_scheduled,
        2,
        Expect(1, "param", "fc1.weight", (0, 1), op="aten._foreach_add_", at="in m_scheduler_per_micro"),
        MICRO_STEPS,
    ),
    Case(
        "n",
        "sharded optimizer's parameters never gathered",
        n_sharded_optimizer_no_gather,
        reference_mlp,
        2,
        Expect(1, "loss", "loss", op="aten.t", at="in module 'fc1'"),
    ),
]


def cluster(world: int) -> simdist.Cluster:
    """``world`` GPUs of one DGX-H100 node (the first ones, as ``torchrun --nproc-per-node`` takes them)."""
    return simdist.Cluster.preset("dgx-h100", world_size=world)


def check(case: Case, bug: bool, seed: int) -> simdist.EquivalenceReport:
    """The oracle's verdict on the buggy or the corrected program of ``case``."""
    return simdist.check_equivalence(
        case.program,
        case.reference,
        cluster(case.world),
        args=(seed, bug),
        reference_args=(seed,),
        seed=seed,
        **case.options,
    )


def found_as_expected(rep: simdist.EquivalenceReport, expect: Expect) -> tuple[bool, str]:
    """Whether the report's first divergence is the expected one, and what it was."""
    first = rep.first
    if first is None:
        return False, "reported equivalent"
    got = Expect(
        first.step,
        first.kind,
        first.name,
        first.ranks,
        None if first.difference is None or expect.rel is None else first.difference.rel,
    )
    ok = (got.step, got.kind, got.name) == (expect.step, expect.kind, expect.name)
    ok = ok and (expect.ranks is None or got.ranks == expect.ranks)
    # a bug that scales a tensor by a plain factor leaves exactly that relative difference
    ok = ok and (expect.rel is None or abs(got.rel - expect.rel) < 1e-9 * max(1.0, expect.rel))
    reported = {(d.kind, d.name) for d in rep.divergences if d.step == first.step}
    missing = [f"{kind} {name!r}" for kind, name in expect.also if (kind, name) not in reported]
    also = [f"{kind} {name!r}" for kind, name in expect.also if (kind, name) in reported]
    text = (
        str(got)
        + (f"; also {', '.join(also)}" if also else "")
        + (f"; not reported: {', '.join(missing)}" if missing else "")
    )
    loc = rep.localization
    op = None if loc is None else loc.op
    where = "" if loc is None else f"{loc.site} in module {loc.module!r}"
    localised = op == expect.op and expect.at in where
    text += f"; first op {op or 'not found'}" + ("" if localised else f" at {where or '-'}")
    return ok and not missing and localised, text


def simulated(
    seed: int, verdicts: list[tuple[str, bool, str]], page: simdist.report.ScenarioReport
) -> dict[str, tuple[bool, bool]]:
    """Every case's buggy and corrected program through the oracle; returns (bug found, fix equal) per case."""
    print(
        f"Silent bugs: {len(CASES)} cases, {STEPS} SGD steps each, float64, seed {seed}; "
        "each program against its single-process reference"
    )
    print()
    outcome: dict[str, tuple[bool, bool]] = {}
    rows, texts = [], []
    drifts: dict[str, list[tuple[float, float]]] = {}
    for case in CASES:
        buggy, fixed = check(case, True, seed), check(case, False, seed)
        print(f"({case.key}) {case.title} ({case.world} ranks)")
        print("  bug:       " + "\n             ".join(str(buggy).splitlines()))
        print("  corrected: " + fixed.summary())
        found, got = found_as_expected(buggy, case.expect)
        verdicts.append((f"({case.key}) bug: {case.expect.where()}", found, got))
        verdicts.append(
            (
                f"({case.key}) corrected: equivalent",
                fixed.ok,
                f"{fixed.steps} steps compared" if fixed.ok else fixed.summary(),
            )
        )
        outcome[case.key] = (not buggy.ok, fixed.ok)
        first, loc = buggy.first, buggy.localization
        rows.append(
            [
                f"({case.key})",
                case.title,
                case.world,
                (f"step {first.step} {first.kind} {first.name}", "fail") if first else ("equal", "pass"),
                "-" if loc is None else f"{loc.op} at {loc.site}",
                (found, "pass" if found else "fail"),
                ("equal", "pass") if fixed.ok else (fixed.summary(), "fail"),
            ]
        )
        texts.append(f"({case.key}) {case.title}\n{buggy}")
        if series := drift_series(buggy):
            drifts[f"({case.key})"] = series
    print()
    page.table(
        "Every bug and its correction",
        ["case", "bug", "ranks", "first divergence", "first divergent op", "as expected", "corrected"],
        rows,
        nav="cases",
        note=f"{STEPS} SGD steps each, float64, seed {seed}; each program against its single-process reference.",
    )
    page.line_plot(
        "Parameter drift per step, buggy programs",
        drifts,
        x_label="optimizer step",
        y_label="max |param - reference|",
        log=True,
        nav="drift",
        note="The largest difference of any parameter from the reference's after each step (the oracle's "
        "history); every corrected program stays at rounding (not drawn).",
    )
    page.text("What the oracle reported for each bug", "\n\n".join(texts), nav="oracle reports")
    return outcome


# ---------------------------------------------------------------------------------------------- real gloo
#: kinds of divergence that are final state: parameters and buffers after the last step, and their copies
FINAL_STATE = ("param", "buffer")


def final_state_differs(rep: simdist.EquivalenceReport) -> list[str]:
    """What differs from the reference at the last step: the parameters and buffers the report names, in its order,
    or its first divergence where none of them does (the loss, a gradient, the step count)."""
    names = [
        d.name
        for d in rep.divergences
        if d.kind in FINAL_STATE or (d.kind == "replica" and d.of in FINAL_STATE)
    ]
    if not names and rep.first is not None:
        names = [
            rep.first.kind if rep.first.kind in ("loss", "steps") else f"{rep.first.kind} {rep.first.name}"
        ]
    return list(dict.fromkeys(names))


def on_real_gloo(
    seed: int,
    repeats: int,
    simulated: dict[str, tuple[bool, bool]],
    verdicts: list,
    keys: str | None = None,
    page: simdist.report.ScenarioReport | None = None,
) -> None:
    """Every program (of the cases ``keys``, default all) on real gloo processes, one per rank: its final state
    against the reference's (``real.oracle.check_final_state``), and whether that agrees with the simulated
    verdicts ``simulated``."""
    from real.oracle import FinalStateCheck, check_final_states

    cases = [c for c in CASES if keys is None or c.key in keys]

    print(
        f"Real gloo: every program launched {repeats}x on real processes (one per rank); final state vs the reference"
    )
    print(f"{'':4s} {'buggy program: final tensors that differ':48s} corrected program")
    agree = 0
    rows = []
    for case in cases:
        found: list[simdist.EquivalenceReport] = []
        equal: list[simdist.EquivalenceReport] = []
        # one launch per repeat runs the buggy program, then the corrected one: starting its processes costs more
        # than either program
        for _ in range(repeats):
            checks = [
                FinalStateCheck(
                    case.program, case.reference, seed, (seed, bug), reference_args=(seed,), **case.options
                )
                for bug in (True, False)
            ]
            with importable_by_rank_processes(Path(__file__).parent):
                bug_report, fix_report = check_final_states(
                    checks, case.world, backend="nccl", emulate_cuda=True
                )
            found.append(bug_report)
            equal.append(fix_report)
        bug_text = "; ".join(", ".join(final_state_differs(r)) or "none" for r in found)
        fix_text = (
            "equal"
            if all(r.ok for r in equal)
            else "; ".join(", ".join(final_state_differs(r)) or "equal" for r in equal)
        )
        print(f"({case.key}) {bug_text[:48]:48s} {fix_text}")
        sim_bug, sim_fix = simulated[case.key]
        rows.append(
            [
                f"({case.key})",
                "bug found" if sim_bug else "bug missed",
                bug_text,
                "equal" if sim_fix else "not equal",
                fix_text,
                ("yes", "pass")
                if (not any(r.ok for r in found), all(r.ok for r in equal)) == simulated[case.key]
                else ("no", "fail"),
            ]
        )
        agree += (not any(r.ok for r in found), all(r.ok for r in equal)) == simulated[case.key]
    print()
    if page is not None:
        page.table(
            "Simulated vs real gloo: final state against the reference",
            [
                "case",
                "simulated: bug",
                "real: final tensors that differ",
                "simulated: corrected",
                "real: corrected",
                "agree",
            ],
            rows,
            nav="sim vs real",
            note=f"Every program launched {repeats}x on real gloo processes (one per rank).",
        )
    verdicts.append(
        (
            "real gloo agrees with the simulation",
            agree == len(cases),
            f"{agree} of {len(cases)} cases (bug found, correction equal) x {repeats}",
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--real",
        type=int,
        default=0,
        metavar="N",
        help="also run every program N times on real gloo processes and compare final states",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=REPORTS,
        metavar="DIR",
        help="where the HTML report is written (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    # Case (m) steps its scheduler before the first optimizer step: torch warns about the order of that one call,
    # not about the schedule running MICRO times too fast, which is the bug.
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    verdicts: list[tuple[str, bool, str]] = []
    page = simdist.report.ScenarioReport(
        "Silent bugs of distributed training",
        description=__doc__,
        seed=args.seed,
        command=f"python scenarios/silent_bugs.py --seed {args.seed}"
        + (f" --real {args.real}" if args.real else ""),
    )
    outcome = simulated(args.seed, verdicts, page)
    if args.real:
        on_real_gloo(args.seed, args.real, outcome, verdicts, page=page)
    return finish(page, verdicts, args.out, "silent_bugs")


if __name__ == "__main__":
    sys.exit(main())
