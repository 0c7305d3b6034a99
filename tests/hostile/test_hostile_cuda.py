"""Hostile CUDA code on simulated GPUs: devices mixed, devices the node lacks, host conversions, allocations past
the device's memory, CUDA code on a cluster without GPUs, a process where the simulated GPU cannot be set up; and
a sweep over modules, dtypes and ``torch.cuda`` calls that must end in results or errors, never in an abort."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from simdist.compute import get_device
from simdist.errors import CudaEmulationError, OutOfMemoryError, RankError

PAIR = simdist.Cluster.switch(2, device="H100")
#: an H100 with 64 MiB of memory: what fits is decided by the device, and the host can hold it too
SMALL = simdist.Cluster.switch(2, device=dataclasses.replace(get_device("H100"), memory_capacity=2**26))
HERE = Path(__file__).resolve().parent


def _cuda0_plus_cuda1() -> None:
    torch.ones(2, device="cuda:0") + torch.ones(2, device="cuda:1")


def _gpu_times_host_matrix() -> None:
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2)


def _set_missing_device() -> None:
    torch.cuda.set_device(dist.get_world_size() + 3)


def _gpu_numpy() -> None:
    torch.ones(2, device="cuda").numpy()


def _allocate_past_capacity() -> None:
    torch.empty(81 * 2**30, dtype=torch.uint8, device="cuda")  # 81 GiB on an 80 GiB H100


def _retry_smaller_batch() -> int:
    """What training scripts do on OOM: catch it, halve the batch, go on."""
    batch = 2**40
    while True:
        try:
            x = torch.empty(batch, device="cuda")
            return x.numel()
        except torch.cuda.OutOfMemoryError:
            batch //= 2


def _cuda_on_cpu_cluster() -> None:
    torch.cuda.set_device(0)


def _elapsed_before_the_device_gets_there() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.ones(1 << 20, device="cuda").mul_(2)
    end.record()
    return start.elapsed_time(end)  # no synchronize: CUDA says "device not ready"


def _self_check_fails() -> None:
    version = torch.__version__
    torch.__version__ = "3.0.0"  # a torch whose native layout the emulation was not written for
    try:
        simdist.run(lambda: None, PAIR)
    finally:
        torch.__version__ = version


def _swap_data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight surgery through ``.data``: a new shape and dtype for a parameter, then a step on it."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(2, 2, device=kind))
    p.data = torch.arange(6.0, device=kind).view(3, 2).double()
    (p * p).sum().backward()
    return p.detach().cpu(), p.grad.cpu()


def _same_as_the_cpu_program(result: simdist.RunResult) -> None:
    cpu = simdist.run(_swap_data, PAIR, args=("cpu",))
    for gpu_rank, cpu_rank in zip(result.returns, cpu.returns):
        assert all(torch.equal(a, b) for a, b in zip(gpu_rank, cpu_rank))


def _ddp_model_to_host() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    model = torch.nn.Linear(2, 2).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dist.get_rank()])
    ddp(torch.ones(1, 2, device="cuda")).sum().backward()
    model.cpu()  # DDP's reducer still holds the parameters


def _check_retry(result: simdist.RunResult) -> None:
    # the largest power of two whose float32 tensor fits in 64 MiB: 2**24 elements
    assert result.returns == [2**24, 2**24]


CASES = [
    Case(
        "cuda0_plus_cuda1",
        "adds a tensor on cuda:0 to one on cuda:1",
        lambda: simdist.run(_cuda0_plus_cuda1, PAIR),
        error=RankError,
        match=r"same device, but found at least two devices, cuda:0 and cuda:1!.*aten::add",
    ),
    Case(
        "gpu_times_host_matrix",
        "multiplies a GPU matrix by a host matrix",
        lambda: simdist.run(_gpu_times_host_matrix, PAIR),
        error=RankError,
        match=r"cuda:0 and cpu!.*aten::mm",
    ),
    Case(
        "set_missing_device",
        "sets a CUDA device the node does not have",
        lambda: simdist.run(_set_missing_device, PAIR),
        error=RankError,
        match=r"invalid device ordinal: device 5 does not exist; this simulated node has 2 GPUs",
    ),
    Case(
        "gpu_numpy",
        "converts a GPU tensor to NumPy without .cpu()",
        lambda: simdist.run(_gpu_numpy, PAIR),
        error=RankError,
        match=r"can't convert cuda:0 device type tensor to numpy\. Use Tensor\.cpu\(\)",
    ),
    Case(
        "allocate_past_capacity",
        "allocates 81 GiB on an 80 GiB GPU",
        lambda: simdist.run(_allocate_past_capacity, PAIR, memory=True),
        error=OutOfMemoryError,
        match=r"tried to allocate 81 GiB .* rank \d has 0 B of 80 GiB \(H100\).* in op aten::empty",
    ),
    Case(
        "retry_smaller_batch",
        "catches torch.cuda.OutOfMemoryError and halves its batch until it fits",
        lambda: simdist.run(_retry_smaller_batch, SMALL, memory=True),
        check=_check_retry,
    ),
    Case(
        "cuda_on_cpu_cluster",
        "runs CUDA code on a cluster whose device is the CPU",
        lambda: simdist.run(_cuda_on_cpu_cluster, simdist.Cluster.switch(2, device="cpu")),
        error=RankError,
        match=r"used CUDA \(torch.cuda.set_device\) at .*test_hostile_cuda.py:\d+.*no GPU model.*GPU preset",
    ),
    Case(
        "elapsed_time_not_ready",
        "reads an event's elapsed time before the device reached it",
        lambda: simdist.run(_elapsed_before_the_device_gets_there, PAIR),
        error=RankError,
        match=r"CUDA error: device not ready.*synchronize",
    ),
    Case(
        "gpu_data_assigned",
        "assigns a parameter on the GPU new data of another shape and dtype through .data",
        lambda: simdist.run(_swap_data, PAIR, args=("cuda",)),
        check=_same_as_the_cpu_program,
    ),
    Case(
        "ddp_model_moved_to_host",
        "moves a DDP-wrapped model's parameters to the host while DDP holds them",
        lambda: simdist.run(_ddp_model_to_host, PAIR),
        error=RankError,
        match=r"tensor\.data = <a tensor on cpu> for a tensor on cuda:\d: .*becomes a host tensor only where nothing "
        r"else holds it",
    ),
    Case(
        "self_check_fails",
        "runs CUDA code on a torch whose native layout the emulation does not know",
        _self_check_fails,
        error=CudaEmulationError,
        match=r"need, in this process: torch 3\.0\.0",
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile_cuda(case: Case) -> None:
    check(case)


@pytest.mark.slow
def test_a_sweep_over_modules_dtypes_and_cuda_calls_never_aborts() -> None:
    """Hypothesis drives programs in a child process: an abort (a C++ path ending the process) fails this test
    with the last program it started, instead of ending pytest."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "cuda_sweep.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"the sweep's process ended with status {done.returncode}:\n{tail}"
    assert "sweep done" in done.stdout, tail
