"""Tensors on a simulated GPU: they report ``cuda:i``, compute on the CPU, and are checked as CUDA checks them.

Oracles: the same op on CPU tensors (values), CUDA's documented device rules (which mixes it refuses), torch's own
CUDA autocast policy (which ops it casts).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import types

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import simdist
from simdist.errors import CudaError, DeviceMismatchError, HostConversionError, RankError

PAIR = simdist.Cluster.switch(2, device="H100")
#: two nodes of two GPUs: device_count() is 2, ranks 2 and 3 are local ranks 0 and 1 of the second node
NODES = simdist.Cluster.two_level(2, 2, device="H100")


def _run(fn, cluster=PAIR, **kw):
    return simdist.run(fn, cluster, **kw).returns


def _current_device_per_thread():
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    seen = {}

    def other():
        seen["thread"] = (torch.cuda.current_device(), torch.zeros(1, device="cuda").device.index)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    return (
        torch.cuda.current_device(),
        torch.empty(2, device="cuda").device.index,
        torch.ones(2).cuda().device.index,  # resolved in C++, through the device guard
        torch.ones(2).to("cuda").device.index,
        seen["thread"],
    )


def test_cuda_without_an_index_is_the_calling_threads_current_device():
    out = _run(_current_device_per_thread, NODES)
    # every thread starts on device 0, as CUDA's host threads do; set_device moves only the calling thread
    assert out == [(r % 2, r % 2, r % 2, r % 2, (0, 0)) for r in range(4)]


def _device_context():
    with torch.cuda.device(1):
        inside = (torch.cuda.current_device(), torch.zeros(1, device="cuda").device.index)
    return inside, torch.cuda.current_device(), torch.cuda.device_count()


def test_torch_cuda_device_context_sets_and_restores_the_current_device():
    assert _run(_device_context, NODES) == [((1, 1), 0, 2)] * 4


def _mix(kind: str):
    a = torch.ones(3, device="cuda:0")
    others = {
        "cuda:1": lambda: torch.ones(3, device="cuda:1"),
        "cpu": lambda: torch.ones(3),
    }
    return a + others[kind]()


@pytest.mark.parametrize("kind", ["cuda:1", "cpu"])
def test_mixing_devices_is_refused_as_cuda_refuses_it(kind: str):
    with pytest.raises(
        RankError, match=r"same device, but found at least two devices, cuda:0 and " + kind
    ) as info:
        _run(lambda: _mix(kind))
    assert isinstance(info.value.exc, DeviceMismatchError) and isinstance(info.value.exc, RuntimeError)


def _allowed_mixes():
    x = torch.arange(6.0, device="cuda").reshape(2, 3)
    host = torch.arange(6.0).reshape(2, 3)
    out = {
        "cpu scalar": x * torch.tensor(2.0),
        "cpu index": x[:, torch.tensor([0, 2])],
        "to device": host.to("cuda"),
        "copy_ from host": torch.empty(2, 3, device="cuda").copy_(host),
        "copy_ to host": torch.empty(2, 3).copy_(x),
        "to host": x.cpu(),
    }
    devices = {k: str(v.device) for k, v in out.items()}
    values = {k: v.cpu() for k, v in out.items()}
    return devices, values


def test_cpu_scalars_indices_and_copies_mix_with_device_tensors():
    devices, values = _run(_allowed_mixes)[0]
    x = torch.arange(6.0).reshape(2, 3)
    expected = {
        "cpu scalar": x * 2,
        "cpu index": x[:, [0, 2]],
        "to device": x,
        "copy_ from host": x,
        "copy_ to host": x,
        "to host": x,
    }
    assert devices == {k: ("cpu" if k in ("copy_ to host", "to host") else "cuda:0") for k in expected}
    for k, v in expected.items():
        assert torch.equal(values[k], v), k


def _in_place_keeps_the_callers_tensor():
    x = torch.zeros(2, 3, device="cuda")
    y = x.add_(1)
    out = torch.empty(0, device="cuda")
    z = torch.add(x, x, out=out)  # resizes out
    w = x.t_()  # changes x's sizes in place
    return y is x, z is out, tuple(out.shape), w is x, tuple(x.shape), x.device.type, out.cpu()


def test_in_place_and_out_ops_return_the_callers_tensor_with_its_new_metadata():
    same, out_same, out_shape, t_same, shape, dev, out = _run(_in_place_keeps_the_callers_tensor)[0]
    assert same and out_same and t_same
    assert out_shape == (2, 3) and shape == (3, 2) and dev == "cuda"
    assert torch.equal(out, torch.full((2, 3), 2.0))


def _assign_data(kind: str) -> tuple:
    """Replace tensors' data (``x.data = y``: a shape, a dtype, a parameter's), as weight surgery and FSDP1 do."""
    x = torch.zeros(2, device=kind)
    x.data = torch.ones(3, device=kind)
    p = torch.nn.Parameter(torch.zeros(2, 2, device=kind))
    p.data = torch.arange(4.0, device=kind)
    p.data = p.data.to(torch.float64)
    y = p * 2
    (p * p).sum().backward()
    return tuple(x.shape), x.cpu(), p.dtype, p.cpu(), y.cpu(), p.grad.cpu(), x.device.type


def test_assigning_data_replaces_the_values_as_for_the_cpu_program():
    gpu = _run(_assign_data, args=("cuda",))[0]
    cpu = _run(_assign_data, args=("cpu",))[0]
    assert gpu[-1] == "cuda" and cpu[-1] == "cpu"
    for a, b in zip(gpu[:-1], cpu[:-1]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _module_round_trip(kind: str) -> tuple:
    """A module moved to ``kind``, trained a step, cast to half, moved to the host and back (``Module._apply``)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2).to(kind)
    m(torch.ones(1, 2, device=kind)).sum().backward()
    m.half()
    m.cpu()
    on_host = (type(m.weight), m.weight.device.type, m.weight.grad.device.type, m.weight.dtype)
    m.to(kind, torch.float32)
    return on_host, m(torch.ones(1, 2, device=kind)).detach().cpu(), m.weight.grad.cpu(), m.weight.device.type


def test_a_module_moves_between_host_and_gpu_as_for_the_cpu_program():
    gpu = _run(_module_round_trip, args=("cuda",))[0]
    cpu = _run(_module_round_trip, args=("cpu",))[0]
    assert gpu[0] == cpu[0] == (torch.nn.Parameter, "cpu", "cpu", torch.float16)
    assert torch.equal(gpu[1], cpu[1]) and torch.equal(gpu[2], cpu[2])
    assert (gpu[3], cpu[3]) == ("cuda", "cpu")


def _errors_under_a_device_guard(kind: str) -> list[str]:
    """Errors torch raises inside the bindings that hold a C++ device guard (copy_, item assignment and
    indexing, new_tensor), caught as a program would catch them."""
    a = torch.zeros(4, device=kind)
    attempts = [
        lambda: a.copy_(torch.ones(3, device=kind)),
        lambda: a.__setitem__(slice(0, 2), torch.ones(3, device=kind)),
        lambda: a.new_tensor([[1.0], [2.0, 3.0]]),
        lambda: a[torch.tensor([5], device=kind)],
    ]
    seen = []
    for attempt in attempts:
        try:
            attempt()
            seen.append("no error")
        except Exception as e:  # noqa: BLE001 - the error itself is the result
            seen.append(f"{type(e).__name__}: {e}")
    return seen


def test_errors_inside_a_device_guard_reach_the_program_as_torch_raised_them(
    capfd: pytest.CaptureFixture,
) -> None:
    gpu = _run(_errors_under_a_device_guard, args=("cuda",))[0]
    cpu = _run(_errors_under_a_device_guard, args=("cpu",))[0]
    assert gpu == cpu
    assert "Exception ignored" not in capfd.readouterr().err


def _pinned() -> tuple[bool, bool]:
    host = torch.ones(2).pin_memory()  # once pinned memory is in use, the CPU build's answer changes
    return torch.ones(2, device="cuda").is_pinned(), host.is_pinned()


def test_gpu_memory_is_not_pinned_host_memory():
    assert _run(_pinned)[0] == (False, True)  # as torch answers on a GPU


def _host_reads():
    x = torch.arange(3.0, device="cuda")
    try:
        x.numpy()
        refused = None
    except HostConversionError as e:
        refused = str(e)
    return refused, x.tolist(), x.numpy(force=True).tolist(), repr(x), f"{x.sum():.1f}", x.sum().item()


def test_host_reads_behave_as_for_a_cuda_tensor():
    refused, values, forced, text, formatted, item = _run(_host_reads)[0]
    assert refused.startswith("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()")
    assert values == forced == [0.0, 1.0, 2.0]
    assert text == "tensor([0., 1., 2.], device='cuda:0')"
    assert formatted == "3.0" and item == 3.0


def _bad_ordinal():
    torch.zeros(1, device="cuda:5")


def test_a_device_the_node_lacks_is_cudas_invalid_ordinal_error():
    with pytest.raises(
        RankError, match="invalid device ordinal: device 5 does not exist; this simulated node has 2"
    ) as info:
        _run(_bad_ordinal)
    assert isinstance(info.value.exc, CudaError) and isinstance(info.value.exc, torch.AcceleratorError)


def _autocast():
    a = torch.randn(4, 8, device="cuda")
    w = torch.randn(8, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return (a @ w).dtype, torch.nn.functional.layer_norm(a, (8,)).dtype, torch.softmax(a, -1).dtype


def test_cuda_autocast_runs_torchs_cuda_policy():
    # torch's CUDA autocast lists: matmuls in the autocast dtype, layer_norm and softmax in float32
    assert _run(_autocast)[0] == (torch.bfloat16, torch.float32, torch.float32)


def _seeded(seed: int | None):
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(4, device="cuda").cpu(), torch.rand(2, device="cuda").cpu()


@settings(max_examples=5)
@given(seed=st.integers(0, 2**32))
def test_torch_manual_seed_seeds_each_ranks_gpus(seed: int):
    seeded = _run(_seeded, kwargs={"seed": seed})
    gen = torch.Generator().manual_seed(seed)
    expected = (torch.randn(4, generator=gen), torch.rand(2, generator=gen))
    for r in range(2):  # a device generator seeded with s draws what a CPU generator seeded with s draws
        assert torch.equal(seeded[r][0], expected[0]) and torch.equal(seeded[r][1], expected[1])


def test_unseeded_gpus_differ_per_rank_and_follow_the_runs_seed():
    first = _run(_seeded, kwargs={"seed": None}, seed=3)
    again = _run(_seeded, kwargs={"seed": None}, seed=3)
    other = _run(_seeded, kwargs={"seed": None}, seed=4)
    assert not torch.equal(first[0][0], first[1][0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not torch.equal(first[0][0], other[0][0])


def _returns():
    return {"w": torch.ones(2, device="cuda"), "list": [torch.zeros(1, device="cuda")], "n": 3}


def test_returned_gpu_tensors_leave_the_run_as_host_tensors():
    out = _run(_returns)[0]
    assert (
        type(out["w"]) is torch.Tensor
        and out["w"].device.type == "cpu"
        and torch.equal(out["w"], torch.ones(2))
    )
    assert type(out["list"][0]) is torch.Tensor and out["n"] == 3


Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    step: int
    weights: dict[str, torch.Tensor]


class Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).cuda()
    model(torch.ones(3, 2, device="cuda")).sum().backward()
    w = model[0].weight
    state = collections.OrderedDict(w=torch.ones(2, device="cuda"))
    return model, Pair(w, w), Snapshot(3, {"w": w}), Holder(w), state


def _gpu_tensors_in(obj, seen=None):
    """Every simulated GPU tensor reachable from ``obj`` through containers, modules and attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(
        obj, (int, str, float, type(None), type, types.ModuleType, types.FunctionType)
    ):
        return []
    seen.add(id(obj))
    if type(obj).__name__ == "SimCudaTensor":
        return [obj]
    if isinstance(obj, torch.Tensor):
        found = _gpu_tensors_in(obj.grad, seen) if obj.is_leaf and obj.grad is not None else []
        if is_traceable_wrapper_subclass(obj):  # DTensor: its local tensor
            found += [
                t for name in obj.__tensor_flatten__()[0] for t in _gpu_tensors_in(getattr(obj, name), seen)
            ]
        return found
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    found = [t for item in items for t in _gpu_tensors_in(item, seen)]
    if hasattr(obj, "__dict__"):
        found += _gpu_tensors_in(vars(obj), seen)
    return found


def test_objects_a_rank_returns_leave_the_run_with_host_tensors():
    """A model, a namedtuple, a dataclass, any object's attributes: nothing on a simulated GPU may outlive the run
    (autograd on one outside it would end the process), and tensors shared inside a return stay shared."""
    model, pair, snapshot, holder, state = _run(_objects)[0]
    assert _gpu_tensors_in([model, pair, snapshot, holder, state]) == []
    weight = model[0].weight
    assert type(weight) is torch.nn.Parameter and weight.grad is not None and weight.grad.device.type == "cpu"
    assert pair.first is pair.second is snapshot.weights["w"] is holder.tensor is weight
    assert (
        isinstance(pair, Pair) and isinstance(snapshot, Snapshot) and type(state) is collections.OrderedDict
    )
    model(torch.ones(3, 2)).sum().backward()  # the returned model trains on the host


def _fsdp2_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(dist.get_rank())
    model = torch.nn.Linear(4, 4).cuda()
    fully_shard(model, mesh=init_device_mesh("cuda", (2,)))
    model(torch.ones(2, 4, device="cuda")).sum().backward()
    return model


def test_a_returned_fsdp2_model_holds_host_tensors():
    """Its parameters are DTensors whose local shards were on the simulated GPUs."""
    model = _run(_fsdp2_model)[0]
    assert _gpu_tensors_in(model) == []
    local = model.weight.to_local()
    assert local.device.type == "cpu" and local.shape == (2, 4)
    assert torch.equal(local * 2, local + local)


def _collective_on_gpu():
    t = torch.full((3,), float(dist.get_rank() + 1), device="cuda")
    work = dist.all_reduce(t, async_op=True)
    result = work.wait() and work.result()[0]
    gathered = [torch.empty(3, device="cuda") for _ in range(2)]
    dist.all_gather(gathered, t)
    return t.cpu(), result is t, [g.device.type for g in gathered], torch.stack([g.cpu() for g in gathered])


def test_collectives_move_gpu_tensors_and_give_back_the_callers_tensors():
    for t, same, kinds, gathered in _run(_collective_on_gpu):
        assert torch.equal(t, torch.full((3,), 3.0)) and same and kinds == ["cuda", "cuda"]
        assert torch.equal(gathered, torch.full((2, 3), 3.0))


def _checkpointed(checkpoint: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)).cuda()
    x = torch.randn(8, 16, device="cuda")
    torch.cuda.manual_seed(1)
    if checkpoint:
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    else:
        out = model(x)
    out.sum().backward()
    return [p.grad.cpu() for p in model.parameters()]


def test_activation_checkpointing_replays_the_gpus_random_numbers():
    # the recomputed forward draws the same dropout mask only if the device generator's state is saved and restored
    plain = _run(_checkpointed, kwargs={"checkpoint": False})[0]
    replayed = _run(_checkpointed, kwargs={"checkpoint": True})[0]
    assert all(torch.equal(a, b) for a, b in zip(plain, replayed))


def _scaled(scaler: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.amp.GradScaler("cuda") if scaler else None
    for _ in range(3):
        loss = model(torch.randn(5, 8, device="cuda")).pow(2).mean()
        if scale is None:
            loss.backward()
            opt.step()
        else:
            scale.scale(loss).backward()
            scale.step(opt)
            scale.update()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()], scale.get_scale() if scale else None


def test_grad_scaler_on_the_gpu_scales_by_a_power_of_two_exactly():
    # scaling by 2**16 and unscaling is exact in float32: the parameters equal an unscaled run's, bit for bit
    plain, _ = _run(_scaled, kwargs={"scaler": False})[0]
    scaled, scale = _run(_scaled, kwargs={"scaler": True})[0]
    assert scale == 65536.0
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled))


def _default_device():
    torch.set_default_device("cuda")
    try:
        made = torch.zeros(2).device, torch.nn.Linear(2, 2).weight.device
    finally:
        torch.set_default_device(None)
    with torch.device("cuda:1"):
        scoped = torch.ones(1).device
    return made, scoped, torch.ones(1).device


def test_default_device_and_device_contexts_place_factories_on_the_gpu():
    made, scoped, after = _run(_default_device)[0]
    assert made == (torch.device("cuda", 0), torch.device("cuda", 0))
    assert scoped == torch.device("cuda", 1) and after == torch.device("cpu")


def _stacked_norms(n: int, with_values: bool):
    """``n`` stacks of two 0-dim replicated DTensors, then of their local tensors: results and device time of each
    (clip_grad_norm_ stacks such norms of an FSDP2 model's gradients)."""
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    torch.cuda.set_device(dist.get_rank())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    local = torch.full((), float(dist.get_rank() + 1), device="cuda")
    norm = DTensor.from_local(local, mesh, [Replicate()])
    seen = []
    for operands in ([norm, norm], [local, local]):
        torch.cuda.synchronize()
        start = simdist.now()
        for _ in range(n):
            out = torch.stack(operands)
        torch.cuda.synchronize()
        values = out.to_local() if isinstance(out, DTensor) else out
        seen.append((simdist.now() - start, values.device, values.is_meta, values.shape))
    return seen, values.cpu() if with_values else None


@pytest.mark.parametrize("tensors", ["real", "fake"])
def test_a_dtensor_op_on_a_list_of_0_dim_dtensors_runs_on_the_gpu_and_takes_its_local_ops_time(tensors: str):
    # the oracle: a replicated DTensor's op is its local tensors' op, on the same device in the same time
    for rank, ((dtensor, plain), values) in enumerate(
        _run(_stacked_norms, args=(5, tensors == "real"), tensors=tensors)
    ):
        assert dtensor[1:] == plain[1:] == (torch.device("cuda", rank), False, torch.Size([2]))
        assert plain[0] > 0 and dtensor[0] == plain[0]
        if tensors == "real":
            assert torch.equal(values, torch.full((2,), float(rank + 1)))


def _with_modes_disabled():
    from torch.utils._python_dispatch import _disable_current_modes

    a = torch.ones(4, device="cuda")
    with _disable_current_modes():  # as library code that steps outside every mode does
        out = [a + a, torch.stack([a, a])]
    return [(t.device, t.is_meta, t.shape) for t in out]


@pytest.mark.parametrize("tensors", ["real", "fake"])
def test_an_op_run_with_modes_disabled_leaves_its_result_on_the_gpu(tensors: str):
    for seen in _run(_with_modes_disabled, tensors=tensors):
        assert seen == [
            (torch.device("cuda", 0), False, torch.Size([4])),
            (torch.device("cuda", 0), False, torch.Size([2, 4])),
        ]
