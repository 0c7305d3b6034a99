"""``simdist bench``: the nccl-tests table for one collective over a range of sizes on a simulated cluster.

Columns as nccl-tests prints them: size (B), count (elements), type, redop, root, time (us), algbw and busbw
(GB/s), #wrong. busbw = algbw x factor: all-reduce 2(n-1)/n; reduce-scatter, all-gather, all-to-all, gather
and scatter (n-1)/n; broadcast and reduce 1. Every run carries real data and #wrong counts the output
elements that differ from the expected values. The collectives and their algorithms are the registry's
(:mod:`simdist.algorithms`); the barrier has no size to sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from simdist import algorithms
from simdist.engine.runner import run
from simdist.network.cluster import Cluster
from simdist.network.graph import validate_algorithms

#: what the bench sweeps: every collective of the registry except the barrier
COLLECTIVES = tuple(c for c in algorithms.COLLECTIVES if c != "barrier")
DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
REDOPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


@dataclass
class Row:
    """One line of the table."""

    size: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int
    algorithm: str


def _rank_value(rank: int, dtype: torch.dtype, op: str) -> float:
    """Each rank's input value: small, so sums stay exact in half precision and products never overflow."""
    if op == "prod":
        return 2.0 if rank == 0 else 1.0
    return float(rank % 3 + 1)


def _bench_rank(collective: str, count: int, dtype: torch.dtype, op_name: str, root: int) -> int:
    """Rank code: run the collective once on known data; return the number of wrong output elements."""
    n, rank = dist.get_world_size(), dist.get_rank()
    vals = [_rank_value(r, dtype, op_name) for r in range(n)]
    op = REDOPS[op_name]
    red = {"sum": sum, "prod": _prod, "min": min, "max": max}[op_name]
    if collective in ("all_reduce", "reduce", "broadcast"):
        t = torch.full((count,), vals[rank], dtype=dtype)
        if collective == "all_reduce":
            dist.all_reduce(t, op=op)
            want = torch.full_like(t, red(vals))
        elif collective == "reduce":
            dist.reduce(t, dst=root, op=op)
            want = torch.full_like(t, red(vals) if rank == root else vals[rank])
        else:
            dist.broadcast(t, src=root)
            want = torch.full_like(t, vals[root])
        return int((t != want).sum())
    chunk = count // n
    if collective == "gather":
        out = [torch.zeros(chunk, dtype=dtype) for _ in range(n)] if rank == root else None
        dist.gather(torch.full((chunk,), vals[rank], dtype=dtype), out, dst=root)
        if out is None:
            return 0
        return int((torch.cat(out) != torch.cat([torch.full((chunk,), v, dtype=dtype) for v in vals])).sum())
    if collective == "scatter":
        out = torch.zeros(chunk, dtype=dtype)
        parts = [torch.full((chunk,), vals[j], dtype=dtype) for j in range(n)] if rank == root else None
        dist.scatter(out, parts, src=root)
        return int((out != vals[rank]).sum())
    if collective == "all_gather":
        out = torch.zeros(chunk * n, dtype=dtype)
        _all_gather_single(out, torch.full((chunk,), vals[rank], dtype=dtype))
        want = torch.cat([torch.full((chunk,), v, dtype=dtype) for v in vals])
        return int((out != want).sum())
    if collective == "reduce_scatter":
        out = torch.zeros(chunk, dtype=dtype)
        _reduce_scatter_single(out, torch.full((chunk * n,), vals[rank], dtype=dtype), op=op)
        return int((out != red(vals)).sum())
    inp = torch.cat([torch.full((chunk,), rank * n + j, dtype=dtype) for j in range(n)])
    out = torch.zeros(chunk * n, dtype=dtype)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.full((chunk,), j * n + rank, dtype=dtype) for j in range(n)])
    return int((out != want).sum())


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _prod(xs: list[float]) -> float:
    out = 1.0
    for x in xs:
        out *= x
    return out


def bench(
    cluster: Cluster,
    collective: str = "all_reduce",
    min_bytes: int = 8,
    max_bytes: int = 64 << 20,
    step_factor: int = 2,
    dtype: str = "float",
    redop: str = "sum",
    root: int = 0,
    algorithm: str = algorithms.AUTO,
) -> list[Row]:
    """Simulate ``collective`` at every size from ``min_bytes`` to ``max_bytes`` (x ``step_factor``), with
    ``algorithm`` (a registry name, or ``"auto"`` for the cluster's choice)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if algorithm != algorithms.AUTO:
        cluster.algorithms = validate_algorithms({**cluster.algorithms, collective: algorithm})
    if dtype not in DTYPES:
        raise ValueError(f"unknown type {dtype!r}; choose one of {sorted(DTYPES)}")
    if redop not in REDOPS:
        raise ValueError(f"unknown redop {redop!r}; choose one of {sorted(REDOPS)}")
    if step_factor < 2 or min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError("need 1 <= min_bytes <= max_bytes and step_factor >= 2")
    n = cluster.world_size
    if not 0 <= root < n:
        raise ValueError(f"root {root} is not a rank of this {n}-rank cluster")
    tdt = DTYPES[dtype]
    itemsize = torch.empty((), dtype=tdt).element_size()
    rows = []
    size = min_bytes
    while size <= max_bytes:
        count = max(1, size // itemsize)
        if collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
            count = max(n, count - count % n)
        res = run(_bench_rank, cluster, args=(collective, count, tdt, redop, root), trace="collectives", compute=False)
        spans = res.trace.collectives()
        t = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
        nbytes = count * itemsize
        algbw = nbytes / t / 1e9 if t > 0 else 0.0
        shows_op = collective in ("all_reduce", "reduce", "reduce_scatter")
        rows.append(
            Row(
                size=nbytes,
                count=count,
                dtype=dtype,
                redop=redop if shows_op else "none",
                root=root if collective in ("broadcast", "reduce", "gather", "scatter") else -1,
                time_us=t * 1e6,
                algbw=algbw,
                busbw=algbw * bus_factor(collective, n),
                wrong=sum(res.returns),
                algorithm=spans[0].args.get("algorithm", "") if spans else "",
            )
        )
        size *= step_factor
    return rows


def format_table(rows: list[Row], collective: str, cluster: Cluster) -> str:
    """The rows as nccl-tests prints them, with a header naming the cluster."""
    lines = [
        f"# simdist bench: {collective} on {cluster.name} ({cluster.world_size} ranks, simulated)",
        f"# {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}  algorithm",
        f"# {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}",
    ]
    for r in rows:
        lines.append(
            f"  {r.size:>12} {r.count:>12} {r.dtype:>8} {r.redop:>6} {r.root:>5} {r.time_us:>10.2f} "
            f"{r.algbw:>7.2f} {r.busbw:>7.2f} {r.wrong:>7}  {r.algorithm}"
        )
    total_wrong = sum(r.wrong for r in rows)
    avg = sum(r.busbw for r in rows) / len(rows) if rows else 0.0
    lines.append(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg:.4g}")
    return "\n".join(lines)
