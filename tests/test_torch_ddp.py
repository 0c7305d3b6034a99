"""torch's own DistributedDataParallel (C++ reducer) under the simulator, against the single-process model."""

from __future__ import annotations

import pytest
import real_fns
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import real
import simdist
from simdist.options import BACKEND_NAMES


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def shard(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))


def ddp_grads(bucket_cap_mb: float):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    ddp(shard(dist.get_rank())).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005])
def test_torch_ddp_matches_single_process(n, bucket_cap_mb):
    res = simdist.run(ddp_grads, simdist.Cluster.switch(n, device="H100"), args=(bucket_cap_mb,))
    model = make_model()
    model(torch.cat([shard(r) for r in range(n)])).pow(2).mean().backward()
    for r in range(n):
        for got, want in zip(res.returns[r], (p.grad for p in model.parameters())):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the reducer's bucket all-reduces really ran on the simulated network
    assert any(s.name == "nccl:all_reduce" for s in res.trace.collectives(0))


def ddp_train(static_graph: bool, progress_hook: bool):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.0001, static_graph=static_graph)
    if progress_hook:  # a user-written comm hook: a callback chained to the future, waited on by C++
        def hook(state, bucket):
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / dist.get_world_size())

        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        ddp(shard(dist.get_rank() + 10 * step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("progress", ["nccl", "gloo"])
def test_static_graph_and_custom_comm_hooks_train_like_the_default(progress):
    cluster = simdist.Cluster.switch(2, device="cpu")
    ref = simdist.run(ddp_train, cluster, args=(False, False), progress=progress).returns
    for args in ((True, False), (False, True)):
        got = simdist.run(ddp_train, cluster, args=args, progress=progress, races="error").returns
        for a, b in zip(got[0], ref[0]):
            torch.testing.assert_close(a, b)


def _single_process_step_grads(n: int, steps: int = 3) -> list:
    """The oracle for powersgd_grads: one model, the n ranks' batches averaged, per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    out = []
    for step in range(steps):
        model.zero_grad()
        for r in range(n):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + r))
            (model(x).pow(2).mean() / n).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("progress", ["nccl", "gloo"])
def test_torch_powersgd_hook_matches_single_process(n, progress):
    """torch's PowerSGD hook issues and waits on collectives inside then() callbacks; at full rank it is exact."""
    res = simdist.run(real_fns.powersgd_grads, simdist.Cluster.switch(n), progress=progress)
    want = _single_process_step_grads(n)
    for r in range(n):
        for step, (got_step, want_step) in enumerate(zip(res.returns[r], want)):
            for got, w in zip(got_step, want_step):
                torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5, msg=f"rank {r} step {step}")
    # after start_powerSGD_iter, the hook's compressed all-reduces ran (more than one per step)
    assert len(res.trace.collectives(0)) > 6


@pytest.mark.real
def test_torch_powersgd_hook_matches_real_gloo():
    """The same PowerSGD program on real gloo processes gives the simulated gradients."""
    sim = simdist.run(real_fns.powersgd_grads, simdist.Cluster.switch(2))
    real_res = real.run(real_fns.powersgd_grads, nproc=2, backend="gloo")
    for r in range(2):
        for got_step, want_step in zip(sim.returns[r], real_res.returns[r]):
            for got, w in zip(got_step, want_step):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def _fsdp2_grads() -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(shard(dist.get_rank())).pow(2).mean().backward()
    return model[0].weight.grad.full_tensor()


def _mesh_sums() -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=mesh["tp"].get_group())
    u = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(u, group=mesh["dp"].get_group())
    return [t.item(), u.item()]


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_every_presented_backend_name_runs_torch_ddp_fsdp2_and_device_mesh(name: str) -> None:
    """Code written for a cluster of that backend runs unchanged: torch's DDP (whose C++ logger reads a group
    named "gloo" as ProcessGroupGloo), FSDP2 and DeviceMesh give the single-process answers. CPU code: on a cluster
    of CPUs, where a group named "nccl" takes CPU tensors (on GPUs it refuses them, as NCCL does)."""
    cpus = simdist.Cluster.ring(4, device="cpu")
    model = make_model()
    model(torch.cat([shard(r) for r in range(4)])).pow(2).mean().backward()
    want = [p.grad for p in model.parameters()]
    ddp = simdist.run(ddp_grads, cpus, args=(25.0,), backend_name=name).returns
    for grads in ddp:
        for got, w in zip(grads, want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    fsdp = simdist.run(_fsdp2_grads, cpus, backend_name=name).returns
    for got in fsdp:
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)
    mesh = simdist.run(_mesh_sums, cpus, backend_name=name).returns
    assert mesh == [[1.0, 2.0], [1.0, 4.0], [5.0, 2.0], [5.0, 4.0]]
