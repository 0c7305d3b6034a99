"""Symmetric runs at scale: a data-parallel step on 16,384 and 100,000 ranks, a few of them simulated.

Prints figures; it is not a test. Usage: ``python benchmarks/scale_symmetry.py [--ranks 16384,100000]``.

The step is the data-parallel step of docs/performance.md's scale table: each rank runs an MLP (4 layers of
256 x 256, batch 32) forward and backward under the H100 cost model, then all-reduces its gradients as four
async all-reduces (buckets of its flattened gradients) on a ring cluster (100 GB/s, 5 us per hop). With
``symmetric=True`` simdist simulates 4 of the ranks and prices each all-reduce for the whole ring
(docs/symmetry.md). The first figure checks the reduction against the full run at a size the full run
manages; the others time the reduced run alone. "build" is the wall time of making the cluster (a networkx
graph of every rank and link), "run" that of ``simdist.run``; "total" is both.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch
import torch.distributed as dist

import simdist

#: the MLP each rank trains: layers of WIDTH x WIDTH, a batch of BATCH rows
WIDTH, LAYERS, BATCH = 256, 4, 32
#: the gradient buckets each rank all-reduces asynchronously
BUCKETS = 4
#: the sizes the full run is compared at (the reduced run alone beyond)
CHECK_RANKS = 64


def dp_step() -> float:
    """One data-parallel step: forward, backward, then the gradients all-reduced in BUCKETS async calls."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    torch.manual_seed(dist.get_rank())
    model(torch.randn(BATCH, WIDTH)).square().mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    works = [dist.all_reduce(chunk, async_op=True) for chunk in flat.chunk(BUCKETS)]
    for w in works:
        w.wait()
    return simdist.now()


def _cluster(n: int) -> simdist.Cluster:
    return simdist.Cluster.ring(n, bandwidth="100GB/s", latency="5us", device="H100")


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def check(n: int = CHECK_RANKS) -> dict[str, float]:
    """The full run and the reduced run of the step on ``n`` ranks: their simulated step times and wall times."""
    cluster = _cluster(n)
    full, full_wall = _timed(lambda: simdist.run(dp_step, cluster, races="off", trace="collectives"))
    reduced, reduced_wall = _timed(
        lambda: simdist.run(dp_step, cluster, races="off", trace="collectives", symmetric=True)
    )
    return {
        "ranks": n,
        "full_sim_s": full.sim_time,
        "reduced_sim_s": reduced.sim_time,
        "relative_difference": abs(full.sim_time - reduced.sim_time) / full.sim_time,
        "full_wall_s": full_wall,
        "reduced_wall_s": reduced_wall,
    }


def scale(n: int) -> dict[str, float]:
    """The reduced run of the step on ``n`` ranks: wall seconds to build the cluster and to run, simulated step time."""
    cluster, build = _timed(lambda: _cluster(n))
    result, run = _timed(
        lambda: simdist.run(dp_step, cluster, races="off", trace="collectives", symmetric=True)
    )
    return {
        "ranks": n,
        "simulated_ranks": len(result.simulated_ranks or ()),
        "build_wall_s": build,
        "run_wall_s": run,
        "total_wall_s": build + run,
        "sim_step_s": result.sim_time,
    }


def figures(ranks: tuple[int, ...] = (16_384, 100_000), check_ranks: int = CHECK_RANKS) -> dict[str, Any]:
    """Every figure this benchmark prints: the check against the full run, then one row per world size."""
    simdist.run(dp_step, _cluster(2), races="off")  # the first run imports what rank code needs: not timed
    return {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}",
        "check": check(check_ranks),
        "scale": [scale(n) for n in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="16384,100000", help="comma-separated world sizes")
    parser.add_argument(
        "--check-ranks", type=int, default=CHECK_RANKS, help="world size of the full-run check"
    )
    args = parser.parse_args()
    out = figures(tuple(int(x) for x in args.ranks.split(",")), args.check_ranks)
    print(f"symmetric runs ({out['machine']})")
    c = out["check"]
    print(
        f"check on {c['ranks']} ranks: full run {c['full_sim_s'] * 1e3:.6f} ms simulated in {c['full_wall_s']:.2f} s, "
        f"symmetric {c['reduced_sim_s'] * 1e3:.6f} ms in {c['reduced_wall_s']:.2f} s "
        f"(relative difference {c['relative_difference']:.1e})"
    )
    print(f"{'ranks':>8} {'simulated':>9} {'build s':>8} {'run s':>7} {'total s':>8} {'step (sim) ms':>14}")
    for row in out["scale"]:
        print(
            f"{row['ranks']:>8} {row['simulated_ranks']:>9} {row['build_wall_s']:>8.2f} {row['run_wall_s']:>7.2f} "
            f"{row['total_wall_s']:>8.2f} {row['sim_step_s'] * 1e3:>14.3f}"
        )


if __name__ == "__main__":
    main()
