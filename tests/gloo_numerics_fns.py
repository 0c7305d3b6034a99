"""Rank functions whose reductions depend on the order of their additions, run by simdist and by real gloo
processes (tests/test_gloo_numerics.py), with the inputs each rank draws."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

#: the reducing collectives, as the cases name them
COLLECTIVES = (
    "all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_reduce_coalesced",
    "reduce_scatter_tensor_coalesced",
)  # fmt: skip
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}  # fmt: skip
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "complex64": torch.complex64}  # fmt: skip


def values(seed: int, rank: int, numel: int, dtype: str, op: str) -> torch.Tensor:
    """Rank ``rank``'s input: magnitudes spread over decades, so that every order of the additions rounds
    differently; near 1 for PRODUCT (no overflow); with NaNs and signed zeros for MIN and MAX."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    t = DTYPES[dtype]
    if t.is_complex:
        x = torch.randn(numel, 2, generator=g, dtype=torch.float64)
        x = x * torch.pow(10.0, torch.randint(-3, 3, (numel, 1), generator=g).double())
        return torch.view_as_complex(x.float().contiguous())
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    if op == "product":
        return (1 + x / 8).to(t)
    low, high = (-2, 2) if t == torch.float16 else (-4, 4)
    x = x * torch.pow(10.0, torch.randint(low, high, (numel,), generator=g).double())
    if op in ("min", "max"):
        kind = torch.randint(0, 8, (numel,), generator=g)
        x = torch.where(kind == 0, float("nan"), x)
        x = torch.where(kind == 1, -0.0, torch.where(kind == 2, 0.0, x))
    return x.to(t)


def inputs(case: tuple, rank: int, n: int) -> list[torch.Tensor]:
    """The tensors rank ``rank`` of ``n`` passes in ``case`` = (collective, dtype, numel, op, seed)."""
    coll, dtype, numel, op, seed = case
    if coll in ("all_reduce", "reduce"):
        return [values(seed, rank, numel, dtype, op)]
    if coll in ("reduce_scatter_tensor", "reduce_scatter"):
        return [values(seed, rank, numel * n, dtype, op)]
    second = numel // 2 + 1
    if coll == "all_reduce_coalesced":
        return [values(seed, rank, numel, dtype, op), values(seed + 1, rank, second, dtype, op)]
    return [values(seed, rank, numel * n, dtype, op), values(seed + 1, rank, second * n, dtype, op)]


def reductions(cases: list[tuple], group: dist.ProcessGroup | None = None) -> list:
    """Run every case on ``group`` (the default group: the world); return what each leaves this rank (the
    reduce's root: its tensor; others: None)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for case in cases:
        coll, op = case[0], OPS[case[3]]
        ts = inputs(case, rank, n)
        if coll == "all_reduce":
            dist.all_reduce(ts[0], op=op, group=group)
            out.append(ts[0])
        elif coll == "reduce":
            root = case[4] % n
            dist.reduce(ts[0], op=op, group=group, group_dst=root)
            out.append(ts[0] if rank == root else None)
        elif coll == "reduce_scatter_tensor":
            o = torch.empty(ts[0].numel() // n, dtype=ts[0].dtype)
            dist.reduce_scatter_tensor(o, ts[0], op=op, group=group)
            out.append(o)
        elif coll == "reduce_scatter":
            o = torch.empty(ts[0].numel() // n, dtype=ts[0].dtype)
            dist.reduce_scatter(o, list(ts[0].chunk(n)), op=op, group=group)
            out.append(o)
        elif coll == "all_reduce_coalesced":
            dist.all_reduce_coalesced(ts, op=op, group=group)
            out.append(ts)
        else:
            outs = [torch.empty(t.numel() // n, dtype=t.dtype) for t in ts]
            with _coalescing_manager(group=group, async_ops=False):
                for o, t in zip(outs, ts):
                    dist.reduce_scatter_tensor(o, t, op=op, group=group)
            out.append(outs)
    return out


def sparse_values(seed: int, rank: int) -> torch.Tensor:
    """An uncoalesced sparse COO vector of 12 elements, 40 nonzeros with repeated indices."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    idx = torch.randint(0, 12, (1, 40), generator=g)
    val = torch.randn(40, generator=g) * torch.pow(10.0, torch.randint(-3, 3, (40,), generator=g).float())
    return torch.sparse_coo_tensor(idx, val, (12,), check_invariants=True)


def sparse_sums(seeds: list[int], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """The sparse all-reduce (SUM) on ``group`` of each seed's vectors, as dense tensors."""
    out = []
    for seed in seeds:
        t = sparse_values(seed, dist.get_rank(group))
        dist.all_reduce(t, group=group)
        out.append(t.to_dense())
    return out


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 10),
    )


class _TwoMLPs(torch.nn.Module):
    """Two column-then-row parallel pairs of linear layers, as tensor parallelism splits them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
        self.up2, self.down2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(torch.relu(self.up(x)))
        return self.down2(torch.relu(self.up2(x)))


def _wrap(wrap: str) -> tuple[torch.nn.Module, int]:
    """The model under ``wrap`` (torch's DDP, FSDP2, or FSDP2 over TP on a 2 x 4 mesh) and the index of this
    rank's batches (its data-parallel rank)."""
    from torch.distributed.fsdp import fully_shard

    if wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(_mlp()), dist.get_rank()
    if wrap == "fsdp2":
        model = _mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model), dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = {
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "up2": ColwiseParallel(),
        "down2": RowwiseParallel(),
    }
    model = parallelize_module(_TwoMLPs(), mesh["tp"], tp)
    return fully_shard(model, mesh=mesh["dp"]), mesh["dp"].get_local_rank()


def _train(wrap: str) -> dict[str, torch.Tensor]:
    """Three SGD steps (float32, each data-parallel rank its own batches) of a model under ``wrap``; the full
    parameters afterwards."""
    model, data_rank = _wrap(wrap)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + data_rank)
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = inner.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()
    }


def training() -> dict[str, dict[str, torch.Tensor]]:
    """The parameters torch's DDP, FSDP2 and FSDP2 over TP train on 8 ranks (gradients averaged by all-reduce
    and reduce-scatter, tensor-parallel activations summed by all-reduce)."""
    return {wrap: _train(wrap) for wrap in ("ddp", "fsdp2", "fsdp2_tp")}


def on_groups(cases: dict[int, list[tuple]], seeds: list[int], train: bool = True) -> dict[int, tuple]:
    """For each size n of ``cases``, on a group of the world's first n ranks: its reductions, the sparse sums of
    ``seeds`` and, on the whole world, ``training()`` when ``train``; this rank's results by group size, for the
    groups it is in.

    One launch checks several world sizes: ProcessGroupGloo runs a group's collectives as a world's of its size
    (the same algorithms on a gloo context of the group's ranks), and the groups run one after the other."""
    world, out = dist.get_world_size(), {}
    for n in sorted(cases):
        group = None if n == world else dist.new_group(list(range(n)))  # every rank creates every group
        if dist.get_rank() < n:
            out[n] = (
                reductions(cases[n], group),
                sparse_sums(seeds, group),
                training() if train and n == world else None,
            )
    return out
