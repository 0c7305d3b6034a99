"""A torchrun-style DDP training script: ``python -m torch.distributed.run --nproc-per-node 2 train_ddp.py OUT``
or ``simdist run train_ddp.py --world-size 2 -- OUT``.

Each rank writes ``OUT/rank<RANK>.json`` (the launch's environment as it sees it, its ``sys.argv``, its module's
``__name__``) and rank 0 the trained parameters to ``OUT/params.pt``. ``init_process_group`` is imported by name,
as torchrun scripts often do.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

#: what torchrun sets for each process and simdist presents to each rank
LAUNCH = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def train(out: str, steps: int, seed: int) -> None:
    init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(
        seed + rank
    )  # a different start on each rank: DDP's first broadcast makes the replicas equal
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seen = {"env": {k: os.environ.get(k) for k in LAUNCH}, "argv": sys.argv, "name": __name__}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(out, "params.pt"))
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.out, args.steps, args.seed)
    sys.exit(0)
