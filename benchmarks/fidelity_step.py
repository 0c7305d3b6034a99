"""The end-to-end rows of ``benchmarks/fidelity.py``: one data-parallel GPT-2 training step priced op by op.

A published step (llm.c's GPT-2 124M on 8 GPUs) is priced as simdist prices its parts, without running it:

- compute: one rank's forward, loss and backward over its micro-batch, in bfloat16, on meta tensors under
  ``simdist.compute.estimate`` (attention as a simulated run prices it: one fused kernel forward and one backward,
  priced by the device's attention model), and the AdamW
  update of its ZeRO-1 shard of float32 master weights (``1/gpus`` of the parameters);
- communication: ZeRO-1's reduce-scatter of the bfloat16 gradients and all-gather of the bfloat16 parameters,
  each simulated on the cluster (``predict_collective``);
- no overlap between them: llm.c reduces its gradients after the backward pass.

Run on its own (``python benchmarks/fidelity_step.py``) it prints the parts of each row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# benchmarks/gpu is a folder of scripts, not a package: its modules are imported by name
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from model import TinyGPT

from simdist.compute import estimate
from simdist.network.cluster import Cluster


@dataclass(frozen=True)
class StepShape:
    """A GPT-2 configuration and its data-parallel batch: ``micro_batch`` sequences of ``seq_len`` per rank."""

    n_layer: int
    n_head: int
    d_model: int
    vocab: int
    seq_len: int
    micro_batch: int
    gpus: int


@dataclass(frozen=True)
class StepPrice:
    """The seconds of each part of a step, and the parameter count they were priced for."""

    compute_s: float
    optimizer_s: float
    comm_s: float
    params: int

    @property
    def total_s(self) -> float:
        """The step: the parts one after another."""
        return self.compute_s + self.optimizer_s + self.comm_s


def _model(shape: StepShape) -> TinyGPT:
    """The model on the meta device, in bfloat16 (llm.c's compute type), its head tied to the embedding as GPT-2's."""
    with torch.device("meta"):
        model = TinyGPT(shape.vocab, shape.d_model, shape.n_head, shape.n_layer, shape.seq_len)
    model.head.weight = model.embed.weight
    return model.to(torch.bfloat16)


def _forward_backward(model: TinyGPT, shape: StepShape) -> Callable[[], None]:
    """One rank's forward, cross-entropy loss and backward over its micro-batch."""
    tokens = torch.zeros(shape.micro_batch, shape.seq_len, dtype=torch.long, device="meta")

    def run() -> None:
        logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, shape.vocab), tokens.view(-1))
        loss.backward()

    return run


def _optimizer_step(shard: int) -> Callable[[], None]:
    """AdamW over one flat float32 shard of ``shard`` master weights (torch's single-tensor path)."""
    param = torch.nn.Parameter(torch.empty(shard, device="meta"))
    param.grad = torch.empty(shard, device="meta")
    opt = torch.optim.AdamW([param], lr=6e-4, foreach=False)
    return opt.step


def price_step(
    shape: StepShape, cluster: Cluster, predict_collective: Callable[[Cluster, str, int], float]
) -> StepPrice:
    """The step of ``shape`` on ``cluster``: compute priced on its device, collectives by ``predict_collective``."""
    model = _model(shape)
    params = sum(p.numel() for p in model.parameters())
    compute_s, _ = estimate(_forward_backward(model, shape), device=cluster.device)
    optimizer_s, _ = estimate(_optimizer_step(-(-params // shape.gpus)), device=cluster.device)
    grad_bytes = params * torch.bfloat16.itemsize
    comm_s = predict_collective(cluster, "reduce_scatter", grad_bytes) + predict_collective(
        cluster, "all_gather", grad_bytes
    )
    return StepPrice(compute_s, optimizer_s, comm_s, params)
