"""FSDP2 over tensor parallelism on a 2-D (dp, tp) mesh of simulated GPUs, as pytorch/examples'
``distributed/tensor_parallelism/fsdp_tp_example.py`` writes it, in small: a sequence-parallel norm, a column-wise
and a row-wise linear, ``fully_shard`` over the data-parallel dimension, AdamW. Rank code for
``benchmarks/scale_symmetry.py --fsdp-tp`` and for the tests of timing-only and symmetric runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import simdist


def fsdp2_over_tp(width: int, tp: int, steps: int, meta: bool) -> float:
    """``steps`` training steps on tensor-parallel groups of ``tp`` ranks; the model made on the GPU, or on the
    meta device and then materialised there (``meta``). Returns the simulated time at the end."""
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    # also the seed of DTensor's random-number tracker, which otherwise has rank 0 send its own to the others
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cuda"):
        model = torch.nn.Sequential(
            torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        )
    plan = {
        "0": SequenceParallel(),
        "1": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, mesh["tp"], plan)
    parallelize_module(model[1], mesh["tp"], ColwiseParallel())
    fully_shard(model, mesh=mesh["dp"])
    if meta:
        model.to_empty(device="cuda")
        for layer in model:
            layer.reset_parameters()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for step in range(steps):
        torch.manual_seed(step + mesh["dp"].get_local_rank())  # the same batch across a tensor-parallel group
        model(torch.randn(4, 8, width, device="cuda")).sum().backward()
        optim.step()
        optim.zero_grad()
    torch.cuda.synchronize()
    return simdist.now()
