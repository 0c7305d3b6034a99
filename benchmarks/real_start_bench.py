"""Launch time of ``real.run`` with rank processes forked from the warm fork server against spawned ones.

Prints figures; it is not a test. Usage: ``python benchmarks/real_start_bench.py [--nproc 2,4] [--launches 5]``.

Each launch runs a trivial rank function (one all-reduce of four floats over gloo), so its wall time is
process start-up, rendezvous and teardown. For each process count the script launches ``--launches`` times
with ``SIMDIST_REAL_START_METHOD=spawn`` (torch's elastic default: every rank process a fresh interpreter that
imports torch) and ``--launches`` times with the fork server (the default; the first of these starts the
server and is reported apart), alternating, and prints the medians and their ratio.

Figures (x86_64, 2 CPUs, python 3.11.7, torch 2.13.0+cpu, gloo; 3 launches per method, on a machine loaded by
other work, load average 6): 2 processes 12.4 s spawned, 0.42 s forked (30x), 4 processes 22.7 s and 0.60 s
(38x); the first launch, which starts the server, 6.1 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import real
from real.warm import START_METHOD_VARIABLE


def tiny_step() -> float:
    """One all-reduce of four floats: nothing but the launch costs time."""
    t = torch.ones(4) * dist.get_rank()
    dist.all_reduce(t)
    return float(t.sum())


def _launch(nproc: int, method: str) -> float:
    os.environ[START_METHOD_VARIABLE] = method
    start = time.perf_counter()
    real.run(tiny_step, nproc, "gloo")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="comma-separated process counts")
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"torch {torch.__version__}; {args.launches} launches per method, alternating"
    )
    counts = [int(n) for n in args.nproc.split(",")]
    first = _launch(counts[0], "forkserver")  # starts the server
    print(f"first launch ({counts[0]} processes), which starts the fork server: {first:.2f} s")
    print("| processes | spawn (s) | fork server (s) | spawn / fork server |")
    print("|---|---|---|---|")
    for nproc in counts:
        spawned, forked = [], []
        for _ in range(args.launches):
            spawned.append(_launch(nproc, "spawn"))
            forked.append(_launch(nproc, "forkserver"))
        s, f = statistics.median(spawned), statistics.median(forked)
        print(f"| {nproc} | {s:.2f} | {f:.2f} | {s / f:.0f} |")


if __name__ == "__main__":
    main()
