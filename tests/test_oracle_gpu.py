"""The equivalence oracle on programs written for GPUs: their snapshots are compared with the CPU reference.

The oracle is the reference model trained in one process on the CPU; the parallel program is the same model
trained with torch's DDP on simulated GPUs, as a torchrun script on GPUs writes it. Its verdicts must be those
of the same program written for the CPU: equal when clean, the perturbed step and tensor when one rank's
gradient is perturbed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import simdist

WIDTH, BATCH, STEPS = 8, 4, 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)).double()


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, 1, generator=g, dtype=torch.float64)


def reference(world: int) -> None:
    """Every rank's batch at once, in one process on the CPU.

    The optimizer takes the path it takes on CUDA by default (foreach), so that the optimizer ops align.
    """
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(data(r, step) for r in range(world)))
        F.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()


def on_gpus(perturb_rank: int | None) -> None:
    """DDP on the GPU LOCAL_RANK names; ``perturb_rank`` adds 1 to one gradient element at step 1."""
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    net = model().to("cuda")
    ddp = DistributedDataParallel(net, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(dist.get_rank(), step)
        F.mse_loss(ddp(x.to("cuda")), y.to("cuda")).backward()
        if step == 1 and dist.get_rank() == perturb_rank:
            with torch.no_grad():
                net[0].weight.grad[0, 0] += 1.0
        opt.step()


@pytest.mark.parametrize("world", [2, 4])
def test_a_clean_gpu_program_equals_its_cpu_reference(world: int) -> None:
    cluster = simdist.Cluster.switch(world, device="H100")
    rep = simdist.check_equivalence(on_gpus, reference, cluster, args=(None,), reference_args=(world,))
    assert rep.ok, str(rep)
    assert rep.steps == STEPS


def test_a_fault_in_a_gpu_program_is_found_at_its_step_and_tensor() -> None:
    cluster = simdist.Cluster.switch(2, device="H100")
    rep = simdist.check_equivalence(on_gpus, reference, cluster, args=(1,), reference_args=(2,))
    assert not rep.ok
    assert rep.first.step == 1, str(rep)
    # the perturbed gradient differs from the reference and between the replicas (rank 1's only)
    assert any(d.kind == "replica" and d.name == "0.weight" for d in rep.divergences), str(rep)
    # localisation follows the ops on simulated GPU tensors to the optimizer's op that read the gradient
    where = rep.localization
    assert where is not None, str(rep)
    assert where.op == "aten._foreach_add_" and where.phase == "optimizer", str(rep)
    assert where.ranks == (1,), str(rep)


def by_hand(kind: str, bug: str) -> None:
    """Data parallelism written by hand on ``kind``, each rank its batch: each gradient all-reduced, then divided
    by the world size; ``bug``: "sum" never divides, "divide twice" divides before the all-reduce too."""
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    n = dist.get_world_size()
    net = model().to(kind)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(dist.get_rank(), step)
        F.mse_loss(net(x.to(kind)), y.to(kind)).backward()
        for p in net.parameters():
            if bug == "divide twice":
                p.grad.div_(n)
            dist.all_reduce(p.grad)
            if bug != "sum":
                p.grad.div_(n)
        opt.step()


@pytest.mark.parametrize("bug", ["sum", "divide twice"])
def test_an_all_reduce_on_gpu_tensors_is_localised_as_on_the_cpu(bug: str) -> None:
    # the oracle: the same program written for the CPU, localised on the same cluster. An all-reduce writes the
    # CPU tensor inside a simulated GPU tensor, never advancing the wrapper's version: read by the wrapper's,
    # localisation lost the all-reduce of "sum" and blamed the optimizer's op that read its result
    cluster = simdist.Cluster.switch(4, device="H100")
    found = {
        kind: simdist.check_equivalence(
            by_hand, reference, cluster, args=(kind, bug), reference_args=(4,)
        ).localization
        for kind in ("cpu", "cuda")
    }
    assert found["cpu"] is not None and found["cpu"].op == ("all_reduce" if bug == "sum" else "aten.div_")
    assert str(found["cuda"]) == str(found["cpu"])


@pytest.mark.real
def test_a_gpu_program_on_real_processes_emulating_cuda_is_compared_with_its_reference() -> None:
    from real.oracle import FinalStateCheck, check_final_states

    # the program creates its own NCCL group, which real creates for it (over gloo) when emulating CUDA; both
    # programs share one launch (the faulty one first: its state must not leak into the clean one)
    faulty, clean = check_final_states(
        [
            FinalStateCheck(on_gpus, reference, args=(1,), reference_args=(2,)),
            FinalStateCheck(on_gpus, reference, args=(None,), reference_args=(2,)),
        ],
        2,
        backend="nccl",
        emulate_cuda=True,
    )
    assert clean.ok, str(clean)
    assert clean.steps == STEPS
    assert not faulty.ok
    assert any(d.kind == "replica" and d.name == "0.weight" for d in faulty.divergences), str(faulty)
