"""Groups presented as NCCL on simulated GPUs take what NCCL takes: CUDA tensors, refused on the CPU as torch 2.13
refuses them; ``"cpu:gloo,cuda:nccl"`` takes both, gloo takes CUDA tensors where gloo does; object collectives go
through the device the real backend's device types pick. On a CPU cluster a group named "nccl" takes CPU tensors.

Oracles: torch's own message for a device without a backend (a real single-process ``ProcessGroup`` whose only
backend serves CUDA), the sum of the ranks' values, torch's ``_get_object_coll_device`` rules.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _get_object_coll_device

import simdist
from simdist.errors import InvalidArgumentError, RankError

PAIR = simdist.Cluster.switch(2, device="H100")
NO_BACKEND = "No backend type associated with device type cpu"


def test_the_refusal_is_torchs_own_message() -> None:
    # torch itself: a real group whose only backend serves CUDA, given a CPU tensor
    store = dist.HashStore()
    dist.init_process_group("cuda:gloo", rank=0, world_size=1, store=store)
    try:
        with pytest.raises(RuntimeError) as info:
            dist.all_reduce(torch.ones(2))
        assert str(info.value).startswith(NO_BACKEND)
        assert dist.group.WORLD._device_types == [torch.device("cuda")]
    finally:
        dist.destroy_process_group()


def _ops(x: torch.Tensor, n: int) -> dict[str, Callable[[], object]]:
    """One call of each collective family on ``x`` (and tensors on its device), sync and async."""
    me = dist.get_rank()
    like = lambda m: torch.zeros(m, device=x.device)
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_reduce_async": lambda: dist.all_reduce(x, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(x, 0),
        "reduce": lambda: dist.reduce(x, 0),
        "all_gather": lambda: dist.all_gather([like(x.numel()) for _ in range(n)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(like(n * x.numel()), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(like(x.numel() // n), x),
        "all_to_all_single": lambda: dist.all_to_all_single(like(x.numel()), x),
        "gather": lambda: dist.gather(x, [like(x.numel()) for _ in range(n)] if me == 0 else None, 0),
        "scatter": lambda: dist.scatter(x, [like(x.numel()) for _ in range(n)] if me == 0 else None, 0),
        "coalesced": lambda: dist.all_reduce_coalesced([x, x.clone()]),
        "coalescing_manager": lambda: _coalesced(x, n),
        "funcol": lambda: funcol.all_reduce(x, "sum", dist.group.WORLD).wait(),
        "funcol_coalesced": lambda: [
            t.wait() for t in funcol.all_gather_into_tensor_coalesced([x], dist.group.WORLD)
        ],
        "send_recv": lambda: dist.send(x, 1) if me == 0 else dist.recv(x, 0),
        "isend_irecv": lambda: (dist.isend(x, 1) if me == 0 else dist.irecv(x, 0)).wait(),
    }


def _coalesced(x: torch.Tensor, n: int) -> None:
    outs = [torch.zeros(n * x.numel(), device=x.device) for _ in range(2)]
    with dist._coalescing_manager(device=x.device):
        for out in outs:
            dist.all_gather_into_tensor(out, x)


OPS = [
    "all_reduce",
    "all_reduce_async",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
    "coalesced",
    "coalescing_manager",
    "funcol",
    "funcol_coalesced",
    "send_recv",
    "isend_irecv",
]


def _call(backend: str, kind: str, op: str) -> float:
    dist.init_process_group(backend)
    torch.cuda.set_device(dist.get_rank())
    x = torch.arange(4.0, device=kind) + dist.get_rank()
    _ops(x, dist.get_world_size())[op]()
    return float(x.sum().item())


@pytest.mark.parametrize("op", OPS)
def test_a_group_presented_as_nccl_refuses_cpu_tensors_in_every_family(op: str) -> None:
    with pytest.raises(RankError) as info:
        simdist.run(_call, PAIR, args=("nccl", "cpu", op))
    err = info.value.__cause__ or info.value
    assert isinstance(err, RuntimeError) and isinstance(err, InvalidArgumentError)
    text = str(info.value)
    assert NO_BACKEND in text
    assert "test_nccl_devices.py" in text  # the call site
    assert "cpu:gloo,cuda:nccl" in text and "cuda" in text  # the ways out


@pytest.mark.parametrize("op", OPS)
def test_the_same_calls_on_cuda_tensors_run(op: str) -> None:
    simdist.run(_call, PAIR, args=("nccl", "cuda", op))


def test_all_reduce_of_cuda_tensors_under_nccl_sums() -> None:
    got = simdist.run(_call, PAIR, args=("nccl", "cuda", "all_reduce")).returns
    assert got == [float(2 * sum(range(4)) + 4)] * 2  # (0+1+2+3) + (1+2+3+4) on each rank


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "gloo"])
@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_groups_with_a_cpu_backend_take_both_devices(backend: str, kind: str) -> None:
    got = simdist.run(_call, PAIR, args=(backend, kind, "all_reduce")).returns
    assert got == [float(2 * sum(range(4)) + 4)] * 2


def test_a_group_without_a_backend_takes_both_devices() -> None:
    def rank() -> list[float]:
        dist.init_process_group()
        torch.cuda.set_device(dist.get_rank())
        out = []
        for kind in ("cpu", "cuda"):
            x = torch.ones(2, device=kind)
            dist.all_reduce(x)
            out.append(float(x.sum().item()))
        return out

    assert simdist.run(rank, PAIR).returns == [[4.0, 4.0]] * 2


def test_new_group_presented_as_nccl_refuses_cpu_tensors() -> None:
    def rank() -> None:
        dist.init_process_group("cpu:gloo,cuda:nccl")
        torch.cuda.set_device(dist.get_rank())
        dist.all_reduce(torch.ones(2))  # the default group has gloo for CPU tensors
        dist.all_reduce(torch.ones(2), group=dist.new_group(backend="nccl"))

    with pytest.raises(RankError, match=NO_BACKEND):
        simdist.run(rank, PAIR)


@pytest.mark.parametrize(
    ("op", "words"),
    [
        ("coalesced", "ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda"),
        ("send_recv", "gloo takes CPU tensors only"),
        ("isend_irecv", "gloo takes CPU tensors only"),
    ],
)
def test_gloo_refuses_cuda_tensors_where_gloo_does(op: str, words: str) -> None:
    with pytest.raises(RankError, match=words):
        simdist.run(_call, PAIR, args=("gloo", "cuda", op))


def _object_device(backend: str | None) -> tuple[list, str]:
    dist.init_process_group(backend)
    torch.cuda.set_device(dist.get_rank())
    objs: list = [None, None]
    dist.all_gather_object(objs, {"rank": dist.get_rank()})
    return objs, _get_object_coll_device()


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu"), (None, "cpu")],
)
def test_object_collectives_use_the_device_the_real_backend_picks(
    backend: str | None, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.distributed_c10d as c10d

    seen: list[str] = []
    original = c10d.all_gather

    def spy(tensor_list: list, tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        seen.append(tensor.device.type)
        return original(tensor_list, tensor, *args, **kwargs)

    monkeypatch.setattr(c10d, "all_gather", spy)
    res = simdist.run(_object_device, PAIR, args=(backend,))
    for rank, (objs, picked) in enumerate(res.returns):
        assert objs == [{"rank": 0}, {"rank": 1}], rank
        assert picked == device
    assert set(seen) == {device}


def test_object_collectives_under_nccl_pay_for_host_device_copies() -> None:
    def rank(backend: str) -> float:
        dist.init_process_group(backend)
        torch.cuda.set_device(dist.get_rank())
        objs: list = [None, None]
        torch.cuda.synchronize()
        t0 = simdist.now()
        dist.all_gather_object(objs, list(range(1000)))
        torch.cuda.synchronize()
        return simdist.now() - t0

    on_gpu = simdist.run(rank, PAIR, args=("nccl",)).returns
    on_cpu = simdist.run(rank, PAIR, args=("cpu:gloo,cuda:nccl",)).returns
    assert min(on_gpu) > max(on_cpu)


def test_on_a_cpu_cluster_a_group_named_nccl_takes_cpu_tensors() -> None:
    def rank() -> float:
        dist.init_process_group("nccl")
        x = torch.ones(2)
        dist.all_reduce(x)
        return float(x.sum().item())

    res = simdist.run(rank, simdist.Cluster.switch(2, device="cpu"), backend_name="nccl")
    assert res.returns == [4.0, 4.0]
