"""Hostile CUDA code on simulated GPUs: devices mixed, devices the node lacks, host conversions, allocations past
the device's memory, CUDA code on a cluster without GPUs, a process where the simulated GPU cannot be set up; and
a sweep over modules, dtypes and ``torch.cuda`` calls that must end in results or errors, never in an abort."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from typing_extensions import Self

import simdist
from simdist.compute import get_device
from simdist.errors import CudaEmulationError, OutOfMemoryError, RaceError, RankError

PAIR = simdist.Cluster.switch(2, device="H100")
ONE = simdist.Cluster.switch(1, device="H100")
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


#: the (wrapper, hook) pairs of ``cuda_hook_raises.py`` the cases below run, all in one child process
_HOOK_CASES = (("fsdp2", "backward"), ("fsdp2", "tensor"), ("ddp", "backward"), ("ddp", "forward"))


@functools.cache
def _hook_reports() -> tuple[dict | None, str]:
    """What ``cuda_hook_raises.py`` reported for every pair of :data:`_HOOK_CASES` (one launch for the four cases
    that read it), or None and the tail of its output if the child process failed."""
    done = subprocess.run(
        [sys.executable, str(HERE / "cuda_hook_raises.py"), *(f"{w}:{h}" for w, h in _HOOK_CASES)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_child_env(),
        check=False,
    )
    tail = (done.stdout + done.stderr)[-3000:]
    if done.returncode != 0:
        return None, f"the child process ended with status {done.returncode}:\n{tail}"
    return json.loads(done.stdout.strip().splitlines()[-1]), tail


def _hook_raises_in_a_child(wrapper: str, hook: str) -> None:
    """``cuda_hook_raises.py``'s run of ``wrapper`` and ``hook`` in a child process (an abort there fails this
    case, not pytest); its run's :class:`RankError` raised again here, from what the child reported."""
    reports, tail = _hook_reports()
    assert reports is not None, tail
    report = reports[f"{wrapper}:{hook}"]
    assert report is not None, f"the run raised nothing:\n{tail}"
    raise RankError(report["rank"], ValueError(report["error"]), report["traceback"])


def _child_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]),
    }


#: the line of the hook that raises, as a rank's traceback names it
_HOOK_LINE = r'cuda_hook_raises\.py", line \d+, in _raise\n    raise ValueError\("a hook raised"\)'


def _init_a_sharded_parameter(ranks: int = 2) -> torch.Tensor:
    """What FSDP2 scripts do after ``fully_shard`` on the meta device: initialise the sharded parameters."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (ranks,))
    weight = distribute_tensor(torch.zeros(4, 4, device="cuda"), mesh, [Shard(0)])
    torch.nn.init.normal_(weight)
    return weight.full_tensor().cpu()


def _same_as_one_rank(result: simdist.RunResult) -> None:
    """Every rank assembles the tensor that one rank draws whole (row blocks of 8 elements lie at their offsets)."""
    (whole,) = simdist.run(_init_a_sharded_parameter, ONE, args=(1,)).returns
    assert all(torch.equal(r, whole) for r in result.returns)


def _init_on_own_devices() -> torch.Tensor:
    """Each rank on its own GPU of the node, as torchrun scripts set it: DTensor's tracker is each rank's own."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return _init_a_sharded_parameter()


def _dropout_on_a_dtensor() -> torch.Tensor:
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    x = distribute_tensor(torch.ones(4, 3, device="cuda"), mesh, [Replicate()])
    torch.manual_seed(1)
    return torch.nn.functional.dropout(x, 0.5).to_local().cpu()


def _same_mask_on_every_replica(result: simdist.RunResult) -> None:
    (one,) = simdist.run(_dropout_on_a_dtensor, ONE).returns
    assert all(torch.equal(r, one) for r in result.returns) and 0 < int((one == 0).sum()) < one.numel()


def _init_with_a_generator() -> None:
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    weight = distribute_tensor(torch.zeros(4, 4, device="cuda"), mesh, [Shard(0)])
    torch.nn.init.normal_(weight, generator=torch.Generator(device="cuda").manual_seed(0))


_BOUND_SCRIPT = """
import os, torch, torch.distributed as dist
rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
t = torch.full((2,), float(rank + 1), device=f"cuda:{rank}")
dist.all_reduce(t)
assert t.tolist() == [3.0, 3.0], t  # 1 + 2 on both ranks
"""


def _script_binding_its_group_to_a_gpu() -> simdist.RunResult:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bound.py"
        path.write_text(_BOUND_SCRIPT)
        return simdist.run_script(path, PAIR)


def _ran_to_the_end(result: simdist.RunResult) -> None:
    """Both ranks ran to the end (each script checks its own results)."""
    assert result.world_size == 2 and result.returns == [None, None]


_META_FSDP2_SCRIPT = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=device)
torch.manual_seed(0)
with torch.device("meta"):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
fully_shard(model)
model.to_empty(device=device)
for layer in model:
    layer.reset_parameters()
model(torch.ones(4, 8, device=device)).sum().backward()
weight = model[0].weight
assert weight.device_mesh.device_type == "cuda" and weight.grad.to_local().device == device, weight.grad.device
assert torch.cuda.current_device() == rank
"""


def _fsdp2_on_the_meta_device() -> simdist.RunResult:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "meta_fsdp2.py"
        path.write_text(_META_FSDP2_SCRIPT)
        return simdist.run_script(path, PAIR)


def _cpu_state_for_the_gpu() -> None:
    torch.cuda.set_rng_state(torch.get_rng_state())


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


def _copy_of_another_shape() -> None:
    torch.zeros(4, device="cuda").copy_(torch.ones(3, device="cuda"))


def _load_onto_a_missing_gpu(path: str) -> None:
    torch.load(path)  # written on a machine with 8 GPUs, from its cuda:5


def _checkpoint_from_gpu_5() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        tag = torch.serialization.location_tag
        torch.serialization.location_tag = lambda storage: "cuda:5"
        try:
            torch.save({"w": torch.ones(2)}, path)
        finally:
            torch.serialization.location_tag = tag
        simdist.run(_load_onto_a_missing_gpu, PAIR, args=(path,))


def _return_the_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    model = torch.nn.Linear(2, 2).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dist.get_rank()])
    opt = torch.optim.AdamW(ddp.parameters())
    ddp(torch.ones(1, 2, device="cuda")).sum().backward()
    opt.step()
    return ddp, opt


def _trains_on_the_host(result: simdist.RunResult) -> None:
    ddp, opt = result.returns[0]
    params = list(ddp.module.parameters())
    assert all(type(p) is torch.nn.Parameter for p in params)
    assert all(type(p) is torch.nn.Parameter for p in opt.state) and all(p in opt.state for p in params)
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    ddp.module(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, params))


def _cuda_only_op() -> None:
    torch.cuda.set_device(0)
    q = torch.randn(1, 2, 4, 8, device="cuda")
    # CUDA's kernel, called directly
    torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False)


def _reads_side_stream_result_without_wait() -> float:
    side = torch.cuda.Stream()
    x = torch.ones(64, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 3
    return float(y.sum())  # the default stream never waited for the side stream


def _pins_nothing() -> tuple[bool, bool, bool]:
    host = torch.ones(8)
    torch.ones(1, device="cuda")
    return host.is_pinned(), host.pin_memory().is_pinned(), host.is_pinned()


def _pops_an_nvtx_range_never_pushed() -> tuple[int, int, int]:
    popped = torch.cuda.nvtx.range_pop()
    pushed = torch.cuda.nvtx.range_push("step")
    return popped, pushed, torch.cuda.nvtx.range_pop()


def _pageable_non_blocking() -> float:
    torch.cuda.set_device(0)
    host = torch.ones(1 << 20)  # 4 MiB, pageable
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    t0 = simdist.now()
    host.to("cuda", non_blocking=True)  # the driver stages it: the host waits anyway
    return simdist.now() - t0


def _check_staged(result: simdist.RunResult) -> None:
    from simdist.cuda.pinned import PAGEABLE_SHARE

    h100 = get_device("H100")
    staged = h100.launch_overhead + 4 * 2**20 / (h100.host_link_bandwidth * PAGEABLE_SHARE)
    assert all(abs(t - staged) <= 1e-9 * staged for t in result.returns)


def _fsdp_weight_outside_forward() -> None:
    from torch import nn

    from simdist.strategies.fsdp import FSDP

    torch.cuda.set_device(dist.get_rank())
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to("cuda")
    model = FSDP(net)
    model(torch.ones(3, 4, device="cuda")).sum().backward()
    model.finish_gradient_synchronization()
    net[0].weight.sum()  # sharded and freed between forwards


def _gather_host_metadata() -> None:
    """A GPU program that gathers its batch size, kept on the host, over its NCCL group."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([8 + dist.get_rank()]))


def _gather_objects_under_nccl() -> list:
    """Object collectives under NCCL: through the current GPU, as on GPUs."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, {"rank": dist.get_rank(), "steps": list(range(dist.get_rank() + 1))})
    return got


def _expect(got: object, expected: object) -> None:
    assert got == expected, f"{got!r} != {expected!r}"


def _check_retry(result: simdist.RunResult) -> None:
    # the largest power of two whose float32 tensor fits in 64 MiB: 2**24 elements
    assert result.returns == [2**24, 2**24]


class _TaggedParameter(torch.nn.Parameter):
    """A parameter class with an attribute of its own, as libraries define them (no ``__torch_dispatch__``)."""

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True, tag: str = "") -> Self:
        p = super().__new__(cls, data, requires_grad)
        p.tag = tag
        return p


def _move_a_parameter_subclass(kind: str) -> tuple:
    """A module holding a parameter subclass, moved to ``kind`` with ``Module.to``, then one training step."""
    dev = "cuda" if kind == "cuda" else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model.weight = _TaggedParameter(model.weight.detach().clone(), tag="w")
    kept = model.weight
    model.to(dev)
    w = model.weight
    loss = model(torch.ones(4, 3, device=dev)).square().sum()
    loss.backward()
    return (
        w is kept,
        isinstance(w, torch.nn.Parameter),
        w.tag,
        w.device.type,
        loss.item(),
        w.grad.cpu(),
    )


def _as_its_cpu_twin(res: simdist.RunResult) -> None:
    twin = simdist.run(_move_a_parameter_subclass, simdist.Cluster.switch(2, device="cpu"), args=("cpu",))
    for rank, (got, want) in enumerate(zip(res.returns, twin.returns)):
        assert got[:3] == (True, True, "w") and got[3] == "cuda", (rank, got)
        assert got[4] == want[4] and torch.equal(got[5], want[5]), (rank, got, want)


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
        "fsdp_weight_outside_forward",
        "reads a weight FSDP sharded on the GPU outside the forward (its memory is freed there)",
        lambda: simdist.run(_fsdp_weight_outside_forward, PAIR),
        error=RankError,
        match=r"FSDP's sharded parameter '0\.weight' was used by torch\.Tensor\.sum on rank \d outside the forward",
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
        "gpu_copy_of_another_shape",
        "copies a tensor of another shape into a GPU tensor (torch's error is raised under a C++ device guard)",
        lambda: simdist.run(_copy_of_another_shape, PAIR),
        error=RankError,
        match=r"raised RuntimeError: The size of tensor a \(4\) must match the size of tensor b \(3\)",
    ),
    Case(
        "checkpoint_from_a_missing_gpu",
        "loads a checkpoint written from cuda:5 onto a node of 2 GPUs without map_location",
        _checkpoint_from_gpu_5,
        error=RankError,
        match=r"Attempting to deserialize object on CUDA device 5 but torch\.cuda\.device_count\(\) is 2",
    ),
    Case(
        "returned_model_and_optimizer",
        "returns its DDP model and optimizer from the rank, then trains them after the run",
        lambda: simdist.run(_return_the_model, PAIR),
        check=_trains_on_the_host,
    ),
    Case(
        "cuda_only_op_without_stand_in",
        "calls a CUDA-only kernel that has no CPU stand-in on a simulated GPU",
        lambda: simdist.run(_cuda_only_op, PAIR),
        error=RankError,
        match=r"aten::_scaled_dot_product_efficient_attention \(called at .*test_hostile_cuda.py:\d+\) has a CUDA "
        r"kernel only",
    ),
    Case(
        "side_stream_read_without_wait",
        "reads a side stream's result on the default stream without waiting for the side stream",
        lambda: simdist.run(_reads_side_stream_result_without_wait, PAIR, races="error"),
        error=RaceError,
        match=r"(?s)read \(in aten\.sum on the default stream\).*aten\.mul\.Tensor on side stream 1 \(queued at .* from "
        r".*test_hostile_cuda\.py:\d+ .*without waiting.*access at: .*test_hostile_cuda\.py:\d+",
    ),
    Case(
        "pageable_is_pinned",
        "asks a plain host tensor whether it is pinned",
        lambda: simdist.run(_pins_nothing, PAIR),
        check=lambda res: _expect(res.returns, [(False, True, False)] * 2),
    ),
    Case(
        "nvtx_pop_never_pushed",
        "pops an NVTX range it never pushed",
        lambda: simdist.run(_pops_an_nvtx_range_never_pushed, PAIR),
        check=lambda res: _expect(res.returns, [(-1, 0, 0)] * 2),
    ),
    Case(
        "pageable_non_blocking",
        "copies pageable host memory to the GPU with non_blocking=True and expects the host to go on",
        lambda: simdist.run(_pageable_non_blocking, PAIR),
        check=_check_staged,
    ),
    Case(
        "fsdp2_backward_hook_raises",
        "raises in a module's backward hook on one rank while the other is in FSDP2's backward",
        lambda: _hook_raises_in_a_child("fsdp2", "backward"),
        error=RankError,
        match=r"(?s)^rank 0 raised ValueError: a hook raised\n.*" + _HOOK_LINE,
    ),
    Case(
        "fsdp2_tensor_hook_raises",
        "raises in a tensor's gradient hook on one rank while the other is in FSDP2's backward",
        lambda: _hook_raises_in_a_child("fsdp2", "tensor"),
        error=RankError,
        match=r"(?s)^rank 0 raised ValueError: a hook raised\n.*" + _HOOK_LINE,
    ),
    Case(
        "ddp_backward_hook_raises",
        "raises in a module's backward hook on one rank while the other is in DDP's backward",
        lambda: _hook_raises_in_a_child("ddp", "backward"),
        error=RankError,
        match=r"(?s)^rank 0 raised ValueError: a hook raised\n.*" + _HOOK_LINE,
    ),
    Case(
        "ddp_forward_hook_raises",
        "raises in a module's forward hook on one rank while the other runs DDP's forward",
        lambda: _hook_raises_in_a_child("ddp", "forward"),
        error=RankError,
        match=r"(?s)^rank 0 raised ValueError: a hook raised\n.*" + _HOOK_LINE,
    ),
    Case(
        "dtensor_init_on_sharded_parameter",
        "initialises a sharded parameter with torch.nn.init (DTensor's random ops want CUDA's Philox offsets)",
        lambda: simdist.run(_init_a_sharded_parameter, PAIR),
        check=_same_as_one_rank,
    ),
    Case(
        "dtensor_init_each_rank_on_its_gpu",
        "initialises a sharded parameter with each rank on its own GPU of one node (DTensor's tracker is a global)",
        lambda: simdist.run(_init_on_own_devices, PAIR),
        check=_same_as_one_rank,
    ),
    Case(
        "dtensor_dropout",
        "applies dropout to a replicated DTensor on simulated GPUs",
        lambda: simdist.run(_dropout_on_a_dtensor, PAIR),
        check=_same_mask_on_every_replica,
    ),
    Case(
        "dtensor_init_with_a_generator",
        "passes its own CUDA generator to torch.nn.init on a sharded parameter",
        lambda: simdist.run(_init_with_a_generator, PAIR),
        error=RankError,
        match=r"raised UnsupportedCudaOpError: a random op on a DTensor \(called at .*test_hostile_cuda\.py:\d+\) "
        r"was given a generator.*Pass no generator",
    ),
    Case(
        "script_binds_its_group_to_a_gpu",
        "a torchrun script calls init_process_group('nccl', device_id=torch.device('cuda', LOCAL_RANK))",
        _script_binding_its_group_to_a_gpu,
        check=_ran_to_the_end,
    ),
    Case(
        "fsdp2_script_initialised_on_the_meta_device",
        "an FSDP2 script binds its group to its GPU, shards a meta-device model, then reset_parameters() (no set_device)",
        _fsdp2_on_the_meta_device,
        check=_ran_to_the_end,
    ),
    Case(
        "cpu_rng_state_for_the_gpu",
        "restores the GPU's generator from torch.get_rng_state() (the CPU's state)",
        lambda: simdist.run(_cpu_state_for_the_gpu, ONE),
        error=RankError,
        match=r"raised InvalidArgumentError: RNG state is wrong size: a simulated GPU's generator state is 5072 bytes"
        r".*got 5056 bytes",
    ),
    Case(
        "nccl_gathers_host_metadata",
        "gathers CPU tensors (batch sizes kept on the host) over an NCCL group on simulated GPUs",
        lambda: simdist.run(_gather_host_metadata, PAIR),
        error=RankError,
        match=r"No backend type associated with device type cpu \(rank 0, all_gather on group 0 of 2 ranks, at "
        r".*test_hostile_cuda\.py:\d+.*Move the tensor to the GPU.*cpu:gloo,cuda:nccl",
    ),
    Case(
        "nccl_object_gather",
        "gathers Python objects over an NCCL group on simulated GPUs (torch moves them through the current GPU)",
        lambda: simdist.run(_gather_objects_under_nccl, PAIR),
        check=lambda res: _expect(res.returns, [[{"rank": 0, "steps": [0]}, {"rank": 1, "steps": [0, 1]}]] * 2),
    ),
    Case(
        "self_check_fails",
        "runs CUDA code on a torch whose native layout the emulation does not know",
        _self_check_fails,
        error=CudaEmulationError,
        match=r"need, in this process: torch 3\.0\.0",
    ),
    Case(
        "parameter_subclass_to_cuda",
        "moves a module holding a subclass of nn.Parameter (with an attribute of its own) with .to('cuda')",
        lambda: simdist.run(_move_a_parameter_subclass, PAIR, args=("cuda",)),
        check=_as_its_cpu_twin,
    ),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile_cuda(case: Case) -> None:
    check(case)


@pytest.mark.slow
def test_a_sweep_over_modules_dtypes_and_cuda_calls_never_aborts() -> None:
    """Hypothesis drives programs in a child process: an abort (a C++ path ending the process) fails this test
    with the last program it started, instead of ending pytest."""
    done = subprocess.run(
        [sys.executable, str(HERE / "cuda_sweep.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=_child_env(),
        check=False,
    )
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"the sweep's process ended with status {done.returncode}:\n{tail}"
    assert "sweep done" in done.stdout, tail
