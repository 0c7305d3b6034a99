"""Timing-only runs (``tensors="fake"``): the same simulated time and memory as the run with data, collectives
timed without data, the race detector off. (Refusals: tests/hostile/test_hostile_fake.py.)

The oracle is the run with real data of the same program on the same cluster: a fake run may differ from it only
where torch's own DDP reads values at wrap time (simdist.engine.fake), so the step times agree within 1% and the
memory peaks exactly.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist.cli import main

_SPEC = importlib.util.spec_from_file_location(
    "llama_step", Path(__file__).resolve().parent.parent / "benchmarks" / "llama_step.py"
)
llama_step = importlib.util.module_from_spec(_SPEC)
sys.modules["llama_step"] = llama_step  # dataclasses resolve the module by name
_SPEC.loader.exec_module(llama_step)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # a folder of scripts
from fsdp_tp_step import fsdp2_over_tp

TINY = llama_step.PRESETS["tiny"]


def _gpus(n: int) -> simdist.Cluster:
    return simdist.Cluster.preset("dgx-h100", world_size=n)


def _with_and_without_data(
    fn: Callable[..., Any], n: int, *args: Any, **options: Any
) -> tuple[simdist.RunResult, simdist.RunResult]:
    """``fn(*args)`` on ``n`` simulated GPUs with data, then timing-only: the same returned (simulated) times and the
    same messages."""
    real = simdist.run(fn, _gpus(n), args=args, races="off", **options)
    fake = simdist.run(fn, _gpus(n), args=args, tensors="fake", **options)
    assert fake.returns == real.returns and fake.messages == real.messages
    return real, fake


def _step(strategy: str, tensors: str, steps: int = 2) -> simdist.RunResult:
    return simdist.run(
        llama_step.train_step,
        _gpus(2),
        args=(strategy, TINY, steps),
        memory=True,
        tensors=tensors,
        races="off",
        watchdog=math.inf,
    )


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_fake_step_takes_the_simulated_time_and_memory_of_the_step_with_data(strategy: str) -> None:
    # The first run of a strategy in a process does work once (torch's lazy imports and caches): Python objects the
    # later runs do not make, which move a cycle holding the unsharded parameters into an older generation of the
    # garbage collector, so that it outlives the peak. The comparison is of two runs after it.
    _step(strategy, "fake", steps=1)
    real, fake = _step(strategy, "real"), _step(strategy, "fake")
    assert fake.sim_time == pytest.approx(real.sim_time, rel=0.01)
    assert [m.peak_bytes for m in fake.memory] == [m.peak_bytes for m in real.memory]
    assert [m.breakdown for m in fake.memory] == [m.breakdown for m in real.memory]
    assert [m.current_bytes for m in fake.memory] == [m.current_bytes for m in real.memory]

    # the same collectives, at the same sizes, in the same order
    def calls(res: simdist.RunResult) -> list[tuple]:
        return [(s.rank, s.name, s.args["In msg nelems"], s.args["dtype"]) for s in res.trace.collectives()]

    assert calls(fake) == calls(real)


def _collectives(sizes: list[int], dtype: torch.dtype) -> float:
    dev = torch.device("cuda", int(dist.get_rank()) % 8)
    torch.cuda.set_device(dev)
    n = dist.get_world_size()
    for size in sizes:
        x = torch.ones(size * n, dtype=dtype, device=dev)
        dist.all_reduce(x)
        out = torch.empty(size * n * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(x, out)
        dist.broadcast(x, src=0)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
    torch.cuda.synchronize()
    return simdist.now()


@settings(max_examples=6, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    n=st.sampled_from([2, 3, 4]),
)
def test_collectives_on_fake_tensors_take_the_time_of_collectives_on_data(
    sizes: list[int], dtype: torch.dtype, n: int
) -> None:
    _with_and_without_data(_collectives, n, sizes, dtype)


def _functional_collectives(sizes: list[int], dtype: torch.dtype) -> float:
    """The functional collectives DTensor and tensor parallelism issue, each result used; then a DTensor
    redistribution."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dev = torch.device("cuda", int(dist.get_rank()) % 8)
    torch.cuda.set_device(dev)
    group, n = dist.group.WORLD, dist.get_world_size()
    for size in sizes:
        x = torch.ones(size * n, dtype=dtype, device=dev)
        x = funcol.all_reduce(x, "sum", group) + 1
        gathered = funcol.all_gather_single(x, 0, group) * 2
        x = funcol.reduce_scatter_single(gathered, "sum", 0, group) - 1
        x = funcol.all_to_all_single(x, None, None, group) * 3
        x = funcol.broadcast(x, 0, group) + 1
    # a DTensor's shard-to-shard redistribution: one all-to-all (torch.ops._dtensor.shard_dim_alltoall)
    mesh = init_device_mesh("cuda", (n,))
    sharded = distribute_tensor(torch.ones(2 * n, 2 * n, dtype=dtype, device=dev), mesh, [Shard(0)])
    sharded.redistribute(mesh, [Shard(1)]).to_local().mul_(2)
    torch.cuda.synchronize()
    return simdist.now()


@settings(max_examples=4, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    n=st.sampled_from([2, 3, 4]),
)
def test_functional_collectives_on_fake_tensors_take_the_time_of_those_on_data(
    sizes: list[int], dtype: torch.dtype, n: int
) -> None:
    # funcol's meta kernels (for tracing) return without communicating: a fake run must not take them
    real, fake = _with_and_without_data(_functional_collectives, n, sizes, dtype)
    assert real.messages > 0
    names = [s.name for s in real.trace.collectives(0)]
    assert [s.name for s in fake.trace.collectives(0)] == names and names[-1] == "nccl:all_to_all_single"


def test_the_race_detector_is_off_by_default_in_a_fake_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIMDIST_RACES", "error")
    res = simdist.run(lambda: None, _gpus(1), tensors="fake")
    assert res.races == []


SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("nccl")
torch.cuda.set_device(dist.get_rank())
x = torch.empty(1 << 20, device="cuda")
dist.all_reduce(x)
"""


def test_the_command_line_runs_a_script_timing_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    out = {}
    for flags in ([], ["--fake"]):
        assert (
            main(["run", str(script), "--cluster", "dgx-h100", "--world-size", "2", "--memory", *flags]) == 0
        )
        out[tuple(flags)] = capsys.readouterr().out

    def figures(text: str) -> list[str]:
        return [
            line.split(";")[0] for line in text.splitlines() if "simulated time" in line or "rank" in line
        ]

    assert figures(out[("--fake",)]) == figures(out[()])
    assert (
        main(["run", str(script), "--cluster", "dgx-h100", "--world-size", "2", "--fake", "--races", "warn"])
        == 2
    )
    assert "races='warn' with tensors=\"fake\"" in capsys.readouterr().err


_FIRST_RUN = """
import torch, simdist
def step():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).cuda()
    model(torch.randn(8, 64, device="cuda")).square().mean().backward()
runs = [simdist.run(step, simdist.Cluster.preset("dgx-h100", world_size=2), memory=True, tensors="fake")
        for _ in range(2)]
print([[m.peak_bytes for m in r.memory] for r in runs], [r.trace_hash for r in runs])
"""


def test_the_first_fake_run_of_a_process_is_every_later_one() -> None:
    """A fresh interpreter: the first fake run's first matmul imports what torch's meta kernels import on first use
    (torch._dynamo), which once kept rank 0's tensors alive longer in that run only."""
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_RUN], capture_output=True, text=True, timeout=300, check=True
    )
    peaks, hashes = ast.literal_eval(out.stdout.strip().splitlines()[-1].replace("] [", "], ["))
    assert peaks[0] == peaks[1] and hashes[0] == hashes[1]


def test_a_fake_run_is_reproducible() -> None:
    runs = [
        simdist.run(_collectives, _gpus(3), args=([300, 7], torch.float32), tensors="fake") for _ in range(2)
    ]
    assert runs[0].trace_hash == runs[1].trace_hash


def _fsdp2_clipped_steps(steps: int) -> float:
    """pytorch/examples' FSDP2 training loop in small: a model made on the meta device, sharded per layer,
    materialised on the GPU, then steps that clip the gradients' norm (a DTensor of 0-dim norms stacked)."""
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cuda")
    for layer in model:
        layer.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 32, device="cuda")
    for _ in range(steps):
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
    torch.cuda.synchronize()
    return simdist.now()


def test_an_fsdp2_step_that_clips_its_gradients_takes_the_time_of_the_step_with_data() -> None:
    _with_and_without_data(_fsdp2_clipped_steps, 2, 2)


def test_an_fsdp2_over_tensor_parallel_step_takes_the_time_and_memory_of_the_step_with_data() -> None:
    # a first run in the process keeps a cycle past its peak (see the test of the Llama-style step): not compared
    # tensor-parallel groups of 2, the model made on the GPU
    simdist.run(fsdp2_over_tp, _gpus(4), args=(32, 2, 0, False), tensors="fake", memory=True)
    real, fake = _with_and_without_data(fsdp2_over_tp, 4, 32, 2, 2, False, memory=True)
    assert fake.trace_hash == real.trace_hash
    assert [m.peak_bytes for m in fake.memory] == [m.peak_bytes for m in real.memory]
    assert [m.breakdown for m in fake.memory] == [m.breakdown for m in real.memory]
