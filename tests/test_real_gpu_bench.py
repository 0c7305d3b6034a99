"""benchmarks/gpu: the prepared device run works the first time, checked here with ``--dry-run`` on the CPU.

run_all.sh runs where only torch is installed, so its dry run here happens in an interpreter where simpy
cannot be imported; compare.py then reads what it wrote, with simdist, as it will read a GPU's results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from no_simpy import REPO, env_without_simpy

from simdist.compute import estimate, get_device

GPU = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import compare
import memory_trace
import ops
import predict
import summary
from model import Block, BlockShape


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory, session_results) -> Path:
    """The results folder of ``run_all.sh --dry-run``, run without simpy (once in the session: its tests may
    run on two workers)."""

    def run() -> Path:
        out = tmp_path_factory.mktemp("gpu-results")
        env = {**env_without_simpy(out.parent), "OUT": str(out)}
        done = subprocess.run(
            ["bash", str(GPU / "run_all.sh"), "--dry-run"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
            cwd=out,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return out

    return session_results.get("gpu-bench-dry-run", run)


def _json(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


@pytest.mark.real
@pytest.mark.slow
def test_every_section_ran_and_wrote_its_results(dry_run: Path) -> None:
    log = (dry_run / "log.txt").read_text()
    for section in ("real_nccl", "compute", "memory", "memory_trace", "program"):
        assert f"=== {section}: exit 0 after" in log, log[-3000:]
        assert _json(dry_run, f"{section}.json")["errors"] == [], section
    assert "=== summary ===" in log and "machine: device cpu" in log

    nccl = _json(dry_run, "real_nccl.json")
    assert nccl["failed"] == [] and nccl["passed"] == len(nccl["records"]) >= 20
    checks = {r["check"] for r in nccl["records"]}
    assert {"rank 0: all_to_all_single", "rank 0: returns on the CPU", "script entry fail: exit 1"} <= checks

    compute_ids = [r["id"] for r in _json(dry_run, "compute.json")["records"]]
    assert compute_ids == [c.id for c in ops.cases(dry_run=True)]

    program = _json(dry_run, "program.json")["records"][0]
    assert len(program["losses"]) == len(program["step_s"]) == 3


@pytest.mark.real
@pytest.mark.slow
def test_compare_reads_the_results_and_the_simulated_twin_trains_like_the_real_one(
    dry_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare.main([str(dry_run)]) == 0
    out = capsys.readouterr().out
    assert "`real` on gloo: " in out and "checks passed" in out and "failed:" not in out
    assert out.count("| mm ") == 4 and "| matmul bf16 | 1 |" in out
    assert "| d64 h4 b2 s32 | fp32 | second step | not measured |" in out
    # The same job on a real gloo process and simulated: the same losses (the oracle is the real run).
    assert "equal within 0.001" in out


def test_the_memory_trace_replay_finds_the_peak_and_what_is_live_then() -> None:
    # a hand-worked trace: a 100, b 50 (peak 150, a and b live), a freed, c 80 (130, below the peak); segment
    # events and completed frees do not move the count, and a free of a block allocated before the trace is ignored
    def alloc(addr: int, size: int) -> dict:
        return {
            "action": "alloc",
            "addr": addr,
            "size": size,
            "frames": [{"name": "at::detail::empty_generic"}, {"name": f"at::_ops::op{addr}::call"}],
        }

    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 21},
        alloc(1, 100),
        {"action": "free_requested", "addr": 9, "size": 999},
        alloc(2, 50),
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        alloc(3, 80),
    ]
    peak, at, blocks = memory_trace.live_at_peak(trace)
    assert (peak, at) == (150, 3)
    assert [(b["size"], b["order"]) for b in blocks] == [(100, 1), (50, 3)]
    assert summary.allocating_op(blocks[0]["frames"]) == "op1"


def test_a_block_is_named_by_its_op_and_a_kernels_scratch_by_the_kernel() -> None:
    scratch = [
        "torch::unwind::unwind() (??:0)",
        "void at::native::gpu_reduce_kernel<float, float, 4> (Reduce.cu:0)",
        "at::native::structured_sum_out::impl(at::Tensor const&) (??:0)",
        "at::_ops::sum_dim_IntList::redispatch(c10::DispatchKeySet) (??:0)",
        "torch::autograd::Engine::evaluate_function() (??:0)",
    ]
    output = [
        "torch::unwind::unwind() (??:0)",
        "at::detail::empty_generic(c10::ArrayRef<long>) (??:0)",
        "at::_ops::empty_memory_format::call() (??:0)",
        "at::native::layer_norm_cuda(at::Tensor const&) (??:0)",
    ]
    assert (
        summary.allocating_op(scratch)
        == "sum_dim_IntList (backward), scratch of at::native::gpu_reduce_kernel"
    )
    assert summary.allocating_op(output) == "layer_norm_cuda"


def test_a_matmul_is_predicted_as_a_simulated_run_prices_it() -> None:
    # the GEMM shape model of the H100 preset, never faster than the roofline
    case = next(c for c in ops.cases(dry_run=False) if c.id == "mm bf16 4096x4096x4096")
    h100 = get_device("H100")
    a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    flops, moved = 2 * 4096**3, 3 * 4096 * 4096 * 2
    roofline = (
        max(flops / h100.flops_for(torch.bfloat16), moved / h100.memory_bandwidth) + h100.launch_overhead
    )
    seconds, kernels = predict.op_seconds(case, "H100")
    assert kernels == 1 and seconds == pytest.approx(estimate(torch.mm, a, a, device="H100")[0], rel=1e-12)
    assert seconds >= roofline * (1 - 1e-12)


def test_attention_is_priced_as_the_fused_kernel_a_simulated_run_uses() -> None:
    # On meta tensors PyTorch would take the unfused math path (about ten kernels); a simulated run on CPU
    # tensors takes the fused one (cuDNN's on an H100, priced by the device's attention model), so the
    # prediction must too
    case = next(c for c in ops.cases(dry_run=False) if c.id == "sdpa bf16 b4 h32 s2048 d128")
    seconds, kernels = predict.op_seconds(case, "H100")
    h100 = get_device("H100")
    assert kernels == 1
    fused = h100.attention.seconds(
        "cudnn",
        False,
        4 * 32,
        2048,
        2048,
        128,
        128,
        False,
        h100.flops_for(torch.float16),
        h100.multiprocessors,
    )
    assert seconds == pytest.approx(fused + h100.launch_overhead, rel=1e-9)
    # FlashAttention's FLOPs at the full rate bound it from below
    assert seconds > 4 * 4 * 32 * 2048 * 2048 * 128 / h100.flops_for(torch.bfloat16)


def test_the_memory_peak_after_building_the_block_is_its_parameters() -> None:
    shape = BlockShape(256, 4, 2, 64)
    params = sum(p.numel() for p in Block(256, 4).parameters())
    assert predict.memory_peak(shape, "fp32", "model", "H100") == params * 4
    assert predict.memory_peak(shape, "bf16", "model", "H100") == params * 2


@pytest.mark.parametrize(
    "name, preset",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("cpu", "H100"),
        (None, "H100"),
    ],
)
def test_the_preset_follows_the_measured_device(name: str | None, preset: str) -> None:
    assert predict.preset_for(name) == preset
