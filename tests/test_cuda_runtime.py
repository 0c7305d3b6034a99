"""``torch.cuda`` in rank code on a GPU cluster: devices and properties from the device model, events and copies in
simulated time, memory from the run's accounting; on a CPU cluster a clear error; outside a run, torch's own.

Oracles: the device presets (what ``torch.cuda`` reports), the cost model's closed forms (an op's roofline time,
a copy's bytes over the host link), the tensors' own sizes (bytes allocated).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.compute import op_cost
from simdist.compute.devices import H100
from simdist.cuda import native
from simdist.cuda.pinned import PAGEABLE_SHARE
from simdist.errors import CudaEmulationError, CudaError, NoCudaError, RankError

PAIR = simdist.Cluster.switch(2, device="H100")
NODES = simdist.Cluster.two_level(2, 2, device="A100")
US = 1e-6


def _identity():
    torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
    props = torch.cuda.get_device_properties()
    return (
        torch.cuda.is_available(),
        torch.cuda.device_count(),
        torch.cuda.current_device(),
        torch.cuda.get_device_name(),
        torch.cuda.get_device_capability(),
        (props.name, props.total_memory, props.multi_processor_count, props.major, props.minor),
        torch.cuda.is_bf16_supported(),
        torch.accelerator.is_available(),
        torch.accelerator.current_accelerator(),
        torch.accelerator.device_count(),
        torch.get_device_module("cuda").device_count(),
        torch.version.cuda is not None,
        dist.is_nccl_available(),
    )


def test_torch_cuda_answers_from_the_clusters_device_model():
    out = simdist.run(_identity, NODES).returns
    spec = simdist.compute.get_device("A100")
    for rank, got in enumerate(out):
        assert got == (
            True,
            2,
            rank % 2,
            spec.cuda_name,
            spec.compute_capability,
            (spec.cuda_name, spec.memory_capacity, spec.multiprocessors, 8, 0),
            True,
            True,
            torch.device("cuda"),
            2,
            2,
            True,
            True,
        )


def _set_bad_device():
    torch.cuda.set_device(2)


def test_set_device_to_an_index_the_node_lacks_is_refused():
    with pytest.raises(
        RankError, match="invalid device ordinal: device 2 does not exist; this simulated node has 2"
    ) as info:
        simdist.run(_set_bad_device, NODES)
    assert isinstance(info.value.exc, CudaError)


def _local_device() -> None:
    torch.zeros(2).to(dist.get_rank())  # as the DDP tutorial moves its model: device_id = rank % device_count()


def test_a_node_of_more_gpus_than_torch_can_name_says_why_its_high_ranks_fail() -> None:
    # one node of 130 GPUs (a ring cluster's ranks share one node): torch's 8-bit device index makes cuda:128 -128
    with pytest.raises(
        RankError, match=r"device -128 does not exist.*cuda:128 is cuda:-128.*at most 128"
    ) as info:
        simdist.run(_local_device, simdist.Cluster.ring(130, device="H100"))
    assert isinstance(info.value.exc, CudaError) and info.value.rank == 128


@pytest.mark.parametrize("index", [-2, 2])
@pytest.mark.parametrize("query", ["get_device_properties", "get_device_name", "get_device_capability"])
def test_device_queries_refuse_an_index_the_node_lacks(query: str, index: int) -> None:
    with pytest.raises(RankError, match=f"invalid device ordinal: device {index} does not exist") as info:
        simdist.run(lambda: getattr(torch.cuda, query)(index), simdist.Cluster.switch(2, device="H100"))
    assert isinstance(info.value.exc, CudaError)


def _timed_matmul():
    a = torch.randn(512, 1024, device="cuda")
    b = torch.randn(1024, 256, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    c = a @ b
    end.record()
    try:
        start.elapsed_time(end)
        early = None
    except CudaError as e:
        early = str(e)
    ready_before = end.query()
    end.synchronize()
    return early, ready_before, end.query(), start.elapsed_time(end), c.shape


def test_events_time_the_device_in_simulated_milliseconds():
    early, ready_before, ready_after, ms, _ = simdist.run(_timed_matmul, PAIR).returns[0]
    # the host runs ahead: the end event is not reached until the host waits for it, as CUDA says
    assert "device not ready" in early and not ready_before and ready_after
    a, b = torch.empty(512, 1024), torch.empty(1024, 256)
    # the stream was idle at the start event: the matmul starts once the host has launched it
    expected = H100.host_overhead + op_cost(torch.ops.aten.mm.default, (a, b), {}, a @ b, H100)
    assert math.isclose(ms, expected * 1e3, rel_tol=1e-12)


def _copies():
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")  # the rank uses its GPU from here on: host tensors are host memory
    host = torch.ones(1 << 20).pin_memory()  # 4 MiB of pinned memory
    torch.cuda.synchronize()
    t0 = simdist.now()
    dev = host.to("cuda")  # blocking: the host waits for the copy
    t1 = simdist.now()
    host.to("cuda", non_blocking=True)  # the host goes on
    t2 = simdist.now()
    torch.cuda.synchronize()
    t3 = simdist.now()
    (
        host @ host.reshape(1024, 1024)[0].repeat(1024)[: 1 << 20].reshape(-1)
    ).item()  # host work: no device time
    t4 = simdist.now()
    back = dev.cpu()  # device to host, blocking, into pageable memory
    t5 = simdist.now()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, back.device.type


def test_host_device_copies_run_at_the_host_links_bandwidth_and_host_work_is_not_on_the_device():
    # (pinned memory at the link's bandwidth; the copy back lands in pageable memory, slower: see test_cuda_pinned)
    blocking, async_issue, async_done, host_work, back, where = simdist.run(_copies, PAIR).returns[0]
    copy = H100.launch_overhead + 4 * (1 << 20) / H100.host_link_bandwidth
    assert math.isclose(blocking, copy, rel_tol=1e-9)
    assert async_issue == 0 and math.isclose(async_done, copy, rel_tol=1e-9)
    assert host_work == 0
    pageable = H100.launch_overhead + 4 * (1 << 20) / (H100.host_link_bandwidth * PAGEABLE_SHARE)
    assert math.isclose(back, pageable, rel_tol=1e-9) and where == "cpu"


def _memory():
    torch.cuda.set_device(0)
    first = torch.cuda.memory_allocated()
    host = torch.empty(1000)  # host memory: not counted
    a = torch.empty(1000, device="cuda")
    b = torch.empty(250, dtype=torch.float64, device="cuda")
    after = torch.cuda.memory_allocated()
    del a
    freed = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    reset = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    del host
    return first, after, freed, peak, reset, free, total, stats["allocated_bytes.all.current"], b.shape


def test_memory_statistics_count_device_tensors_only():
    first, after, freed, peak, reset, free, total, current, _ = simdist.run(
        _memory, PAIR, memory=True
    ).returns[0]
    assert first == 0
    assert after == 1000 * 4 + 250 * 8 and freed == 250 * 8
    assert peak == after and reset == freed and current == freed
    assert total == H100.memory_capacity and free == total - freed


def test_memory_statistics_without_accounting_warn_and_answer_zero():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = simdist.run(_memory, PAIR).returns[0]
    assert out[:5] == (0, 0, 0, 0, 0)
    assert any("memory=True" in str(w.message) for w in caught)


def _allocations() -> tuple[dict[str, int], str]:
    torch.cuda.set_device(0)
    kept = torch.empty(1000, device="cuda")  # 4000 B
    for _ in range(3):
        scratch = torch.empty(250, dtype=torch.float64, device="cuda")  # 2000 B each, freed
        del scratch
    stats = torch.cuda.memory_stats()
    summary = torch.cuda.memory_summary()  # torch's own report reads every key it expects
    del kept
    return stats, summary


def test_memory_stats_have_torchs_keys_and_count_allocations_and_frees():
    stats, summary = simdist.run(_allocations, PAIR, memory=True).returns[0]
    assert stats["allocated_bytes.all.current"] == stats["reserved_bytes.all.current"] == 4000
    assert stats["allocated_bytes.all.peak"] == 6000
    assert stats["allocated_bytes.all.allocated"] == 4000 + 3 * 2000
    assert stats["allocated_bytes.all.freed"] == 3 * 2000
    assert (
        stats["allocation.all.current"],
        stats["allocation.all.allocated"],
        stats["allocation.all.freed"],
    ) == (1, 4, 3)
    assert stats["allocation.all.peak"] == 2 and stats["num_ooms"] == 0
    assert "PyTorch CUDA memory summary, device ID 0" in summary and "Allocated memory" in summary


def _too_big():
    try:
        torch.empty(
            2**50, dtype=torch.uint8, device="cuda"
        )  # a PiB: allocating it on the host would fail otherwise
    except torch.cuda.OutOfMemoryError as e:
        return type(e).__name__, str(e)
    return None


def test_out_of_memory_is_torch_cuda_out_of_memory_before_any_host_allocation():
    name, text = simdist.run(_too_big, PAIR, memory=True).returns[0]
    assert name == "OutOfMemoryError" and "tried to allocate 1 PiB" in text and "in op aten::empty" in text


def _cuda_on_cpu():
    torch.zeros(1, device="cuda")


def test_cuda_code_on_a_cpu_cluster_is_a_clear_error_naming_the_line():
    with pytest.raises(
        RankError, match=r"rank \d used CUDA .* at .*test_cuda_runtime.py:\d+ .*GPU preset"
    ) as info:
        simdist.run(_cuda_on_cpu, simdist.Cluster.switch(2, device="cpu"))
    assert isinstance(info.value.exc, NoCudaError)


#: what rank code's torch.cuda answers outside a run, printed by a process that never ran simdist (the oracle)
_OUTSIDE = """
import json, torch, torch.distributed as dist
answers = {
    "is_available": torch.cuda.is_available(),
    "device_count": torch.cuda.device_count(),
    "version": torch.version.cuda,
    "accelerator": str(torch.accelerator.current_accelerator()),
    "nccl": dist.is_nccl_available(),
    "generator": torch.Generator is torch._C.Generator,
}
calls = {
    "zeros": lambda: torch.zeros(1, device="cuda"),
    "cuda()": lambda: torch.ones(1).cuda(),
    "event": lambda: torch.cuda.Event(),
    "stream": lambda: torch.cuda.Stream(),
    "set_device": lambda: torch.cuda.set_device(0),
    "current_device": lambda: torch.cuda.current_device(),
    "pin_memory": lambda: torch.ones(1).pin_memory(),
    "is_pinned": lambda: torch.ones(1).is_pinned(),
    "memory_allocated": lambda: torch.cuda.memory_allocated(),
    "manual_seed_all": lambda: torch.cuda.manual_seed_all(0),
    "backward": lambda: torch.ones(2, requires_grad=True).sum().backward(),
}
for name, call in calls.items():
    try:
        answers[name] = repr(call())
    except Exception as e:
        answers[name] = [type(e).__name__, str(e)]
print(json.dumps(answers))
"""


def test_outside_a_run_torch_cuda_answers_as_torch_does():
    fresh = subprocess.run(
        [sys.executable, "-c", _OUTSIDE], capture_output=True, text=True, check=True, timeout=120
    )
    simdist.run(_timed_matmul, PAIR)  # tensors on the GPU: CUDA's lazy initialisation ran in rank code
    with pytest.raises(RankError):
        simdist.run(_set_bad_device, NODES)
    here: dict = {}
    exec(_OUTSIDE.replace("print(json.dumps(answers))", ""), here)  # noqa: S102 - the same program, in this process
    assert here["answers"] == json.loads(fresh.stdout)


def test_a_failing_self_check_stops_the_run_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch):
    started = []
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(CudaEmulationError, match="torch 2.14.0"):
        simdist.run(lambda: started.append(1), PAIR)
    assert not started and not native.installed()


def _init_with(backend: str | None) -> tuple[str, str, str, list[float]]:
    dist.init_process_group(backend)
    group = dist.new_group([0, 1])
    x = torch.ones(2, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return dist.get_backend(), dist.get_backend(group), dist.get_backend_config(), x.tolist()


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "gloo"])
def test_a_gpu_cluster_accepts_the_backends_of_a_gpu_machine_and_presents_them(backend: str) -> None:
    """What the code asked for is what torch answers on a GPU machine (torch's own BackendConfig is the oracle)."""
    config = str(dist.distributed_c10d.BackendConfig(dist.Backend(backend)))
    for rank in simdist.run(_init_with, PAIR, args=(backend,)).returns:
        assert rank == (backend, backend, config, [3.0, 3.0])


def test_a_gpu_cluster_without_a_backend_presents_the_runs_name() -> None:
    returns = simdist.run(_init_with, PAIR, args=(None,), backend_name="nccl").returns
    assert returns[0] == ("nccl", "nccl", "cuda:nccl", [3.0, 3.0])


def _checkpoint(path: str, location: str) -> dict[str, torch.Tensor]:
    """Save a checkpoint whose storages are tagged ``location`` (``"cuda:1"``: as written on a GPU machine)."""
    weight = torch.arange(6.0).view(2, 3)
    state = {"weight": weight, "row": weight[1], "step": torch.tensor(7)}
    tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: location  # the tag a GPU machine writes
    try:
        torch.save(state, path)
    finally:
        torch.serialization.location_tag = tag
    return state


def _load(path: str, map_location: Any) -> tuple[dict[str, str], dict[str, torch.Tensor], bool]:
    torch.cuda.set_device(dist.get_rank())
    state = torch.load(path, map_location=map_location)
    state["weight"].add_(1)  # "row" is a view of "weight" in the checkpoint: it must still be one
    aliased = torch.equal(state["row"].cpu(), state["weight"][1].cpu())
    return {k: str(v.device) for k, v in state.items()}, {k: v.cpu() for k, v in state.items()}, aliased


@pytest.mark.parametrize(
    ("saved", "map_location", "device"),
    [
        ("cuda:1", None, "cuda:1"),  # a GPU checkpoint, loaded as written
        ("cuda:1", {"cuda:1": "cuda:0"}, "cuda:0"),
        ("cpu", "cuda", "cuda:{rank}"),  # the current device
        ("cpu", torch.device("cuda", 1), "cuda:1"),
        ("cuda:1", "cpu", "cpu"),
    ],
)
def test_torch_load_puts_checkpoints_on_the_simulated_gpus(
    tmp_path, saved: str, map_location: Any, device: str
):
    path = str(tmp_path / "ckpt.pt")
    state = _checkpoint(path, saved)
    for rank, (devices, values, aliased) in enumerate(
        simdist.run(_load, PAIR, args=(path, map_location)).returns
    ):
        assert set(devices.values()) == {device.format(rank=rank)}
        assert aliased
        assert torch.equal(values["weight"], state["weight"] + 1) and torch.equal(
            values["step"], state["step"]
        )


def _initialisation(first: str) -> list[bool]:
    seen = [torch.cuda.is_initialized()]
    if first == "tensor":
        torch.zeros(1, device="cuda")
    elif first == "set_device":
        torch.cuda.set_device(0)
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    return [*seen, torch.cuda.is_initialized()]


@pytest.mark.parametrize(("first", "after"), [("tensor", True), ("set_device", True), ("bound_group", False)])
def test_is_initialized_answers_whether_the_ranks_code_has_initialised_cuda(first: str, after: bool) -> None:
    # torch's answer: False until a call runs torch.cuda's lazy initialisation; binding the process group to a GPU
    # (NCCL's eager connection) runs none, so DeviceMesh still picks the device from LOCAL_RANK
    assert simdist.run(_initialisation, PAIR, args=(first,)).returns == [[False, after]] * 2


def test_torch_load_reaches_the_simulated_gpus_after_a_load_outside_any_run(tmp_path) -> None:
    # torch.load's weights-only unpickler builds its table of allowed functions once per process: a load before the
    # run (any test or program) must not leave a run's checkpoints on the CPU, nor a run's table after it
    path = str(tmp_path / "ckpt.pt")
    state = _checkpoint(path, "cpu")
    torch.load(path)  # outside any run: the table holds torch's own functions
    for rank, (devices, _, aliased) in enumerate(simdist.run(_load, PAIR, args=(path, "cuda")).returns):
        assert set(devices.values()) == {f"cuda:{rank}"} and aliased
    after = torch.load(path)
    assert after["weight"].device.type == "cpu" and torch.equal(after["weight"], state["weight"])
    assert torch._weights_only_unpickler._get_allowed_globals()["torch._utils._rebuild_tensor_v2"] is (
        torch._utils._rebuild_tensor_v2
    )
