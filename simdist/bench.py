"""``simdist bench``: the nccl-tests table for one collective over a range of sizes on a simulated cluster.

Columns as nccl-tests prints them: size (B), count (elements), type, redop, root, time (us), algbw and busbw
(GB/s), #wrong. busbw = algbw x nccl-tests' factor: all-reduce 2(n-1)/n; reduce-scatter, all-gather,
all-to-all, gather and scatter (n-1)/n; broadcast and reduce 1. Every run carries real data and #wrong counts
the output elements that differ from the expected values. The collectives, their algorithms and reduce ops
are the registry's (:mod:`simdist.algorithms`): each collective's record gives its bus factor, whether it has
a root, a buffer of one chunk per rank or a reduce op, and the memory a row needs; the barrier has no size to
sweep.

Before anything runs the sweep is checked: every rank is a thread carrying real data, so a world above
``MAX_WORLD`` ranks or buffers that do not fit in the memory available are refused with a :class:`BenchError`
that says what would fit. Rows are handed to ``on_row`` as they finish, as nccl-tests prints them.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from simdist import algorithms
from simdist.algorithms import Reduction
from simdist.engine.runner import run
from simdist.errors import SimdistError
from simdist.network.cluster import Cluster
from simdist.network.graph import validate_algorithms
from simdist.units import format_size
from simdist_base.host import available_memory

#: what the bench sweeps: every collective of the registry with a buffer (all but the barrier)
COLLECTIVES = tuple(c.name for c in algorithms.COLLECTIVE_RECORDS if c.memory_factor is not None)
DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
#: the reduce ops the bench offers, by their nccl-tests names
REDOPS: dict[str, Reduction] = {r.bench_name: r for r in algorithms.REDUCE_OPS if r.bench_name is not None}
#: the largest world the bench simulates: one row (one collective call) takes about 12 s of wall time at
#: 4096 ranks and about a minute at 8192 on one core of a 2024 server, growing faster than the world
MAX_WORLD = 4096


class BenchError(SimdistError, ValueError):
    """A bench sweep cannot run: an unknown collective, type or op, a bad size range or root, too big a world."""


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


def _rank_value(rank: int, dtype: torch.dtype, op: Reduction) -> float:
    """Each rank's input value: small, so sums stay exact in half precision and products never overflow."""
    if op.torch_op == dist.ReduceOp.PRODUCT:
        return 2.0 if rank == 0 else 1.0
    return float(rank % 3 + 1)


def _bench_rank(collective: str, count: int, dtype: torch.dtype, op_name: str, root: int) -> int:
    """Rank code: run the collective once on known data; return the number of wrong output elements."""
    n, rank = dist.get_world_size(), dist.get_rank()
    reduction = REDOPS[op_name]
    vals = [_rank_value(r, dtype, reduction) for r in range(n)]
    op = reduction.torch_op
    red = functools.partial(functools.reduce, reduction.scalar)  # the expected reduction of the ranks' values
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


def _whole(value: object, what: str, least: int) -> int:
    """``value`` as an int after checking it is a whole number >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise BenchError(f"{what} must be a whole number >= {least}; found {value!r}")
    return int(value)


def row_counts(collective: str, n: int, min_bytes: int, max_bytes: int, step_factor: int, itemsize: int) -> list[int]:
    """The element count of each row: sizes from ``min_bytes`` by ``step_factor`` up to ``max_bytes``."""
    counts = []
    size = min_bytes
    while size <= max_bytes:
        count = max(1, size // itemsize)
        if algorithms.collective(collective).chunked:
            count = max(n, count - count % n)  # n equal chunks, at least one element each
        counts.append(count)
        size *= step_factor
    return counts


def check_memory(collective: str, n: int, count: int, itemsize: int, available: int | None) -> None:
    """Raise BenchError when ``n`` ranks of ``count`` elements each would not fit in ``available`` bytes."""
    if available is None:
        return
    per_rank = count * itemsize
    factor = algorithms.collective(collective).memory_factor
    if factor is None:
        raise BenchError(f"{collective} has no buffer for the bench to size; choose one of {', '.join(COLLECTIVES)}")
    needed = factor * per_rank * n
    if needed > available:
        fits = available // (factor * n)
        raise BenchError(
            f"the largest row needs about {format_size(needed)} ({n} ranks x {format_size(per_rank)} buffers x "
            f"{factor} for inputs, outputs and messages of {collective}) but only "
            f"{format_size(available)} of memory is available; use a largest size (-e/--maxbytes, max_bytes) of at "
            f"most {format_size(fits)} or fewer ranks"
        )


def plan(
    cluster: Cluster,
    collective: str = "all_reduce",
    min_bytes: int = 8,
    max_bytes: int = 64 << 20,
    step_factor: int = 2,
    dtype: str = "float",
    redop: str = "sum",
    root: int = 0,
    algorithm: str = algorithms.AUTO,
    max_world: int = MAX_WORLD,
) -> list[int]:
    """Check a sweep's arguments against the cluster and the memory available; return each row's element count.

    Raises BenchError naming the argument (and its command-line option) and what was expected, or
    ClusterSpecError for an algorithm the collective lacks.
    """
    if not isinstance(collective, str) or collective not in COLLECTIVES:
        raise BenchError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BenchError(f"unknown type {dtype!r}; choose one of {', '.join(sorted(DTYPES))}")
    if not isinstance(redop, str) or redop not in REDOPS:
        raise BenchError(f"unknown redop {redop!r}; choose one of {', '.join(sorted(REDOPS))}")
    min_bytes = _whole(min_bytes, "min_bytes (-b, the smallest size)", 1)
    max_bytes = _whole(max_bytes, "max_bytes (-e, the largest size)", 1)
    step_factor = _whole(step_factor, "step_factor (-f, the factor between sizes)", 2)
    if max_bytes < min_bytes:
        raise BenchError(
            f"max_bytes (-e) {max_bytes} is below min_bytes (-b) {min_bytes}; the sweep goes from the smallest "
            f"size up to the largest"
        )
    n = cluster.world_size
    if isinstance(root, bool) or not isinstance(root, numbers.Integral) or not 0 <= root < n:
        raise BenchError(f"root (-r) {root!r} is not a rank of this {n}-rank cluster; expected 0..{n - 1}")
    if n > max_world:
        raise BenchError(too_many_ranks(n, max_world))
    if algorithm != algorithms.AUTO:
        validate_algorithms({collective: algorithm})
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    counts = row_counts(collective, n, min_bytes, max_bytes, step_factor, itemsize)
    check_memory(collective, n, max(counts), itemsize, available_memory())
    return counts


def too_many_ranks(n: int, max_world: int = MAX_WORLD) -> str:
    """Why a world of ``n`` ranks is refused, and what to do instead."""
    return (
        f"a world of {n} ranks is more than simdist bench simulates ({max_world}): each rank is a thread carrying "
        f"real data and one row takes about a minute at 8192 ranks, growing faster than the world; bench "
        f"{max_world} ranks or fewer, or price larger worlds with simdist.algorithms.estimate"
    )


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
    *,
    on_row: Callable[[Row], None] | None = None,
    max_world: int = MAX_WORLD,
) -> list[Row]:
    """Simulate ``collective`` at every size from ``min_bytes`` to ``max_bytes`` (x ``step_factor``), with
    ``algorithm`` (a registry name, or ``"auto"`` for the cluster's choice); ``on_row`` sees each row as it
    finishes. The sweep is checked by :func:`plan` first: nothing runs unless all of it can."""
    counts = plan(cluster, collective, min_bytes, max_bytes, step_factor, dtype, redop, root, algorithm, max_world)
    saved = cluster.algorithms
    if algorithm != algorithms.AUTO:
        cluster.algorithms = validate_algorithms({**cluster.algorithms, collective: algorithm})
    try:
        return [_row(cluster, collective, count, dtype, redop, root, on_row) for count in counts]
    finally:
        cluster.algorithms = saved  # the caller's cluster keeps its own choice


def _row(
    cluster: Cluster, collective: str, count: int, dtype: str, redop: str, root: int, on_row: Callable[[Row], None] | None
) -> Row:
    """Run one row: ``count`` elements per rank."""
    n = cluster.world_size
    tdt = DTYPES[dtype]
    res = run(_bench_rank, cluster, args=(collective, count, tdt, redop, root), trace="collectives", compute=False)
    spans = res.trace.collectives()
    t = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
    nbytes = count * torch.empty((), dtype=tdt).element_size()
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    record = algorithms.collective(collective)
    row = Row(
        size=nbytes,
        count=count,
        dtype=dtype,
        redop=redop if record.reduces else "none",
        root=root if record.rooted else -1,
        time_us=t * 1e6,
        algbw=algbw,
        busbw=algbw * record.bus_factor(n),
        wrong=sum(res.returns),
        algorithm=_algorithm(spans[0].args) if spans else "",
    )
    if on_row is not None:
        on_row(row)
    return row


def _algorithm(args: dict[str, Any]) -> str:
    """A row's algorithm: NCCL's algorithm and protocol where NCCL's model timed it, else simdist's algorithm."""
    return str(args.get("nccl") or args.get("algorithm", ""))


def table_header(collective: str, cluster: Cluster) -> str:
    """The lines above the rows, naming the cluster."""
    return "\n".join(
        [
            f"# simdist bench: {collective} on {cluster.name} ({cluster.world_size} ranks, simulated)",
            f"# {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>7}  algorithm",
            f"# {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}",
        ]
    )


def table_row(r: Row) -> str:
    """One row as nccl-tests prints it."""
    return (
        f"  {r.size:>12} {r.count:>12} {r.dtype:>8} {r.redop:>6} {r.root:>5} {r.time_us:>10.2f} "
        f"{r.algbw:>7.2f} {r.busbw:>7.2f} {r.wrong:>7}  {r.algorithm}"
    )


def table_footer(rows: list[Row]) -> str:
    """The summary lines below the rows: wrong values and the average bus bandwidth."""
    total_wrong = sum(r.wrong for r in rows)
    avg = sum(r.busbw for r in rows) / len(rows) if rows else 0.0
    return (
        f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}\n"
        f"# Avg bus bandwidth    : {avg:.4g}"
    )


def format_table(rows: list[Row], collective: str, cluster: Cluster) -> str:
    """The rows as nccl-tests prints them, with a header naming the cluster."""
    return "\n".join([table_header(collective, cluster), *map(table_row, rows), table_footer(rows)])
