"""Programs built on torch's parallelism, checkpointing, mixed precision and fused kernels, written twice, for GPUs
and for the CPU: the tests run both under simdist and compare them (the CPU twin is the oracle)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _device(kind: str) -> torch.device:
    """The rank's local GPU (set as current first, as GPU scripts do), or the CPU."""
    if kind == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _data(*shape: int) -> torch.Tensor:
    """The rank's input batch, from a generator of its own (the global ones stay untouched)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + dist.get_rank()))


def tp_train(kind: str, sequence_parallel: bool = False) -> list[torch.Tensor]:
    """A tensor-parallel MLP (ColwiseParallel, RowwiseParallel; with ``sequence_parallel``, SequenceParallel
    layer norms around it) on ``init_device_mesh(kind)``, two AdamW steps; the full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dev = _device(kind)
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
    model = model.to(dev)
    if sequence_parallel:
        plan = {
            "0": SequenceParallel(),
            "1": ColwiseParallel(input_layouts=Shard(1)),
            "3": RowwiseParallel(output_layouts=Shard(1)),
            "4": SequenceParallel(),
        }
    else:
        plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    # the layer norms' parameters stay plain tensors without sequence parallelism: no foreach over a mix
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=sequence_parallel)
    torch.manual_seed(1)  # every rank feeds the same batch to a tensor-parallel model
    for _ in range(2):
        x = torch.randn(2, 8, 16).to(dev)
        y = model(x)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [
        p.full_tensor().detach().cpu() if hasattr(p, "full_tensor") else p.detach().cpu()
        for p in model.parameters()
    ]


def fsdp_tp_train(kind: str) -> list[torch.Tensor]:
    """FSDP2 over tensor parallelism on a 2-D mesh (data parallel x tensor parallel), two AdamW steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dev = _device(kind)
    mesh = init_device_mesh(kind, (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(dev)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    for step in range(2):
        torch.manual_seed(10 + step + mesh["dp"].get_local_rank())  # one batch per data-parallel replica
        model(torch.randn(4, 16).to(dev)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().cpu() for p in model.parameters()]


def pipeline_train(kind: str, schedule: str) -> list[torch.Tensor]:
    """Two pipeline stages (``PipelineStage`` on the rank's device) under ``schedule`` ("gpipe" or "1f1b"), four
    microbatches, one SGD step; the stage's parameters."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("nccl" if kind == "cuda" else None)
    dev = _device(kind)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    rank = dist.get_rank()
    part = full[2 * rank : 2 * rank + 2].to(dev)
    stage = PipelineStage(part, rank, 2, dev)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, 4, loss_fn=lambda out, target: (out - target).pow(2).mean())
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    x, target = torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 16, generator=g).to(dev)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=target)
    opt.step()
    return [p.detach().cpu() for p in part.parameters()]


def checkpoint_train(kind: str, use_reentrant: bool, checkpointed: bool = True) -> list[torch.Tensor]:
    """A block with dropout under ``torch.utils.checkpoint`` (recomputed in backward, which must draw the same
    masks), or run plainly with ``checkpointed=False``; the gradients."""
    from torch.utils.checkpoint import checkpoint

    dev = _device(kind)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 16)).to(dev)
    x = _data(4, 16).to(dev).requires_grad_()
    # the CPU generator and every device's start from one seed: the twins' dropout masks are the same numbers
    torch.manual_seed(1)
    y = checkpoint(block, x, use_reentrant=use_reentrant) if checkpointed else block(x)
    y = F.dropout(y, 0.25)  # a draw after the block: recomputation must not disturb the generator
    y.pow(2).sum().backward()
    return [p.grad.cpu() for p in block.parameters()] + [x.grad.cpu()]


class _Net(nn.Module):
    """Linear, LayerNorm, Linear: a matmul autocast runs in low precision, a norm it runs in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))

    def by_hand(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The forward with the casts CUDA autocast makes (linear in ``dtype``, layer_norm in float32)."""

        def linear(m: nn.Linear, h: torch.Tensor) -> torch.Tensor:
            return F.linear(h.to(dtype), m.weight.to(dtype), m.bias.to(dtype))

        h = linear(self.a, x)
        h = F.layer_norm(h.float(), (32,), self.norm.weight, self.norm.bias, self.norm.eps)
        return linear(self.b, h)


def amp_train(kind: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """Three SGD steps with ``torch.autocast("cuda", dtype)`` and ``GradScaler`` (the CPU twin casts by hand as
    CUDA autocast does); the second step's batch holds an inf, so the scaler skips it and halves its scale.
    Returns the parameters, the losses and the scales."""
    dev = _device(kind)
    torch.manual_seed(0)
    net = _Net().to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(kind, init_scale=2.0**10)
    g = torch.Generator().manual_seed(3)
    losses, scales = [], []
    for step in range(3):
        x = torch.randn(4, 16, generator=g)
        if step == 1:
            x[0, 0] = float("inf")
        x = x.to(dev)
        if kind == "cuda":
            with torch.autocast("cuda", dtype=dtype):
                out = net(x)
        else:
            out = net.by_hand(x, dtype)
        assert out.dtype == dtype
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return [p.detach().cpu() for p in net.parameters()], losses, scales


def attention_train(kind: str, causal: bool) -> list[torch.Tensor]:
    """``F.scaled_dot_product_attention`` forward and backward; the output and the inputs' gradients."""
    dev = _device(kind)
    q, k, v = (_data(2, 4, 16, 8).to(dev).requires_grad_() for _ in range(3))
    mask = None if causal else torch.randn(16, 16, generator=torch.Generator().manual_seed(5)).to(dev)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    out.pow(2).sum().backward()
    return [out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()]


def rnn_train(kind: str, cls: str) -> list[torch.Tensor]:
    """A two-layer ``nn.LSTM`` or ``nn.GRU`` (``cls``) forward and backward; the output and the gradients."""
    dev = _device(kind)
    torch.manual_seed(0)
    rnn = getattr(nn, cls)(8, 16, num_layers=2).to(dev)
    out, _ = rnn(_data(5, 3, 8).to(dev))
    out.pow(2).sum().backward()
    return [out.detach().cpu()] + [p.grad.cpu() for p in rnn.parameters()]


def syncbn_train(steps: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A convolution and ``SyncBatchNorm`` (``convert_sync_batchnorm``) under DDP on the rank's GPU, SGD steps; the
    parameters, the running statistics, and the last step's input gradient."""
    dist.init_process_group("nccl")
    dev = _device("cuda")
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).to(
        dev
    )
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    weights = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(9)).to(dev)
    for step in range(steps):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(20 * step + dist.get_rank()))
        x = x.to(dev).requires_grad_()
        (ddp(x) * weights).sum().backward()
        opt.step()
        opt.zero_grad()
    norm = model[1]
    return (
        [p.detach().cpu() for p in model.parameters()],
        [norm.running_mean.cpu(), norm.running_var.cpu()],
        x.grad.cpu(),
    )


def ctc_train(kind: str) -> list[torch.Tensor]:
    """``F.ctc_loss`` (lengths on the device, as the log-probabilities) forward and backward; the loss and the
    log-probabilities' gradient."""
    dev = _device(kind)
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(10, 2, 5, generator=g).log_softmax(2).to(dev).requires_grad_()
    targets = torch.randint(1, 5, (2, 4), generator=g).to(dev)
    lengths = torch.tensor([10, 10]).to(dev), torch.tensor([4, 3]).to(dev)
    loss = F.ctc_loss(log_probs, targets, *lengths)
    loss.backward()
    return [loss.detach().cpu(), log_probs.grad.cpu()]


def compiled_train(kind: str) -> list[torch.Tensor]:
    """A model under ``torch.compile(backend="eager")``, two AdamW steps; the parameters and the last output."""
    dev = _device(kind)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16)).to(dev)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    for _ in range(2):
        out = compiled(_data(4, 16).to(dev))
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()] + [out.detach().cpu()]


def dtensor_attention(kind: str) -> list[torch.Tensor]:
    """Causal attention on DTensors sharded by heads over ``init_device_mesh(kind)``, forward and backward; the
    full output and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dev = _device(kind)
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        distribute_tensor(torch.randn(2, 4, 8, 8, generator=g).to(dev), mesh, [Shard(1)]).requires_grad_()
        for _ in range(3)
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.pow(2).sum().backward()
    return [t.full_tensor().cpu() for t in (out.detach(), q.grad, k.grad, v.grad)]
