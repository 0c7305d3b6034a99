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


def _raises(fn):
    """``("ok", value)``, or ``("raised", names of the exception's classes, message)``: a simulated error must be
    an instance of the class real gloo raises (it may be a subclass, such as a SimdistError)."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the error type is the result compared with gloo
        return ("raised", [c.__name__ for c in type(e).__mro__], str(e).split("\n")[0])


def _all_gather_coalesced(n: int, rank: int) -> list:
    outs = [[torch.zeros(2), torch.zeros(1)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.ones(1) * rank])
    return outs


def gloo_parity() -> dict:
    """Odd inputs every rank passes alike: gloo rejects them on every rank (so the next one still runs), or
    computes them (sparse all-reduce, bitwise ops on integers, monitored_barrier)."""
    import datetime

    n, rank = dist.get_world_size(), dist.get_rank()
    R = dist.ReduceOp
    out = {}

    def ar(t, op=R.SUM):
        dist.all_reduce(t, op=op)
        return t

    cases = {
        "broadcast_src_outside": lambda: dist.broadcast(torch.ones(3), src=n + 5),
        "broadcast_src_negative": lambda: dist.broadcast(torch.ones(3), src=-1),
        "reduce_dst_outside": lambda: dist.reduce(torch.ones(3), dst=n),
        "gather_dst_outside": lambda: dist.gather(torch.ones(3), None, dst=n + 1),
        "scatter_src_outside": lambda: dist.scatter(torch.ones(3), None, src=n + 1),
        "avg_int64": lambda: ar(torch.arange(3) + rank, R.AVG),
        "avg_uint8_reduce": lambda: dist.reduce(torch.ones(3, dtype=torch.uint8), 0, op=R.AVG),
        "avg_int32_reduce_scatter": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=torch.int32), torch.ones(2 * n, dtype=torch.int32), op=R.AVG),
        "band_float32": lambda: ar(torch.ones(3), R.BAND),
        "bxor_bfloat16": lambda: ar(torch.ones(3, dtype=torch.bfloat16), R.BXOR),
        "bor_float_reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * n), op=R.BOR),
        "premul_sum": lambda: ar(torch.ones(3), dist._make_nccl_premul_sum(2.0)),
        "band_int64": lambda: ar(torch.tensor([3, 5, 7]) + rank, R.BAND),
        "bor_bool": lambda: ar(torch.tensor([True, False, rank == 0]), R.BOR),
        "send_to_self": lambda: dist.send(torch.ones(2), rank),
        "recv_from_self": lambda: dist.recv(torch.ones(2), rank),
        "negative_tag": lambda: dist.send(torch.ones(2), (rank + 1) % n, tag=-5),
        "all_gather_short_list": lambda: dist.all_gather([torch.ones(2)], torch.ones(2)),
        "all_gather_wrong_size": lambda: dist.all_gather([torch.ones(3)] * n, torch.ones(2)),
        "all_gather_into_tensor_wrong_size": lambda: dist.all_gather_into_tensor(torch.zeros(2 * n + 1), torch.ones(2)),
        "all_gather_coalesced": lambda: _all_gather_coalesced(n, rank),
        "all_gather_coalesced_wrong_lists": lambda: dist.all_gather_coalesced([[torch.zeros(2)]], [torch.ones(2)]),
        "reduce_scatter_short_list": lambda: dist.reduce_scatter(torch.zeros(2), [torch.ones(2)]),
        "reduce_scatter_tensor_wrong_size": lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * n + 1)),
        "all_to_all_single_bad_split_sum": lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), [1] * n, [2] * n),
        "all_to_all_single_split_count": lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), [2 * n], [2 * n]),
        "all_to_all_short_list": lambda: dist.all_to_all([torch.zeros(2)], [torch.ones(2)]),
        "sparse_all_reduce_max": lambda: ar(torch.eye(2).to_sparse(), R.MAX),
        "empty_all_reduce": lambda: ar(torch.ones(0)),
    }
    for name, fn in cases.items():
        out[name] = _raises(fn)

    def sparse():
        t = torch.sparse_coo_tensor([[rank, 2, 2]], [1.0, 2.0, 3.0], (n + 3,))  # uncoalesced: index 2 twice
        dist.all_reduce(t)
        return t.layout == torch.sparse_coo, t.is_coalesced(), t.to_dense()

    out["sparse_all_reduce_sum"] = _raises(sparse)
    out["sparse_all_reduce_2d"] = _raises(lambda: ar(torch.sparse_coo_tensor([[rank, 1], [0, 2]], [1.0, 2.0], (n, 3))).to_dense())
    out["monitored_barrier"] = _raises(lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=30)))
    out["monitored_barrier_wait_all"] = _raises(
        lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True))
    out["backend"] = (str(dist.get_backend()), dist.get_backend_config(), dist.group.WORLD._get_backend_name())
    if n == 2:  # last: rank 1 never arrives, rank 0 names it after the timeout (no other rank waits for rank 0)
        out["monitored_barrier_missing"] = (
            _raises(lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=1))) if rank == 0 else ("skipped",)
        )
    return out


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
        "gloo": _quiet(gloo_parity),
    }
