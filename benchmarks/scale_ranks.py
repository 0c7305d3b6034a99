"""Per-rank cost at scale: one data-parallel step on a switch cluster against plain torch doing each rank's work.

Prints figures; it is not a test. Usage: ``python benchmarks/scale_ranks.py [--ranks 1024,4096,8192]``.

The step is engine_bench's: a 2-layer MLP (16 -> 16 -> 1, batch 8) forward and backward under the H100 cost
model plus one all-reduce of its flattened gradients, on a single-switch cluster, with real data. "plain torch"
is the same per-rank forward/backward run with plain torch in this thread, one rank after another, right after
the simulated run: what the simulator cannot avoid doing. The ratio is wall over wall; the CPU columns (the
process's CPU seconds, every thread included) give the same comparison without the time this process waited for
a core, which on a shared machine can be most of the wall time.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from engine_bench import mlp_local, mlp_step

import simdist


def _one(n: int) -> dict:
    """One simulated step of ``n`` ranks and its plain-torch reference, timed."""
    cluster = simdist.Cluster.switch(n, bandwidth="50GB/s", latency="5us", device="H100")
    wall, cpu = time.perf_counter(), time.process_time()
    result = simdist.run(mlp_step, cluster, trace="collectives", races="off")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    torch_wall, torch_cpu = time.perf_counter(), time.process_time()
    for r in range(n):
        mlp_local(r)
    torch_wall, torch_cpu = time.perf_counter() - torch_wall, time.process_time() - torch_cpu
    return {
        "ranks": n,
        "wall_s": wall,
        "torch_s": torch_wall,
        "ratio": wall / torch_wall,
        "cpu_s": cpu,
        "torch_cpu_s": torch_cpu,
        "cpu_ratio": cpu / torch_cpu,
        "sim_step_s": result.sim_time,
    }


def rank_scaling(ranks: tuple[int, ...] = (1024, 4096, 8192)) -> list[dict]:
    """Time one simulated data-parallel step per world size in ``ranks``; print a table and return its rows."""
    # torch's one-time warm-up (dispatch modes)
    simdist.run(mlp_step, simdist.Cluster.switch(2, device="H100"))
    mlp_local(0)
    rows = [_one(n) for n in ranks]
    print(
        f"{'ranks':>6} {'wall s':>8} {'plain torch s':>14} {'ratio':>6} {'cpu s':>7} {'torch cpu s':>12} "
        f"{'cpu ratio':>9} {'sim step us':>12}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['wall_s']:>8.2f} {r['torch_s']:>14.2f} {r['ratio']:>6.2f} {r['cpu_s']:>7.2f} "
            f"{r['torch_cpu_s']:>12.2f} {r['cpu_ratio']:>9.2f} {r['sim_step_s'] * 1e6:>12.2f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", default="1024,4096,8192")
    args = ap.parse_args()
    print(
        f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}; python {platform.python_version()}; "
        f"torch {torch.__version__}"
    )
    rank_scaling(tuple(int(x) for x in args.ranks.split(",")))


if __name__ == "__main__":
    main()
