"""Simulated CUDA devices for one whole process (simdist.cudart.process), as each rank process of
``python -m real --emulate-cuda`` runs them: checked in this process on a real gloo group of one, against the same
code under simdist.run, torch's own generators and the tensors' sizes; and the process is left as it was."""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import real
import simdist
from real import launcher
from real.emulated_cuda import EmulatedCuda, nccl_over_gloo
from real.errors import RealConfigError
from real.target import target_for
from simdist import patching
from simdist.cudart.process import emulated_process
from simdist.errors import CudaEmulationError

#: each test starts with 3 intra-op threads, not the suite's 1, so that a run leaving its own 1 behind fails it
pytestmark = pytest.mark.usefixtures("threads_other_than_the_suites")


@contextlib.contextmanager
def _group_of_one(backend: str = "gloo") -> Iterator[None]:
    """A real process group of one rank in this process (gloo underneath), destroyed afterwards."""
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_process_emulating_cuda_leaves_it_as_it_found_it() -> None:
    before = patching.process_state()
    with emulated_process(2):
        torch.ones(2, device="cuda").sum().item()
    with pytest.raises(ValueError, match="inside"), emulated_process(1):
        torch.ones(2, device="cuda")
        raise ValueError("inside")
    after = patching.process_state()
    assert {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)} == {}
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0


def test_collectives_on_lists_of_device_tensors_reach_a_real_group() -> None:
    # all_gather's outputs are a list of tensor lists in the op: gloo read them in C++ as CUDA tensors and refused
    with emulated_process(1), _group_of_one():
        x = torch.arange(3.0, device="cuda")
        out = [torch.zeros(3, device="cuda")]
        dist.all_gather(out, x)
        assert out[0].device == torch.device("cuda", 0) and torch.equal(out[0].cpu(), torch.arange(3.0))
        objs: list = [None]
        dist.all_gather_object(objs, {"rank": 0})
        assert objs == [{"rank": 0}]


def test_a_collectives_work_holds_the_cpu_tensors_the_group_wrote() -> None:
    # what differs from a GPU (docs/real.md): a real group's work is its own, holding the CPU tensors it wrote,
    # which are the caller's values
    with emulated_process(1), _group_of_one():
        x = torch.ones(2, device="cuda")
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        assert work.result()[0].device.type == "cpu" and torch.equal(work.result()[0], x.cpu())
        x.add_(1)
        assert torch.equal(work.result()[0], x.cpu())  # the same values: the tensor inside the caller's


@pytest.mark.filterwarnings("error")
def test_nccl_groups_are_gloo_groups_presenting_nccl() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with emulated_process(1), nccl_over_gloo(), _group_of_one("nccl"):
        assert dist.get_backend() == "nccl"
        assert dist.get_backend(dist.new_group([0], backend="nccl")) == "nccl"
        # the device chosen first, as GPU programs do (without it, and without LOCAL_RANK, DeviceMesh warns and
        # picks one itself, as on a GPU machine)
        torch.cuda.set_device(0)
        mesh = init_device_mesh("cuda", (1,))
        assert mesh.device_type == "cuda"
        t = torch.ones(2, device="cuda")
        dist.all_reduce(t, group=mesh.get_group())
        assert torch.equal(t.cpu(), torch.ones(2))


def test_device_generators_draw_as_torch_generators_seeded_alike() -> None:
    # the documented semantics: a device generator seeded with s draws what torch.Generator().manual_seed(s) draws
    with emulated_process(2):
        torch.manual_seed(5)
        on_device = torch.randn(4, device="cuda:1")
        torch.cuda.manual_seed(6)
        on_current = torch.rand(3, device="cuda")
        on_device, on_current = on_device.cpu(), on_current.cpu()
    assert torch.equal(on_device, torch.randn(4, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(on_current, torch.rand(3, generator=torch.Generator().manual_seed(6)))


def _memory_program() -> tuple[list[int], int, bool]:
    torch.cuda.set_device(0)
    a = torch.empty(1000, 10, device="cuda")
    b = torch.ones(10, 7, device="cuda")
    first = torch.cuda.memory_allocated()
    c = a @ b
    second = torch.cuda.max_memory_allocated()
    del a, c
    third = torch.cuda.memory_allocated()
    try:
        torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
        refused = False
    except torch.cuda.OutOfMemoryError:
        refused = True
    return [first, second, third], b.nbytes, refused


def test_memory_figures_equal_a_simulated_runs() -> None:
    with emulated_process(1):
        mine = _memory_program()
    simulated = simdist.run(_memory_program, simdist.Cluster.switch(1, device="H100"), memory=True).returns[0]
    assert mine == simulated
    figures, b_bytes, refused = mine
    assert figures == [40_000 + b_bytes, 40_000 + b_bytes + 28_000, b_bytes] and refused


@pytest.mark.parametrize(("devices", "model"), [(0, "H100"), (True, "H100"), (1, "cpu")])
def test_an_emulation_that_cannot_be_is_refused_before_anything_changes(devices: object, model: str) -> None:
    before = patching.process_state()
    with pytest.raises(CudaEmulationError), emulated_process(devices, device=model):  # type: ignore[arg-type]
        pass
    assert patching.process_state() == before


def test_out_of_memory_names_the_users_line_and_the_wall_clock() -> None:
    with emulated_process(1), pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        torch.empty(2**50, device="cuda")
    text = str(caught.value)
    assert "tried to allocate 4 PiB (a new tensor); rank 0 has 0 B of 80 GiB (H100) in use" in text
    assert "at wall time since the emulation started" in text
    assert f"called from {__file__}:" in text and "test_out_of_memory_names_the_users_line" in text


def test_threads_the_process_starts_run_on_its_devices_from_device_0() -> None:
    # as CUDA's: a new host thread starts on device 0, and makes and reads device tensors like the main thread
    seen: dict = {}

    def work() -> None:
        seen["made"] = torch.ones(3, device="cuda")
        seen["current"] = torch.cuda.current_device()
        seen["drawn"] = torch.randn(2, device="cuda").cpu()

    with emulated_process(2):
        torch.cuda.set_device(1)
        torch.manual_seed(4)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert torch.cuda.current_device() == 1
        made = seen["made"].cpu()
    assert (
        seen["current"] == 0
        and seen["made"].device == torch.device("cuda", 0)
        and torch.equal(made, torch.ones(3))
    )
    assert torch.equal(seen["drawn"], torch.randn(2, generator=torch.Generator().manual_seed(4)))


@given(
    devices=st.one_of(st.none(), st.integers(-3, 9), st.booleans(), st.text(max_size=3), st.floats(0, 4)),
    nproc=st.integers(1, 8),
)
def test_the_emulated_devices_are_checked_before_a_launch(devices: object, nproc: int) -> None:
    # any count either fits the launch or is refused with the launcher's own error, naming the count
    try:
        EmulatedCuda(devices).check(nproc)  # type: ignore[arg-type]
    except RealConfigError as error:
        assert repr(devices) in str(error) or f"{nproc} processes" in str(error)
        valid = devices is None or (type(devices) is int and devices >= nproc)
        assert not valid
    else:
        assert devices is None or (type(devices) is int and devices >= nproc)


def _shard_without_a_mesh() -> tuple[str, str]:
    """``fully_shard`` with its default mesh, as most FSDP2 scripts call it: the mesh is the accelerator's."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = torch.nn.Linear(4, 4).cuda()
    fully_shard(model)
    model(torch.ones(2, 4, device="cuda")).sum().backward()
    return str(torch._C._get_accelerator()), str(model.weight.grad.to_local().device)


def test_fully_shards_default_mesh_is_on_the_simulated_gpus() -> None:
    # torch asks C++ for the accelerator there, which a CPU build answers with the CPU: parameters landed on a CPU
    # mesh and the first forward failed mixing devices
    returns = simdist.run(_shard_without_a_mesh, simdist.Cluster.switch(2, device="H100")).returns
    assert returns == [("cuda", "cuda:0"), ("cuda", "cuda:1")]
    with emulated_process(1), nccl_over_gloo(), _group_of_one("nccl"):
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Linear(4, 4).cuda()
        fully_shard(model)
        model(torch.ones(2, 4, device="cuda")).sum().backward()
        assert str(model.weight.grad.to_local().device) == "cuda:0"
    assert str(torch._C._get_accelerator()) == "cpu"


def _to_undecomposed() -> list[Any]:
    """``Tensor.to`` as it reaches a dispatch mode where autograd is skipped (DTensor's random-number tracker moves
    a generator state to the device so): a host tensor to the device, back, and to where it already is."""
    host = torch.arange(3.0)
    with torch._C._AutoDispatchBelowAutograd():
        on_device = host.to(torch.device("cuda"), torch.float64)
        on_device.add_(1)  # a copy: the host tensor keeps its values
        back = on_device.to(device=torch.device("cpu"))
        same = on_device.to(torch.float64)
    return [
        str(on_device.device),
        host,
        back,
        type(back).__name__,
        str(same.device),
        same.data_ptr() == on_device.data_ptr(),
    ]


def test_tensor_to_reaching_the_mode_undecomposed_copies_across_devices() -> None:
    # it was refused as an op mixing a host tensor with a device ("found at least two devices, cuda:0 and cpu")
    expected = [
        "cuda:0",
        torch.arange(3.0),
        torch.arange(1.0, 4.0, dtype=torch.float64),
        "Tensor",
        "cuda:0",
        True,
    ]
    with emulated_process(1):
        mine = _to_undecomposed()
    simulated = simdist.run(_to_undecomposed, simdist.Cluster.switch(1, device="H100")).returns[0]
    for got in (mine, simulated):
        _equal = [torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, expected)]
        assert all(_equal), got


def _events_and_streams() -> list[Any]:
    """Events, a side stream waited for, and their queries, as training scripts time and overlap their steps."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    x = torch.arange(4.0, device="cuda") * 2
    end.record()
    end.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x + 1
    done = side.record_event()
    torch.cuda.current_stream().wait_event(done)
    torch.cuda.current_stream().wait_stream(side)
    side.synchronize()
    torch.cuda.synchronize()
    return [y.cpu(), start.elapsed_time(end) >= 0, end.query(), done.query(), side.query()]


def test_events_and_streams_answer_as_in_a_simulated_run() -> None:
    # they read the simulated rank's clock and race detector, which a process of its own has not
    with emulated_process(1):
        mine = _events_and_streams()
    simulated = simdist.run(_events_and_streams, simdist.Cluster.switch(1, device="H100")).returns[0]
    assert torch.equal(mine[0], simulated[0]) and mine[1:] == simulated[1:] == [True] * 4


def _one_nvtx_range() -> list[int]:
    pushed = torch.cuda.nvtx.range_push("step")
    with torch.cuda.nvtx.range("forward"), torch.autograd.profiler.record_function("loss"):
        torch.ones(2, device="cuda").sum()
    return [pushed, torch.cuda.nvtx.range_pop()]


def test_nvtx_ranges_answer_as_in_a_simulated_run() -> None:
    # a process of its own has no trace to put them in; they failed naming a function never imported
    with emulated_process(1):
        mine = _one_nvtx_range()
    assert mine == simdist.run(_one_nvtx_range, simdist.Cluster.switch(1, device="H100")).returns[0] == [0, 0]


def _entry() -> None:
    """A rank function for the launcher's choice of backend (never launched here)."""


@pytest.mark.parametrize(
    ("backend", "emulate", "expected"),
    [
        (launcher.DEFAULT_BACKEND, True, "nccl"),
        (launcher.DEFAULT_BACKEND, False, "gloo"),
        ("gloo", True, "gloo"),
        ("nccl", True, "nccl"),
        (None, True, "nccl"),
    ],
)
def test_real_run_creates_nccl_for_emulated_gpus_unless_told_otherwise(
    backend: str | None, emulate: bool, expected: str
) -> None:
    """``real.run(fn, n, emulate_cuda=True)`` gives code written for GPUs the group ``python -m real --emulate-cuda``
    gives it (NCCL's, presented over gloo); an explicit backend wins."""
    options = launcher._options(2, 60.0, None, None, None, emulate)
    assert launcher.group_backend(target_for(_entry), backend, options) == expected
    assert inspect.signature(real.run).parameters["backend"].default is launcher.DEFAULT_BACKEND


def test_a_group_bound_to_a_gpu_makes_fully_shards_mesh_cuda_and_leaves_the_device_to_device_mesh() -> None:
    # python -m real --emulate-cuda: init_process_group("nccl", device_id=cuda:0) runs no torch.cuda initialisation
    # (DeviceMesh then sets the device from LOCAL_RANK), but the process is a GPU program from then on
    with emulated_process(1), nccl_over_gloo():
        before = (torch.cuda.is_initialized(), torch._C._get_accelerator().type)
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=30),
            device_id=torch.device("cuda", 0),
        )
        try:
            after = (torch.cuda.is_initialized(), torch._C._get_accelerator().type)
            torch.zeros(1, device="cuda")
            initialised = torch.cuda.is_initialized()
        finally:
            dist.destroy_process_group()
    assert before == (False, "cpu") and after == (False, "cuda") and initialised
