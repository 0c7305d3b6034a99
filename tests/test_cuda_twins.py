"""Programs written for GPUs run unmodified on a GPU cluster, and their results equal, bit for bit, those of the same
program written for the CPU (the oracle: both compute with the same CPU kernels)."""

from __future__ import annotations

import pytest
import torch
from cuda_fns import ddp_train, fsdp1_train, fsdp2_train

import simdist

PAIR = simdist.Cluster.switch(2, device="H100")
#: the CPU program's twin cluster: the same topology without GPUs, where a group named "nccl" takes CPU tensors
#: (on the GPU cluster NCCL refuses them) and adds in NCCL's order, as the GPU program's group does
CPU_PAIR = simdist.Cluster.switch(2, device="cpu")


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
    cpu = simdist.run(ddp_train, CPU_PAIR, args=("cpu", options), backend_name="nccl")
    gpu = simdist.run(ddp_train, PAIR, args=("cuda", options))
    _same(cpu, gpu)


def test_fsdp1_written_for_cuda_equals_its_cpu_twin_bitwise() -> None:
    cpu = simdist.run(fsdp1_train, CPU_PAIR, args=("cpu",), backend_name="nccl")
    gpu = simdist.run(fsdp1_train, PAIR, args=("cuda",))
    _same(cpu, gpu)


def test_fsdp2_written_for_cuda_equals_its_cpu_twin_bitwise() -> None:
    cpu = simdist.run(fsdp2_train, CPU_PAIR, args=("cpu",), backend_name="nccl")
    gpu = simdist.run(fsdp2_train, PAIR, args=("cuda",))
    _same(cpu, gpu)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_ddp_communication_hooks_written_for_cuda_equal_their_cpu_twins_bitwise(hook: str) -> None:
    cpu = simdist.run(ddp_train, PAIR, args=("cpu", {}, 3, hook), backend_name="gloo")
    # on the GPU cluster (DDP's bf16 hook asks torch.cuda for CUDA 11 and NCCL 2.10), through gloo, as a CPU
    # program there: two ranks' sums are one addition each, which gives the same bits in either order
    gpu = simdist.run(ddp_train, PAIR, args=("cuda", {}, 3, hook))
    _same(cpu, gpu)
    plain = simdist.run(ddp_train, PAIR, args=("cuda", {}, 3))
    # the hook ran: its compression changed the parameters
    assert not all(torch.equal(a, b) for a, b in zip(plain.returns[0][0], gpu.returns[0][0]))


def _attention(kind: str, mask: str) -> list[torch.Tensor]:
    """Scaled dot-product attention (forward and gradients) with no mask, a causal one, a boolean or a float mask."""
    dev = torch.device(kind)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen).to(dev).requires_grad_() for _ in range(3))
    masks = {
        "none": None,
        "bool": torch.rand(16, 16, generator=gen).gt(0.3).to(dev),
        "float": torch.randn(16, 16, generator=gen).to(dev),
    }
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=masks.get(mask), is_causal=mask == "causal"
    )
    out.pow(2).sum().backward()
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_attention_on_a_gpu_takes_the_cpu_programs_kernel(mask: str) -> None:
    one = simdist.Cluster.switch(1, device="H100")
    cpu = simdist.run(_attention, one, args=("cpu", mask)).returns[0]
    gpu = simdist.run(_attention, one, args=("cuda", mask)).returns[0]
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu))
