"""Cost of memory accounting (``simdist.run(..., memory=True)``) per aten op, against the same run without it.

Prints figures; it is not a test. Usage: ``python benchmarks/memory_overhead.py [--ops 20000] [--repeat 5]``.

Each rank runs a training-like loop of small ops (a 2-layer MLP's forward, backward and an SGD step, repeated),
so the op count dominates and the per-op overhead shows. Two devices: on "H100" the compute-cost dispatch mode
is installed anyway and accounting rides on it; on "cpu" (zero-cost) a run without accounting installs no mode,
so turning accounting on also pays for the mode itself.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from engine_bench import CountingMode

import simdist


def work(steps: int) -> None:
    """A rank's loop: forward, backward and an SGD step of a small MLP, ``steps`` times."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def ops_per_step() -> int:
    """aten ops one step of ``work`` dispatches."""
    counter = CountingMode()
    work(1)
    with counter:
        work(1)
    return counter.ops


def best_times(device: str, steps: int, repeat: int) -> tuple[float, float]:
    """Best wall-clock seconds of a 2-rank run of ``work(steps)`` without and with accounting.

    The two alternate, so that load from other processes on a shared machine hits both alike.
    """
    cluster = simdist.Cluster.ring(2, bandwidth="100GB/s", latency="5us", device=device)
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, memory in enumerate((False, True)):
            start = time.perf_counter()
            simdist.run(work, cluster, args=(steps,), memory=memory, races="off")
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def main() -> None:
    """Print the per-op cost with and without accounting on each device."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000, help="aten ops per rank (approximately)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (the best is kept)")
    a = parser.parse_args()
    per_step = ops_per_step()
    steps = max(1, a.ops // per_step)
    ops = 2 * steps * per_step  # both ranks
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"# 2 ranks x {steps} steps x {per_step} ops/step; races off; best of {a.repeat}")
    print(f"{'device':>8} {'off us/op':>10} {'on us/op':>10} {'added us/op':>12} {'ratio':>6}")
    for device in ("H100", "cpu"):
        off, on = (t / ops * 1e6 for t in best_times(device, steps, a.repeat))
        print(f"{device:>8} {off:10.2f} {on:10.2f} {on - off:12.2f} {on / off:6.2f}")


if __name__ == "__main__":
    main()
