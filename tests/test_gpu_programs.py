"""The GPU program suite (tests/gpu_programs/): programs written as users write them for GPUs, each checked bit for
bit against its CPU twin under simdist (the same program written for the CPU: the same CPU kernels compute
both), and against real gloo processes running the same file on emulated CUDA devices (``python -m real
--emulate-cuda``). Memory statistics and out-of-memory have no CPU twin: their oracle is the tensors' own sizes
and the device's capacity."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_programs import amp
from gpu_programs.common import digest
from gpu_programs.suite import PROGRAMS, run_all

import real
import simdist
from real.__main__ import main as real_main
from simdist.compute.devices import get_device

#: two ranks: the world size at which simdist's gloo-presented sums already add in gloo's order
PAIR = simdist.Cluster.switch(2, device="H100")
#: what each program's CPU twin also returns (the rest are GPU answers: devices, fallbacks)
TWIN_KEYS = ("params", "losses", "scales")
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@functools.cache  # several tests read a program's run (its twin, its own checks, real processes): run it once
def _simulated(name: str, kind: str) -> simdist.RunResult:
    return simdist.run(PROGRAMS[name], PAIR, args=(kind,), memory=kind == "cuda")


def _assert_equal(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` hold the same values bit for bit (tensors by ``torch.equal``, dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", [n for n in PROGRAMS if n != "events_memory"])
def test_a_gpu_program_equals_its_cpu_twin_under_simdist(name: str) -> None:
    gpu, cpu = _simulated(name, "cuda"), _simulated(name, "cpu")
    for rank in range(PAIR.world_size):
        mine, twin = gpu.returns[rank], cpu.returns[rank]
        shared = [k for k in TWIN_KEYS if k in twin]
        assert "params" in shared
        _assert_equal({k: twin[k] for k in shared}, {k: mine[k] for k in shared}, f"{name} rank {rank}")
        if "device" in mine:
            assert mine["device"] == f"cuda:{rank}" and twin["device"] == "cpu"


def test_the_amp_program_skips_an_overflowing_step_and_then_trains() -> None:
    # the comparison with the twin means something only if the scaler both skipped and stepped
    scales = _simulated("amp", "cuda").returns[0]["scales"]
    assert scales[0] == amp.INIT_SCALE * amp.BACKOFF and len(set(scales)) == 1


def test_the_events_and_memory_program_answers_from_its_tensors_sizes() -> None:
    for out in _simulated("events_memory", "cuda").returns:
        a, b = out["sizes"]["a"], out["sizes"]["b"]
        assert (a, b) == (1024 * 256 * 4, 512 * 256 * 4)
        assert out["memory"] == [a, a + b, b, a + b]
        assert out["total"] == out["capacity"] == get_device("H100").memory_capacity
        assert out["free_below_total"] and out["elapsed_positive"] and out["end_reached"]
        assert out["devices"] == 2 and out["name"] == "NVIDIA H100 80GB HBM3"
        assert torch.equal(out["product"], torch.tensor(512.0 * 512 * 256))


def test_the_oom_program_falls_back_as_on_a_gpu() -> None:
    # the first batch asks for twice the device's memory: refused before the host allocation, then the small one
    assert all(out["fell_back"] for out in _simulated("oom", "cuda").returns)


@pytest.mark.real
def test_the_suite_on_real_gloo_processes_with_emulated_cuda_equals_simdist() -> None:
    # one launch runs every program, so the suite costs one start of the processes
    launched = real.run(run_all, 2, backend="nccl", emulate_cuda=True, timeout=240)
    assert launched.backend == "nccl"
    for name in PROGRAMS:
        simulated = _simulated(name, "cuda")
        for rank in range(2):
            _assert_equal(simulated.returns[rank], launched.returns[rank][name], f"{name} rank {rank}")


@pytest.mark.real
def test_python_m_real_runs_a_gpu_script_unmodified_on_emulated_cuda(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # the file as torchrun runs it: its own init_process_group("nccl"), set_device(LOCAL_RANK), printed digests
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    script = TESTS / "gpu_programs" / "ddp.py"
    completed = subprocess.run(
        [sys.executable, "-m", "real", str(script), "--nproc", "2", "--emulate-cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    printed = dict(re.findall(r"^\[rank\d\]:ddp rank (\d) (\w+)$", completed.stdout, re.MULTILINE))
    simulated = _simulated("ddp", "cuda")
    assert printed == {str(r): digest(simulated.returns[r]) for r in range(2)}
    # without the flag, the script fails as it does under torchrun on a machine without GPUs (the command
    # line's own main in this process: the interpreter's start is checked above)
    assert real_main([str(script), "--nproc", "1"]) == 1
    assert "NCCL" in capfd.readouterr().err
