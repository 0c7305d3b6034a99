"""Collectives timed over a sweep of sizes on real processes: ``python -m real.sweep`` prints one JSON object.

``simdist calibrate --measure`` runs it in a child process and fits a cluster to what it prints:
``{"ranks": N, "rows": [[collective, bytes, seconds], ...]}``, ``bytes`` being the whole buffer (the
all-gather output, the reduce-scatter input) and ``seconds`` the lower quartile over the timed calls of the
slowest rank's time per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from real.launcher import run

#: the collectives it can time
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _call(collective: str, buf: torch.Tensor, other: torch.Tensor) -> None:
    if collective == "all_reduce":
        dist.all_reduce(buf)
    elif collective == "all_gather":
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(
            other, buf
        )  # the older name warns in 2.13
    elif collective == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(other, buf)
    else:
        dist.broadcast(buf, 0)


def _buffers(collective: str, size: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of a call of ``size`` bytes, float32; the output only for all-gather and reduce-scatter."""
    numel = max(1, size // 4)
    chunk = -(-numel // n)
    if collective == "all_gather":
        return torch.ones(chunk), torch.ones(chunk * n)
    if collective == "reduce_scatter":
        return torch.ones(chunk * n), torch.ones(chunk)
    return torch.ones(numel), torch.empty(0)


def nbytes(collective: str, size: int, n: int) -> int:
    """The whole buffer a call of ``size`` bytes moves once rounded to whole float32 chunks."""
    numel = max(1, size // 4)
    return 4 * (-(-numel // n) * n if collective in ("all_gather", "reduce_scatter") else numel)


def sweep_rank(
    collectives: Sequence[str], sizes: Sequence[int], iters: int, warmup: int
) -> list[list[float]]:
    """One rank's seconds of every timed call per (collective, size), in that order; each call after a barrier."""
    n = dist.get_world_size()
    out = []
    for collective in collectives:
        # gloo makes its connections and buffers at an op's first calls: keep them out of the smallest size's time
        for _ in range(warmup):
            dist.barrier()
            _call(collective, *_buffers(collective, sizes[0], n))
        for size in sizes:
            buf, other = _buffers(collective, size, n)
            times = []
            for i in range(warmup + iters):
                dist.barrier()
                t0 = time.perf_counter()
                _call(collective, buf, other)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            out.append(times)
    return out


def sweep(
    ranks: int,
    collectives: Sequence[str],
    sizes: Sequence[int],
    iters: int = 15,
    warmup: int = 3,
    backend: str = "gloo",
) -> list[tuple[str, int, float]]:
    """(collective, bytes, seconds) per collective and size, timed on ``ranks`` real processes."""  # fmt: skip
    res = run(sweep_rank, ranks, backend, args=(tuple(collectives), tuple(sizes), iters, warmup))
    rows = []
    keys = [(c, s) for c in collectives for s in sizes]
    for i, (collective, size) in enumerate(keys):
        # a call ends when its slowest rank is done; other processes of a shared machine only ever add time to
        # a call (a rank descheduled mid-call), so the lower quartile is the call itself and the median its noise
        calls = [max(r[i][k] for r in res.returns) for k in range(iters)]
        seconds = sorted(calls)[
            len(calls) // 4
        ]  # one of the calls: quantiles() extrapolates below the fastest
        rows.append((collective, nbytes(collective, size, ranks), seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m real.sweep --ranks 2 --collectives all_reduce,broadcast --sizes 8,1024,1048576``."""
    p = argparse.ArgumentParser(prog="python -m real.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--sizes", required=True, help="comma-separated bytes")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    collectives = args.collectives.split(",")
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown or args.ranks < 2 or args.iters < 1 or args.warmup < 0:
        p.error(f"collectives among {', '.join(COLLECTIVES)}, --ranks >= 2, --iters >= 1, --warmup >= 0; "
                f"found {args.collectives!r}, {args.ranks}, {args.iters}, {args.warmup}")  # fmt: skip
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = sweep(args.ranks, collectives, sizes, args.iters, args.warmup)
    print(json.dumps({"ranks": args.ranks, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
