"""A run leaves the process as it found it: every attribute of simdist.patching's inventory, every hook registry,
every process setting, and no thread of its own, after a passing, a failing, an interrupted, a ``memory=True``
and an oracle run, after scripts run as torchrun runs them (each rank's argv, clock, pid and prefixed output)
that pass, exit with a failure, or are interrupted, and after passing, failing and interrupted runs of CUDA code
on simulated GPUs."""

from __future__ import annotations

import _thread
import contextlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

# imported before every run here, so its patched attributes compare before and after: every run on simulated GPUs
# imports it (the autograd engine does, at the emulation's self-test); test_cuda_dtensor_random checks a run that
# imports it first
import torch.distributed.tensor

import simdist
from simdist import patching
from simdist.engine.rank_process import FIRST_PID

RING2 = simdist.Cluster.ring(2)


#: each test starts with 3 intra-op threads, not the suite's 1, so that a run leaving its own 1 behind fails it
pytestmark = pytest.mark.usefixtures("threads_other_than_the_suites")


def _busy_step() -> list[float]:
    """Touches what the patches serve: environment, generators, sleep, threads, host reads, groups, DDP."""
    os.environ["MINE"] = str(dist.get_rank())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    t = torch.rand(4) + random.random() + float(np.random.rand())
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    time.sleep(0.001)
    th = threading.Thread(target=lambda: dist.barrier())
    th.start()
    th.join()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(t.unsqueeze(0)).sum().backward()
    return t.tolist()


def _fails() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.barrier()


def _spins() -> None:
    dist.barrier()
    while True:
        pass


def _train(world: int, scale: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.ones(8, 4) * (step + 1)
        rank, n = (dist.get_rank(), dist.get_world_size()) if world > 1 else (0, 1)
        model(x[rank::n]).pow(2).mean().backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(n * scale)
        opt.step()
        opt.zero_grad()


def _passing() -> None:
    simdist.run(_busy_step, RING2, races="warn", backend_name="gloo")


def _failing() -> None:
    with pytest.raises(simdist.RankError):
        simdist.run(_fails, RING2)


def _stopped_by_the_watchdog() -> None:
    with pytest.raises(simdist.WatchdogError):
        simdist.run(_spins, RING2, watchdog=0.5)


@contextlib.contextmanager
def _ctrl_c_after(seconds: float, handler: Any = signal.default_int_handler) -> Iterator[None]:
    """Ctrl-C (SIGINT as ``_thread.interrupt_main`` delivers it) ``seconds`` after entering, under ``handler``
    (Python's own by default: set here, so that the test does not depend on what its worker inherited), and
    within 30 s of wall time, far below the runs' watchdogs."""
    previous = signal.signal(signal.SIGINT, handler)
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 30


def _interrupted() -> None:
    """Ctrl-C while a rank computes in a loop: the run stops at once, whatever the watchdog's limit."""
    with _ctrl_c_after(0.5), pytest.raises(KeyboardInterrupt):
        simdist.run(_spins, RING2, watchdog=120)


class _Signalled(Exception):
    """What a program's own SIGINT handler raises (torch elastic's agent installs one raising SignalException)."""


def _raise_signalled(signum: int, frame: object) -> None:
    raise _Signalled(f"signal {signum}")


def _interrupted_under_the_programs_handler() -> None:
    """Ctrl-C under a SIGINT handler that raises its own exception: the run stops as at a KeyboardInterrupt."""
    with _ctrl_c_after(0.5, _raise_signalled), pytest.raises(_Signalled):
        simdist.run(_spins, RING2, watchdog=120)


def _with_memory() -> None:
    simdist.run(_busy_step, simdist.Cluster.switch(2, device="H100"), memory=True)


H100_PAIR = simdist.Cluster.switch(2, device="H100")


def _cuda_step() -> float:
    """CUDA code: devices, a DDP step on the GPU, events, memory statistics, a generator, the host link."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).cuda(), device_ids=[dist.get_rank()])
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    model(torch.randn(2, 4, device="cuda", generator=torch.Generator(device="cuda"))).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.max_memory_allocated()
    return float(model.module.weight.grad.sum().cpu())


def _cuda_fails() -> None:
    torch.ones(2, device="cuda")
    if dist.get_rank() == 1:
        torch.ones(2, device="cuda:0") + torch.ones(2, device="cuda:1")
    dist.barrier()


def _cuda_spins() -> None:
    x = torch.ones(2, device="cuda")
    dist.all_reduce(x)
    while True:
        pass


def _cuda_passing() -> None:
    simdist.run(_cuda_step, H100_PAIR, memory=True)


def _cuda_failing() -> None:
    with pytest.raises(simdist.RankError):
        simdist.run(_cuda_fails, H100_PAIR)


def _cuda_interrupted() -> None:
    with _ctrl_c_after(0.5), pytest.raises(KeyboardInterrupt):
        simdist.run(_cuda_spins, H100_PAIR, watchdog=120)


#: a torchrun-style script: its own init_process_group, argv, clocks, pid and output, each rank's own
_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from torch.distributed import init_process_group

init_process_group("gloo")
start = time.perf_counter()
dist.all_reduce(torch.ones(4))
sys.argv.append("changed")
print(os.getpid(), time.perf_counter() - start, time.time_ns(), sys.argv, file=sys.stderr)
if sys.argv[1] == "fail" and dist.get_rank() == 1:
    sys.exit(3)
if sys.argv[1] == "spin":
    while True:
        pass
"""


def _script_run(how: str, tmp: Path) -> None:
    path = tmp / f"{how}.py"
    path.write_text(_SCRIPT)
    simdist.run_script(path, RING2, argv=[how], local_ranks_filter=[1], watchdog=120)


def _script_passing(tmp: Path) -> None:
    _script_run("pass", tmp)


def _script_failing(tmp: Path) -> None:
    with pytest.raises(simdist.RankError, match="SystemExit: 3"):
        _script_run("fail", tmp)


def _script_interrupted(tmp: Path) -> None:
    with _ctrl_c_after(0.5), pytest.raises(KeyboardInterrupt):
        _script_run("spin", tmp)


def _oracle() -> None:
    rep = simdist.check_equivalence(_train, _train, RING2, args=(2, 2.0), reference_args=(1, 1.0))
    assert not rep.ok and rep.localization is not None


@pytest.mark.parametrize(
    "make_run",
    [
        _passing,
        _failing,
        _stopped_by_the_watchdog,
        _interrupted,
        _interrupted_under_the_programs_handler,
        _with_memory,
        _oracle,
        _cuda_passing,
        _cuda_failing,
        _cuda_interrupted,
    ],
    ids=lambda f: f.__name__,
)
def test_a_run_leaves_the_process_as_it_found_it(make_run) -> None:
    before = patching.process_state()
    make_run()
    after = patching.process_state()
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not changed, changed


@pytest.mark.parametrize("make_run", [_script_passing, _script_failing, _script_interrupted], ids=lambda f: f.__name__)
def test_a_torchrun_style_script_leaves_the_process_as_it_found_it(make_run, tmp_path: Path, capsys) -> None:
    before = patching.process_state()
    argv, path, stdout = list(sys.argv), list(sys.path), sys.stdout
    make_run(tmp_path)
    after = patching.process_state()
    assert sys.argv == argv and sys.path == path and sys.stdout is stdout
    err = capsys.readouterr().err
    assert "[rank0]" not in err  # filtered out
    if make_run is not _script_interrupted:  # (rank 0 spins before rank 1 prints)
        assert f"[rank1]:{FIRST_PID + 1} " in err
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not changed, changed


def test_every_change_is_declared_and_the_inventory_reaches_real_attributes() -> None:
    """Each target of the inventory exists (where its module is imported); an undeclared change is refused."""
    for patch in patching.INVENTORY:
        if "pipelining" not in patch.path:  # imported by programs that use it, not by simdist
            owner = patching._resolve(patch.path)
            assert patch.adds or all(hasattr(owner, name) for name in patch.names), patch
    with pytest.raises(simdist.SimdistError, match="does not list"), patching.replaced(
        "simdist.engine.process", {"torch.Tensor.add": None}
    ):
        pass
    with pytest.raises(simdist.SimdistError, match="does not list"), patching.replaced(
        "simdist.oracle.capture", {"time.sleep": None}  # declared for another owner
    ):
        pass


def test_a_replaced_class_attribute_that_was_inherited_is_removed_again() -> None:
    assert "tolist" not in torch.Tensor.__dict__
    original = torch.Tensor.tolist
    with patching.replaced("simdist.engine.process", {"torch.Tensor.tolist": lambda self: "patched"}):
        assert torch.ones(1).tolist() == "patched"
    assert "tolist" not in torch.Tensor.__dict__ and torch.Tensor.tolist is original


def test_the_docs_inventory_table_is_generated_from_the_inventory() -> None:
    text = (Path(__file__).parent.parent / "docs" / "simulator.md").read_text()
    assert patching.markdown() in text
