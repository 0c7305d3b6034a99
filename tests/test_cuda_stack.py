"""What torch builds on a GPU runs on the simulated one: tensor and sequence parallelism, FSDP2 over TP, pipelining,
activation checkpointing, autocast with GradScaler, attention, recurrent layers and SyncBatchNorm, each written for
CUDA and checked against the same program written for the CPU (bit for bit where both run the same CPU kernels),
or against a single-process model where torch has no CPU twin."""

from __future__ import annotations

import math

import pytest
import torch
from cuda_stack_fns import (
    amp_train,
    attention_train,
    checkpoint_train,
    compiled_train,
    ctc_train,
    dtensor_attention,
    fsdp_tp_train,
    pipeline_train,
    rnn_train,
    syncbn_train,
    tp_train,
)
from torch import nn

import simdist
from simdist.errors import UnsupportedCudaOpError

PAIR = simdist.Cluster.switch(2, device="H100")
ONE = simdist.Cluster.switch(1, device="H100")


def _twins(fn, cluster: simdist.Cluster, *args) -> tuple[list, list]:
    # the CPU program runs on the same switch without GPUs, where a group named "nccl" takes CPU tensors (on the
    # GPU cluster NCCL refuses them) and adds in NCCL's order, as the GPU program's group does
    on_cpu = simdist.Cluster.switch(cluster.world_size, device="cpu")
    cpu = simdist.run(fn, on_cpu, args=("cpu", *args), backend_name="nccl")
    gpu = simdist.run(fn, cluster, args=("cuda", *args))
    return cpu.returns, gpu.returns


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (math.isnan(a) and math.isnan(b))  # a skipped step's loss is nan in both


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_written_for_cuda_equals_its_cpu_twin_bitwise(sequence_parallel: bool) -> None:
    cpu, gpu = _twins(tp_train, PAIR, sequence_parallel)
    assert _equal(cpu, gpu)


def test_fsdp2_over_tensor_parallel_on_a_2d_cuda_mesh_equals_its_cpu_twin_bitwise() -> None:
    cpu, gpu = _twins(fsdp_tp_train, simdist.Cluster.switch(4, device="H100"))
    assert _equal(cpu, gpu)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelining_on_cuda_stages_equals_its_cpu_twin_bitwise(schedule: str) -> None:
    cpu, gpu = _twins(pipeline_train, PAIR, schedule)
    assert _equal(cpu, gpu)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_recomputes_gpu_dropout_with_the_saved_device_generator(
    use_reentrant: bool,
) -> None:
    cpu, gpu = _twins(checkpoint_train, ONE, use_reentrant)
    # the twins draw the same masks (both generators seeded alike), and recomputation redraws them
    assert _equal(cpu, gpu)
    plain = simdist.run(checkpoint_train, ONE, args=("cuda", use_reentrant, False)).returns
    assert _equal(plain, gpu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_autocast_and_grad_scaler_equal_the_casts_cuda_autocast_makes(dtype: torch.dtype) -> None:
    cpu, gpu = _twins(amp_train, ONE, dtype)
    assert _equal(cpu, gpu)
    _, losses, scales = gpu[0]
    # the inf in the second batch: the scaler skipped that step and halved its scale
    assert scales == [2.0**10, 2.0**9, 2.0**9] and losses[1] != losses[1]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "float_mask"])
def test_attention_takes_the_cpu_fused_kernel_bitwise_priced_as_one_kernel(causal: bool) -> None:
    cpu, gpu = _twins(attention_train, ONE, causal)
    assert _equal(cpu, gpu)
    res = simdist.run(attention_train, ONE, args=("cuda", causal))
    names = [s.name for s in res.trace.spans if s.rank == 0 and s.name.startswith("aten::")]
    fused = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert names.count(fused) == 1 and names.count(fused + "_backward") == 1
    assert not {"aten::bmm", "aten::_softmax", "aten::matmul"} & set(names)


def test_attention_on_dtensors_over_cuda_equals_one_process_attention_bitwise() -> None:
    # DTensor has sharding rules for CUDA's attention kernels only: the CPU twin cannot run, so the oracle is the
    # attention of the full tensors in this process (per head, the same CPU flash kernel)
    res = simdist.run(dtensor_attention, PAIR, args=("cuda",))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8, generator=g).requires_grad_() for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.pow(2).sum().backward()
    for rank in range(2):
        assert _equal([out.detach(), q.grad, k.grad, v.grad], res.returns[rank])
    names = [s.name for s in res.trace.spans if s.rank == 0 and s.name.startswith("aten::")]
    assert names.count("aten::_scaled_dot_product_flash_attention") == 1
    assert names.count("aten::_scaled_dot_product_flash_attention_backward") == 1


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_recurrent_layers_take_the_fused_cell_stand_ins_within_round_off_of_the_cpu(cls: str) -> None:
    cpu, gpu = _twins(rnn_train, ONE, cls)
    # CUDA's cells take per-step input projections and fused gates, the CPU's one projection for the whole
    # sequence: the same arithmetic in another order
    for a, b in zip(cpu[0], gpu[0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    res = simdist.run(rnn_train, ONE, args=("cuda", cls))
    names = {s.name for s in res.trace.spans if s.rank == 0}
    assert f"aten::_thnn_fused_{cls.lower()}_cell" in names


def test_ctc_loss_on_cuda_equals_its_cpu_twin_bitwise() -> None:
    cpu, gpu = _twins(ctc_train, ONE)
    assert _equal(cpu, gpu)


def test_torch_compile_eager_of_a_model_on_the_gpu_equals_its_cpu_twin_bitwise() -> None:
    cpu, gpu = _twins(compiled_train, ONE)
    assert _equal(cpu, gpu)


def _syncbn_oracle(steps: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The same training in one process: plain BatchNorm over both ranks' batches, DDP's mean of gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(9))
    for step in range(steps):
        xs = [
            torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(20 * step + r)) for r in range(2)
        ]
        x = torch.cat(xs).requires_grad_()
        (model(x) * torch.cat([weights, weights])).sum().backward()
        for p in model.parameters():
            p.grad /= 2
        opt.step()
        opt.zero_grad()
    norm = model[1]
    return (
        [p.detach() for p in model.parameters()],
        [norm.running_mean, norm.running_var],
        list(x.grad.chunk(2)),
    )


def test_sync_batchnorm_on_cuda_equals_batchnorm_over_the_whole_batch() -> None:
    res = simdist.run(syncbn_train, PAIR).returns
    params, stats, grads = _syncbn_oracle()
    for rank in range(2):
        got_params, got_stats, got_grad = res[rank]
        for a, b in zip(params + stats, got_params + got_stats):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_grad, grads[rank], rtol=1e-5, atol=1e-6)


def _efficient_attention() -> None:
    torch.cuda.set_device(0)
    q = torch.randn(1, 2, 4, 8, device="cuda")
    torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False)


def test_a_cuda_only_op_without_a_stand_in_names_the_op_and_the_users_line() -> None:
    with pytest.raises(simdist.errors.RankError) as info:
        simdist.run(_efficient_attention, ONE)
    cause = info.value.__cause__ or info.value
    text = str(info.value)
    assert "aten::_scaled_dot_product_efficient_attention" in text
    line = _efficient_attention.__code__.co_firstlineno + 3
    assert f"test_cuda_stack.py:{line}" in text
    assert isinstance(cause, UnsupportedCudaOpError) or "UnsupportedCudaOpError" in text


def _lstm_cell_steps() -> None:
    torch.cuda.set_device(0)
    cell = nn.LSTMCell(64, 128).to("cuda")
    x = torch.randn(32, 64, device="cuda")
    with torch.no_grad():
        cell(x)


def test_a_cuda_only_kernel_stand_in_is_priced_as_the_one_cuda_kernel() -> None:
    res = simdist.run(_lstm_cell_steps, ONE)
    (span,) = [s for s in res.trace.spans if s.name == "aten::_thnn_fused_lstm_cell"]
    # the CUDA kernel reads both gate pre-activations (32 x 512), cx and the two biases, and writes hy, cy
    # (32 x 128) and the workspace (32 x 512), all float32; it is memory-bound
    nbytes = 4 * (2 * 32 * 512 + 32 * 128 + 2 * 512 + 2 * 32 * 128 + 32 * 512)
    device = simdist.compute.devices.get_device("H100")
    assert span.duration == pytest.approx(nbytes / device.memory_bandwidth + device.launch_overhead, rel=1e-9)
    # its CPU stand-in's own ops (sigmoid, tanh, cat, ...) are not charged besides
    names = {s.name for s in res.trace.spans}
    assert not {"aten::sigmoid", "aten::tanh", "aten::cat"} & names
