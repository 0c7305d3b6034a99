"""The training job both programs run: model size, optimizer settings and data, from one seed.

gpu_program.py (written for CUDA, as users write GPU code) and twin_program.py (the same job with the device
a parameter, for the CPU and for simdist) take their configuration and batches from here, so their losses and
final parameters can be compared number for number.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from model import TinyGPT


@dataclass(frozen=True)
class Job:
    """Model and data sizes, steps and learning rate of the comparison job."""

    vocab: int = 4096
    d_model: int = 256
    heads: int = 4
    layers: int = 2
    seq: int = 128
    batch: int = 8
    steps: int = 8
    lr: float = 1e-3
    seed: int = 0

    def as_dict(self) -> dict:
        """The job as plain JSON data."""
        return asdict(self)


#: the job as measured on the GPU and simulated; dry runs take a smaller one
JOB = Job()
DRY_JOB = Job(vocab=256, d_model=32, heads=2, layers=1, seq=16, batch=2, steps=3)


def build_model(job: Job) -> TinyGPT:
    """The model, initialised on the CPU from ``job.seed`` (the same parameters whatever device it moves to)."""
    torch.manual_seed(job.seed)
    return TinyGPT(job.vocab, job.d_model, job.heads, job.layers, job.seq)


def batches(job: Job) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``job.steps`` (inputs, targets) pairs of token ids on the CPU: next-token prediction on random text."""
    gen = torch.Generator().manual_seed(job.seed + 1)
    out = []
    for _ in range(job.steps):
        tokens = torch.randint(job.vocab, (job.batch, job.seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def checksum(model: torch.nn.Module) -> float:
    """Sum of every parameter element in float64: one number that moves with any parameter."""
    return float(sum(p.detach().double().sum().cpu() for p in model.parameters()))
