"""Rank functions run both by simdist and by real gloo processes (tests/test_sim_vs_real.py)."""
# ruff: noqa: B023

from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16", "uint32", "uint64", "float8_e4m3fn", "int32", "int64", "bool", "complex32", "complex64", "complex128"]


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randint(0, 4, (numel,), generator=g).float(), torch.randint(0, 4, (numel,), generator=g).float()).to(dtype)
    return torch.randint(0, 4, (numel,), generator=g).to(dtype)


def _try(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the error type is the result compared with gloo
        return ("error", type(e).__name__)


def collectives_by_dtype(numel: int) -> dict:
    """Every collective on every dtype, with a size not divisible by the world size where it may be."""
    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        # the closures below are called at once, inside this iteration, so binding dt late is intended

        def ar(op):
            t = _data(rank, numel, dt)
            dist.all_reduce(t, op=op)
            return t

        out[(name, "all_reduce_sum")] = _try(lambda: ar(dist.ReduceOp.SUM))
        out[(name, "all_reduce_max")] = _try(lambda: ar(dist.ReduceOp.MAX))
        out[(name, "all_reduce_product")] = _try(lambda: ar(dist.ReduceOp.PRODUCT))

        def bc():
            t = _data(rank, numel, dt)
            dist.broadcast(t, src=n - 1)
            return t

        out[(name, "broadcast")] = _try(bc)

        def ag():
            outs = [torch.zeros(numel, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, _data(rank, numel, dt))
            return torch.stack(outs)

        out[(name, "all_gather")] = _try(ag)

        def red():
            t = _data(rank, numel, dt)
            dist.reduce(t, dst=0)
            return t if rank == 0 else None

        out[(name, "reduce")] = _try(red)
    return out


def non_contiguous() -> dict:
    """Column views and transposes through every collective whose gloo behaviour is defined for them."""
    r, n = dist.get_rank(), dist.get_world_size()

    def base(salt: int = 0) -> torch.Tensor:
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r + 1000 * salt

    out = {}
    m = base()
    dist.all_reduce(m[:, 1])
    out["all_reduce_col"] = m
    m = base().t()
    dist.all_reduce(m)
    out["all_reduce_transposed"] = m
    m = base()
    dist.broadcast(m[:, 1], 0)
    out["broadcast_col"] = m
    outs = [torch.zeros(3, 4)[:, 2] for _ in range(n)]
    dist.all_gather(outs, base()[:, 1])
    out["all_gather_list_in_col"] = outs
    ms = [torch.zeros(3, 4) for _ in range(n)]
    dist.all_gather([mm[:, 2] for mm in ms], torch.arange(3.0) + r)
    out["all_gather_list_out_col"] = ms
    o = torch.zeros(3)
    dist.reduce_scatter(o, [base(j)[:, 1] for j in range(n)])
    out["reduce_scatter_list_in_col"] = o
    mo = torch.zeros(3, 4)
    dist.scatter(mo[:, 2], [torch.arange(3.0) + 10 * j for j in range(n)] if r == 0 else None, src=0)
    out["scatter_out_col"] = mo
    g = [torch.zeros(3) for _ in range(n)] if r == 0 else None
    dist.gather(base()[:, 1], g, dst=0)
    out["gather_in_col"] = g
    return out


def scatter_gather_alltoall(numel: int) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    res = {}
    inp = torch.arange(numel * n, dtype=torch.float32) + 100 * rank
    out = torch.zeros(numel * n)
    dist.all_to_all_single(out, inp)
    res["all_to_all_single"] = out
    o = torch.zeros(numel)
    dist.scatter(o, [torch.full((numel,), float(j)) for j in range(n)] if rank == 1 else None, src=1)
    res["scatter"] = o
    gl = [torch.zeros(numel) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((numel,), float(rank)), gl, dst=0)
    res["gather"] = torch.stack(gl) if gl else None
    rs = torch.zeros(numel)
    dist.reduce_scatter_tensor(rs, torch.arange(numel * n, dtype=torch.float32) * (rank + 1))
    res["reduce_scatter_tensor"] = rs
    agt = torch.zeros(numel * n)
    dist.all_gather_into_tensor(agt, torch.full((numel,), float(rank)))
    res["all_gather_into_tensor"] = agt
    sub = dist.new_group([0, n - 1])
    t = torch.ones(3) * rank
    if rank in (0, n - 1):
        dist.all_reduce(t, group=sub)
    res["subgroup"] = t
    peer = (rank + 1) % n
    recv = torch.zeros(2)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer), dist.P2POp(dist.irecv, recv, (rank - 1) % n)])
    for r in reqs:
        r.wait()
    res["batch_isend_irecv"] = recv
    return res


def _quiet(fn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # simdist warns about every non-contiguous tensor
        return fn()


def everything(numel: int) -> dict:
    """All of the above in one launch (each real launch costs seconds of process start-up)."""
    return {
        "dtypes": collectives_by_dtype(numel),
        "non_contiguous": _quiet(non_contiguous),
        "misc": scatter_gather_alltoall(numel),
    }
