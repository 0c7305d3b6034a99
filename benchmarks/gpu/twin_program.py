"""gpu_program.py's job with the device a parameter: on a CPU through ``real``, or simulated by simdist.

The same model, seed, data, optimizer and loop; only the device and the clock differ. ``clock`` returns
seconds after waiting for the device: ``time.perf_counter`` on a CPU; under simdist, a function that calls
``simdist.synchronize()`` and returns ``simdist.now()`` (compare.py passes one), so step times are simulated.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from training import JOB, Job, batches, build_model, checksum


def main(job: Job = JOB, device: str = "cpu", clock: Callable[[], float] = time.perf_counter) -> dict:
    """Train ``job`` on ``device``; losses, per-step times (seconds, by ``clock``) and the checksum."""
    model = build_model(job).to(device)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=job.lr)
    losses, step_s = [], []
    for inputs, targets in batches(job):
        start = clock()
        inputs, targets = inputs.to(device), targets.to(device)
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.view(-1, job.vocab), targets.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s.append(clock() - start)
        losses.append(loss.item())
    return {
        "losses": losses,
        "step_s": step_s,
        "peak_bytes": None,
        "checksum": checksum(model),
        "world": dist.get_world_size(),
        "device": device,
    }
