"""Programs written for GPUs run unmodified on a GPU cluster, and their results equal, bit for bit, those of the same
program written for the CPU (the oracle: both compute with the same CPU kernels)."""

from __future__ import annotations

import pytest
import torch
from cuda_fns import ddp_train, fsdp1_train, fsdp2_train

import simdist

PAIR = simdist.Cluster.switch(2, device="H100")


def _same(cpu: simdist.RunResult, gpu: simdist.RunResult) -> None:
    for rank in range(cpu.world_size):
        cpu_params, cpu_losses, _ = cpu.returns[rank]
        gpu_params, gpu_losses, where = gpu.returns[rank]
        assert where == f"cuda:{rank}"
        assert cpu_losses == gpu_losses
        assert len(cpu_params) == len(gpu_params)
        for a, b in zip(cpu_params, gpu_params):
            assert type(b) is torch.Tensor and b.device.type == "cpu"  # returns leave the run on the host
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_as_bucket_view": True}, {"find_unused_parameters": True}, {"static_graph": True}],
    ids=["default", "bucket_view", "find_unused", "static_graph"],
)
def test_ddp_written_for_cuda_equals_its_cpu_twin_bitwise(options: dict) -> None:
    cpu = simdist.run(ddp_train, PAIR, args=("cpu", options), backend_name="nccl")
    gpu = simdist.run(ddp_train, PAIR, args=("cuda", options))
    _same(cpu, gpu)


def test_fsdp1_written_for_cuda_equals_its_cpu_twin_bitwise() -> None:
    cpu = simdist.run(fsdp1_train, PAIR, args=("cpu",), backend_name="nccl")
    gpu = simdist.run(fsdp1_train, PAIR, args=("cuda",))
    _same(cpu, gpu)


def test_fsdp2_written_for_cuda_equals_its_cpu_twin_bitwise() -> None:
    cpu = simdist.run(fsdp2_train, PAIR, args=("cpu",), backend_name="nccl")
    gpu = simdist.run(fsdp2_train, PAIR, args=("cuda",))
    _same(cpu, gpu)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_ddp_communication_hooks_written_for_cuda_equal_their_cpu_twins_bitwise(hook: str) -> None:
    cpu = simdist.run(ddp_train, PAIR, args=("cpu", {}, 3, hook), backend_name="nccl")
    gpu = simdist.run(ddp_train, PAIR, args=("cuda", {}, 3, hook))
    _same(cpu, gpu)
    plain = simdist.run(ddp_train, PAIR, args=("cuda", {}, 3))
    # the hook ran: its compression changed the parameters
    assert not all(torch.equal(a, b) for a, b in zip(plain.returns[0][0], gpu.returns[0][0]))
