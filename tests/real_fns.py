"""Rank functions for tests/test_real.py, importable by the spawned rank processes.

Also a script in the shared convention, with ``main()`` as its entry:
``python -m real tests/real_fns.py --nproc 2 --entry main``.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
from torch.nn.parallel import DistributedDataParallel as DDP

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def all_reduce_arange(n: int) -> dict[str, Any]:
    """Each rank contributes ``arange(n) * (rank + 1)``; returns the sum and what the rank saw."""
    rank = dist.get_rank()
    tensor = torch.arange(n, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(tensor)
    return {
        "sum": tensor,
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {key: os.environ[key] for key in _LAUNCHER_VARS},
        "extra": os.environ.get("REAL_TEST_EXTRA"),
        "omp_threads": torch.get_num_threads(),
    }


def fail_on_rank_1() -> float:
    """Rank 1 raises while rank 0 waits in a collective that can never complete."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses to reduce")
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    return float(tensor.sum())


def hang(arrived: str | None = None) -> None:
    """Never returns: only the launcher's timeout ends it. Creates the file ``arrived`` (if given) on entry."""
    if arrived is not None:
        open(arrived, "w").close()
    while True:
        time.sleep(0.1)


def main(scale: int = 1) -> int:
    """Script entry: returns ``scale * sum(rank + 1 for every rank)``."""
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return int(tensor.item()) * scale


if __name__ == "__main__":
    print("run me with: python -m real tests/real_fns.py --nproc 2 --entry main")


def powersgd_grads(steps: int = 3) -> list:
    """torch DDP with torch's PowerSGD comm hook at full rank (so it equals plain averaging): each step's grads.

    (torch 2.13's ``batched_powerSGD_hook`` fails its own assertion in ``_orthogonalize`` on real gloo too.)
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DDP(model)
    state = P.PowerSGDState(
        process_group=None, matrix_approximation_rank=16, start_powerSGD_iter=2, min_compression_rate=0.0,
        use_error_feedback=False, warm_start=False,
    )
    ddp.register_comm_hook(state, P.powerSGD_hook)
    out = []
    for step in range(steps):
        model.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        ddp(x).pow(2).mean().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    # the hook's last collective can still be queued on gloo's worker thread when the rank returns; a process
    # that exits (or pickles its return) with it in flight has been seen to abort in gloo's teardown
    # ("Resource deadlock avoided"): gloo's barrier waits for every operation issued before it
    dist.barrier()
    return out


def leave_traces() -> dict[str, Any]:
    """Change what a later launch would see if its processes descended from this one (they must not)."""
    seen = seen_at_start()
    torch._real_warm_trace = "left by an earlier launch"  # type: ignore[attr-defined]
    os.environ["REAL_WARM_LEFT"] = "1"
    torch.manual_seed(1234)
    return seen


def seen_at_start() -> dict[str, Any]:
    """What a rank process finds when its rank code starts: its parent, the probe variable, earlier traces."""
    return {
        "ppid": os.getppid(),
        "probe": os.environ.get("REAL_WARM_PROBE"),
        "gone": os.environ.get("REAL_WARM_GONE"),
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "trace": getattr(torch, "_real_warm_trace", None),
        "left": os.environ.get("REAL_WARM_LEFT"),
        "rand": torch.rand(3),
        "seeds": (torch.initial_seed(), int(np.random.get_state()[1][1]), random.random()),
    }


def say_hello(word: str) -> None:
    """Print ``word`` and this rank on standard output and error."""
    print(f"{word} from rank {dist.get_rank()} on stdout", flush=True)
    print(f"{word} from rank {dist.get_rank()} on stderr", file=__import__("sys").stderr, flush=True)
