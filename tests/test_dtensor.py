"""DTensor redistribution, FSDP2, HSDP, tensor parallel and FSDP2 x TP in a run, against one process.

Each parallel run trains (or evaluates) the same tiny model as a single-process reference on the full batch;
parameters, gradients and outputs must agree, under both progress modes, at 2 and 4 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing import assert_close

import simdist
from simdist.errors import CollectiveMismatchError

PROGRESS = ("nccl", "gloo")
SIZES = (2, 4)
DIM, HIDDEN, BATCH, STEPS, LR = 8, 16, 8, 2, 0.1

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning"),
    # nn.Linear on a 3-D input returns a view; the model never modifies outputs in place
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning"),
]


def cluster(n: int) -> simdist.Cluster:
    return simdist.Cluster.switch(n, bandwidth="100GB/s", latency="2us", device="cpu")


def run(fn, n: int, progress: str, **kw) -> simdist.RunResult:
    return simdist.run(fn, cluster(n), progress=progress, races="error", **kw)


class MLP(nn.Module):
    """Two linear layers around a layer norm: enough for every tensor-parallel style."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


def model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, DIM, generator=g), torch.randn(BATCH, 4, DIM, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parameters after ``STEPS`` SGD steps on the full batch, and the last step's gradients."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(m(x), y).backward()
        opt.step()
    return {k: p.detach().clone() for k, p in m.named_parameters()}, {
        k: p.grad.clone() for k, p in m.named_parameters()
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(
    m: nn.Module, dp_rank: int, dp_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``STEPS`` SGD steps on this data-parallel rank's share of each batch; full parameters and gradients."""
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    share = BATCH // dp_size
    for step in range(STEPS):
        x, y = batch(step)
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        opt.zero_grad()
        loss_fn(m(x[rows]), y[rows]).backward()
        opt.step()
    return {k: full(p) for k, p in m.named_parameters()}, {k: full(p.grad) for k, p in m.named_parameters()}


def check_training(returns: list, tol: dict | None = None) -> None:
    params, grads = reference()
    tol = tol or {"rtol": 1e-5, "atol": 1e-6}
    for r, (got_p, got_g) in enumerate(returns):
        for k in params:
            assert_close(
                got_p[k], params[k], **tol, msg=lambda m, k=k, r=r: f"parameter {k} on rank {r}: {m}"
            )
            assert_close(got_g[k], grads[k], **tol, msg=lambda m, k=k, r=r: f"gradient {k} on rank {r}: {m}")


# ---------------------------------------------------------------------------------------- redistribution
def _redistribute(device: str = "cpu") -> dict[str, torch.Tensor]:
    n, r = dist.get_world_size(), dist.get_rank()
    if device == "cuda":  # as a GPU program starts: NCCL, which takes device memory only
        dist.destroy_process_group()
        dist.init_process_group("nccl")
        torch.cuda.set_device(r)
    mesh = init_device_mesh(device, (n,))
    t = torch.arange(4.0 * n * 2 * n, device=device).reshape(4 * n, 2 * n)
    s0 = distribute_tensor(t, mesh, [Shard(0)])
    partial = DTensor.from_local(torch.full((2 * n, 3), float(r + 1), device=device), mesh, [Partial()])
    got = {
        "shard_to_replicate": s0.redistribute(mesh, [Replicate()]).to_local(),
        # on a CPU mesh an all-gather and a chunk; on GPUs one all-to-all (torch.ops._dtensor.shard_dim_alltoall)
        "s0_to_s1": s0.redistribute(mesh, [Shard(1)]).to_local(),
        "s1_full_tensor": s0.redistribute(mesh, [Shard(1)]).full_tensor(),
        "partial_to_shard0": partial.redistribute(mesh, [Shard(0)]).to_local(),
        "partial_to_replicate": partial.redistribute(mesh, [Replicate()]).to_local(),
        "full_tensor": s0.full_tensor(),
    }
    return {k: v.cpu() for k, v in got.items()}


@pytest.mark.parametrize(
    ("n", "progress", "device"),
    [*((n, p, "cpu") for n in SIZES for p in PROGRESS), (2, "nccl", "cuda"), (4, "nccl", "cuda")],
)
def test_redistribution_and_full_tensor(n, progress, device):
    if device == "cpu":
        res = run(_redistribute, n, progress)
    else:
        gpus = simdist.Cluster.switch(n, bandwidth="100GB/s", latency="2us", device="H100")
        res = simdist.run(_redistribute, gpus, args=(device,), progress=progress, races="error")
        # a shard-to-shard redistribution on GPUs is one all-to-all of the whole tensor
        assert "nccl:all_to_all_single" in [s.name for s in res.trace.collectives(0)]
    t = torch.arange(4.0 * n * 2 * n).reshape(4 * n, 2 * n)
    total = torch.full((2 * n, 3), n * (n + 1) / 2)
    for r, got in enumerate(res.returns):
        assert_close(got["shard_to_replicate"], t)
        assert_close(got["full_tensor"], t)
        assert_close(got["s1_full_tensor"], t)
        assert_close(got["s0_to_s1"], t[:, 2 * r : 2 * r + 2])
        assert_close(got["partial_to_shard0"], total[2 * r : 2 * r + 2])
        assert_close(got["partial_to_replicate"], total)


# ------------------------------------------------------------------------------------------------ FSDP2
def _fsdp2() -> tuple:
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (n,))
    m = model()
    for layer in (m.w1, m.w2):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return _train(m, r, n)


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_fsdp2_training_equals_one_process(n, progress):
    check_training(run(_fsdp2, n, progress).returns)


def _hsdp() -> tuple:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = model()
    for layer in (m.w1, m.w2):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return _train(m, dist.get_rank(), dist.get_world_size())


@pytest.mark.parametrize("progress", PROGRESS)
def test_hsdp_training_at_four_ranks_equals_one_process(progress):
    check_training(run(_hsdp, 4, progress).returns)


# -------------------------------------------------------------------------------------- tensor parallel
def _tp() -> tuple:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = parallelize_module(model(), mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return _train(m, 0, 1)  # every tensor-parallel rank sees the whole batch


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_tensor_parallel_training_equals_one_process(n, progress):
    check_training(run(_tp, n, progress).returns)


def _sequence_parallel() -> tuple:
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (n,))
    plan = {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    m = parallelize_module(model(), mesh, plan)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    seq = 4 // n
    for step in range(STEPS):
        x, y = batch(step)
        cols = slice(r * seq, (r + 1) * seq)
        opt.zero_grad()
        out = m(x[:, cols])  # this rank's slice of the sequence in, its slice out
        # the full batch's mean squared error, this rank's share of it: gradients sum over the sequence shards
        (((out - y[:, cols]) ** 2).sum() / y.numel()).backward()
        opt.step()
    return {k: full(p) for k, p in m.named_parameters()}, {k: full(p.grad) for k, p in m.named_parameters()}


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("n", SIZES)
def test_sequence_parallel_training_equals_one_process(n, progress):
    check_training(run(_sequence_parallel, n, progress).returns)


def _fsdp2_tp() -> tuple:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = parallelize_module(model(), mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for layer in (m.w1, m.w2):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    return _train(m, mesh["dp"].get_local_rank(), 2)


@pytest.mark.parametrize("progress", PROGRESS)
def test_fsdp2_with_tensor_parallel_on_a_2d_mesh_equals_one_process(progress):
    check_training(run(_fsdp2_tp, 4, progress).returns)


# ---------------------------------------------------------------------------------------- determinism
def test_fsdp2_tp_runs_repeat_exactly():
    a, b = run(_fsdp2_tp, 4, "nccl"), run(_fsdp2_tp, 4, "nccl")
    assert a.sim_time == b.sim_time and a.trace_hash == b.trace_hash
    for (pa, ga), (pb, gb) in zip(a.returns, b.returns):
        for k in pa:
            assert torch.equal(pa[k], pb[k]) and torch.equal(ga[k], gb[k])


_PROCESS_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import warnings
warnings.simplefilter("ignore")
from test_dtensor import _fsdp2_tp, run
res = run(_fsdp2_tp, 4, "gloo")
print(res.trace_hash, repr(res.sim_time))
"""


def test_fsdp2_tp_trace_is_the_same_in_another_process():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", _PROCESS_SCRIPT.format(tests=here)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    res = run(_fsdp2_tp, 4, "gloo")
    assert out.stdout.split() == [res.trace_hash, repr(res.sim_time)]


def _uneven_full_tensor() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = 3 if dist.get_rank() == 0 else 2
    local = torch.ones(rows, 2)
    # run_check=False trusts every rank to hold the same shape; here they do not
    DTensor.from_local(local, mesh, [Shard(0)], run_check=False).full_tensor()


@pytest.mark.parametrize("progress", PROGRESS)
def test_mismatched_dtensor_collective_names_the_users_line(progress):
    with pytest.raises(CollectiveMismatchError) as e:
        run(_uneven_full_tensor, 2, progress)
    text = str(e.value)
    assert "all_gather_into_tensor(shape=(3, 2)" in text and "all_gather_into_tensor(shape=(2, 2)" in text
    assert "test_dtensor.py" in text and "in _uneven_full_tensor" in text, text
