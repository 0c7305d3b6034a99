"""Rank 0 of two on simulated H100s raises in a hook while the other rank trains: run in a child process by
``test_hostile_cuda.py``, so that a C++ path ending the process fails the tests instead of ending pytest.

``python cuda_hook_raises.py WRAPPER:HOOK ...`` (WRAPPER: ``fsdp2`` or ``ddp``; HOOK: ``tensor``, ``backward`` or
``forward``) runs each case in turn, one process for all of them (each run in a process that ran the ones
before, as a user's process runs one program after another), and prints one JSON object: for each
``WRAPPER:HOOK``, its run's error (the rank, the error's type and text, and the rank's traceback), or null.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import simdist
from simdist.errors import RankError


def _raise(*args: object) -> None:
    raise ValueError("a hook raised")


def program(wrapper: str, hook: str) -> None:
    """One training step of a two-layer model under ``wrapper``; rank 0 registers a ``hook`` that raises."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to("cuda")
    layer = model[2]
    if wrapper == "fsdp2":
        fully_shard(model[0])
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dist.get_rank()])
    if dist.get_rank() == 0:
        if hook == "backward":
            layer.register_full_backward_hook(_raise)
        elif hook == "forward":
            layer.register_forward_hook(_raise)
    out = model(torch.randn(3, 8, device="cuda"))
    if hook == "tensor" and dist.get_rank() == 0:
        out.register_hook(_raise)
    out.sum().backward()


def report(wrapper: str, hook: str) -> dict | None:
    """The error of one run with ``hook`` raising under ``wrapper``, as JSON values; None if it raised nothing."""
    try:
        simdist.run(program, simdist.Cluster.switch(2, device="H100"), args=(wrapper, hook), watchdog=120)
    except RankError as e:
        return {
            "rank": e.rank,
            "type": type(e.exc).__name__,
            "error": str(e.exc),
            "traceback": e.traceback_text,
        }
    return None


if __name__ == "__main__":
    print(json.dumps({case: report(*case.split(":")) for case in sys.argv[1:]}))
