"""A training program written for GPUs, as users write them: one CUDA device per rank, DDP over NCCL.

``python -m real benchmarks/gpu/gpu_program.py --nproc 1 --entry main --backend nccl`` (program.py runs it through
``real.run``). It sets its device, moves the model and each batch with ``.to("cuda")``, times every step
between two ``torch.cuda.Event``s and reads ``torch.cuda.max_memory_allocated()`` at the end. twin_program.py
is the same job with the device a parameter, for simdist.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from training import JOB, Job, batches, build_model, checksum


def main(job: Job = JOB) -> dict:
    """Train ``job`` on this rank's GPU; losses, per-step event times (seconds), peak memory, checksum."""
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.backends.cuda.matmul.allow_tf32 = (
        False  # float32 matmuls in float32, as on the CPU it is compared with
    )
    model = build_model(job).to("cuda")
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=job.lr)
    losses, step_s = [], []
    for inputs, targets in batches(job):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        inputs, targets = inputs.to("cuda"), targets.to("cuda")
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.view(-1, job.vocab), targets.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        step_s.append(start.elapsed_time(end) / 1e3)
        losses.append(loss.item())
    return {
        "losses": losses,
        "step_s": step_s,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "checksum": checksum(model),
        "world": dist.get_world_size(),
        "device": torch.cuda.get_device_name(),
    }
