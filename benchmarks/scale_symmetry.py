"""Symmetric runs at scale: a data-parallel step on 16,384 and 100,000 ranks, a few of them simulated.

Prints figures; it is not a test. Usage: ``python benchmarks/scale_symmetry.py [--ranks 16384,100000]``.

The step is the data-parallel step of docs/performance.md's scale table: each rank runs an MLP (4 layers of
256 x 256, batch 32) forward and backward under the H100 cost model, then all-reduces its gradients as four
async all-reduces (buckets of its flattened gradients) with the ring algorithm on a ring cluster (100 GB/s,
5 us per hop). With ``symmetric=True`` simdist simulates 4 of the ranks and prices each all-reduce for the
whole ring (docs/symmetry.md). The same step written as GPU code (``.to("cuda")``) runs on the ``dgx-h100`` preset, its
collectives timed by NCCL's model (6 ranks simulated: both ends of the first node and of the ring). The first
figure checks the reduction against the full run at a size the full run manages; the others time the reduced
run alone. "build" is the wall time of making the cluster (a networkx graph of every rank and link), "run" that
of ``simdist.run``; "total" is both.

``--fsdp-tp 64,16384`` adds FSDP2 over tensor parallelism (``benchmarks/fsdp_tp_step.py``: tensor-parallel groups
of a ``dgx-h100`` node's 8 GPUs, FSDP2 over the rest, width 4,096, made on the meta device, two steps), timing-only
(``tensors="fake"``) and symmetric; its first size is also run in full, as the check.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from fsdp_tp_step import fsdp2_over_tp

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


def gpu_dp_step() -> float:
    """:func:`dp_step` as GPU code: the model and batch on the rank's GPU."""
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(dev)
    torch.manual_seed(dist.get_rank())
    model(torch.randn(BATCH, WIDTH, device=dev)).square().mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    works = [dist.all_reduce(chunk, async_op=True) for chunk in flat.chunk(BUCKETS)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    return simdist.now()


#: the clusters the step runs on and the program each runs: a ring of H100s (alpha-beta messages), DGX H100
#: nodes (NCCL's model)
SETUPS: dict[str, tuple[Callable[[], float], Callable[[int], simdist.Cluster]]] = {
    "ring": (
        dp_step,
        lambda n: simdist.Cluster.ring(
            n, bandwidth="100GB/s", latency="5us", device="H100", algorithms={"all_reduce": "ring"}
        ),
    ),
    "dgx-h100": (gpu_dp_step, lambda n: simdist.Cluster.preset("dgx-h100", world_size=n)),
}


def _cluster(n: int) -> simdist.Cluster:
    return SETUPS["ring"][1](n)


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


def scale(n: int, setup: str = "ring") -> dict[str, Any]:
    """The reduced run of the step on ``n`` ranks of ``setup`` (a key of :data:`SETUPS`): wall seconds to build
    the cluster and to run, simulated step time."""
    fn, make = SETUPS[setup]
    cluster, build = _timed(lambda: make(n))
    result, run = _timed(lambda: simdist.run(fn, cluster, races="off", trace="collectives", symmetric=True))
    return {
        "cluster": setup,
        "ranks": n,
        "simulated_ranks": len(result.simulated_ranks or ()),
        "build_wall_s": build,
        "run_wall_s": run,
        "total_wall_s": build + run,
        "sim_step_s": result.sim_time,
    }


#: the FSDP2-over-TP step: width, tensor-parallel group size, steps
FSDP_TP = (4096, 8, 2)


def fsdp_tp(ranks: tuple[int, ...]) -> dict[str, Any]:
    """FSDP2 over tensor parallelism, timing-only: the full run and the symmetric run at the first size, then
    the symmetric run alone at the others (wall seconds of ``simdist.run``, simulated step)."""

    def run(n: int, **kw: Any) -> tuple[Any, float]:
        cluster = simdist.Cluster.preset("dgx-h100", world_size=n)
        return _timed(
            lambda: simdist.run(fsdp2_over_tp, cluster, args=(*FSDP_TP, True), tensors="fake", **kw)
        )

    full, full_wall = run(ranks[0])
    rows = []
    for n in ranks:
        reduced, wall = run(n, symmetric=True)
        rows.append({"ranks": n, "run_wall_s": wall, "sim_step_s": reduced.sim_time})
    first = rows[0]["sim_step_s"]
    return {
        "check": {
            "ranks": ranks[0],
            "full_sim_s": full.sim_time,
            "full_wall_s": full_wall,
            "relative_difference": abs(full.sim_time - first) / full.sim_time,
        },
        "scale": rows,
    }


def figures(ranks: tuple[int, ...] = (16_384, 100_000), check_ranks: int = CHECK_RANKS) -> dict[str, Any]:
    """Every figure this benchmark prints: the check against the full run, then one row per world size."""
    for fn, make in SETUPS.values():  # the first runs import what rank code needs: not timed
        simdist.run(fn, make(8), races="off")
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "check": check(check_ranks),
        "scale": [scale(n, setup) for setup in SETUPS for n in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="16384,100000", help="comma-separated world sizes")
    parser.add_argument(
        "--check-ranks", type=int, default=CHECK_RANKS, help="world size of the full-run check"
    )
    parser.add_argument(
        "--fsdp-tp", default="", help="world sizes (multiples of 8) of the FSDP2-over-TP step, e.g. 64,16384"
    )
    args = parser.parse_args()
    show(figures(tuple(int(x) for x in args.ranks.split(",")), args.check_ranks))
    if args.fsdp_tp:
        show_fsdp_tp(fsdp_tp(tuple(int(x) for x in args.fsdp_tp.split(","))))


def show_fsdp_tp(out: dict[str, Any]) -> None:
    """Print what :func:`fsdp_tp` returned."""
    c = out["check"]
    print(
        f"FSDP2 over TP (width {FSDP_TP[0]}, TP {FSDP_TP[1]}, {FSDP_TP[2]} steps, tensors='fake'): full run on "
        f"{c['ranks']} ranks {c['full_sim_s'] * 1e3:.6f} ms simulated in {c['full_wall_s']:.2f} s "
        f"(symmetric: relative difference {c['relative_difference']:.1e})"
    )
    for row in out["scale"]:
        print(
            f"  symmetric, {row['ranks']:>6} ranks: {row['run_wall_s']:.2f} s, step {row['sim_step_s'] * 1e3:.3f} ms"
        )


def show(out: dict[str, Any]) -> None:
    """Print what :func:`figures` returned."""
    print(f"symmetric runs ({out['machine']})")
    c = out["check"]
    print(
        f"check on {c['ranks']} ranks: full run {c['full_sim_s'] * 1e3:.6f} ms simulated in {c['full_wall_s']:.2f} s, "
        f"symmetric {c['reduced_sim_s'] * 1e3:.6f} ms in {c['reduced_wall_s']:.2f} s "
        f"(relative difference {c['relative_difference']:.1e})"
    )
    print(
        f"{'cluster':>9} {'ranks':>8} {'simulated':>9} {'build s':>8} {'run s':>7} {'total s':>8} "
        f"{'step (sim) ms':>14}"
    )
    for row in out["scale"]:
        print(
            f"{row['cluster']:>9} {row['ranks']:>8} {row['simulated_ranks']:>9} {row['build_wall_s']:>8.2f} {row['run_wall_s']:>7.2f} "
            f"{row['total_wall_s']:>8.2f} {row['sim_step_s'] * 1e3:>14.3f}"
        )


if __name__ == "__main__":
    main()
