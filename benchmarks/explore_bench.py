"""Exploration's figures: how often each strategy hits bugs of known depth against PCT's bound, the overhead of a
perturbed run over a plain one, and runs per second on 1 and 2 workers.

Prints figures; it is not a test. Usage: ``python benchmarks/explore_bench.py [--runs 200] [--seeds 5] [--skip-pool] [--throughput-runs 200]``.

The planted bugs (rank 0 of four takes one value from each of ranks 1, 2, 3 from any source, ``recv`` without
``src``): depth 1, "rank 3's value comes first" (one ordering constraint); depth 2, "the values come as 2, 3,
1" (two: 2 before 3, 3 before 1). Each strategy explores the program ``--runs`` times from each of ``--seeds``
seeds; the hit rate is the share of perturbed runs (run 0, the unperturbed run, left out) that meet the bug.
PCT's bound is ``1 / (n k^(d-1))`` with n the agents and k the decisions the unperturbed run met. A second
program repeats the senders' tie over 1, 2, 4 and 8 rounds; its bug, rank 1 last in every round, is what PCT's
fixed priorities find at one rate whatever the rounds, and random choice at (1/3)^rounds.

The overhead and throughput figures use a small DDP step: torch's DistributedDataParallel around a 2-layer MLP
(32 -> 32) on 4 ranks of a CPU cluster, one forward, backward and SGD step.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import simdist

CPU4 = simdist.Cluster.switch(4, device="cpu")


def arrival_order() -> list[int] | None:
    """Rank 0 returns the order ranks 1, 2, 3's values came in (received from any source)."""
    rank = dist.get_rank()
    if rank != 0:
        dist.send(torch.tensor([float(rank)]), 0)
        return None
    order = []
    for _ in range(dist.get_world_size() - 1):
        buf = torch.zeros(1)
        dist.recv(buf)
        order.append(int(buf.item()))
    return order


def ddp_step() -> float:
    """One DDP training step of a small MLP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = ddp(x).pow(2).mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


BUGS = {1: lambda order: order[0] == 3, 2: lambda order: order == [2, 3, 1]}


def rounds_of_sends(rounds: int) -> list[int] | None:
    """Ranks 1, 2, 3 each do the same work and send rank 0 a value, ``rounds`` times; rank 0 returns the order the
    values came in (received from any source). The senders' sends are due at the same times in every round."""
    rank = dist.get_rank()
    if rank != 0:
        sends = []
        for _ in range(rounds):
            simdist.charge(1e-3)
            sends.append(dist.isend(torch.tensor([float(rank)]), 0))
        for s in sends:
            s.wait()
        return None
    order = []
    for _ in range(3 * rounds):
        buf = torch.zeros(1)
        dist.recv(buf)
        order.append(int(buf.item()))
    return order


def one_round() -> list[int] | None:
    return rounds_of_sends(1)


def two_rounds() -> list[int] | None:
    return rounds_of_sends(2)


def four_rounds() -> list[int] | None:
    return rounds_of_sends(4)


def eight_rounds() -> list[int] | None:
    return rounds_of_sends(8)


#: the program of each number of rounds (explore runs a function of no arguments)
ROUNDS = {1: one_round, 2: two_rounds, 4: four_rounds, 8: eight_rounds}


def slowest_every_round(order: list[int]) -> bool:
    """The bug: rank 1's value comes last in every round (rank 1 the slowest sender each time)."""
    return all(order[3 * r + 2] == 1 for r in range(len(order) // 3))


def hit_rates(runs: int, seeds: int) -> None:
    print(
        f"hit rates of planted bugs, {runs} runs per exploration, {seeds} seeds (4 ranks, rank 0 receiving from any source)"
    )
    print(
        f"{'bug depth':>9}  {'strategy':<12}  {'hits':>7}  {'rate':>7}  {'PCT bound':>9}  (n agents, k decisions)"
    )
    for depth, bug in BUGS.items():
        for strategy in ("random", f"pct d={depth}"):
            hits = total = 0
            n = k = 0
            for seed in range(seeds):
                seen: list[list[int]] = []
                ex = simdist.explore(
                    arrival_order,
                    CPU4,
                    runs=runs,
                    strategy=strategy.split()[0],
                    depth=depth,
                    seed=seed,
                    check=lambda res, seen=seen: seen.append(res.returns[0]),
                )
                n, k = ex.outcomes[0].agents, len(ex.outcomes[0].decisions)
                hits += sum(bug(order) for order in seen[1:])
                total += len(seen) - 1
            bound = 1 / (n * k ** (depth - 1))
            print(f"{depth:>9}  {strategy:<12}  {hits:>7}  {hits / total:>7.3f}  {bound:>9.3f}  ({n}, {k})")


def consistent_rank(runs: int, seeds: int) -> None:
    """A bug that needs one rank to lose every tie it meets: PCT's fixed priorities find it at a rate that does not
    depend on how many ties there are; random choice's falls as (1/3)^rounds."""
    print(f"one rank the slowest in every round, {runs} runs per exploration, {seeds} seeds")
    print(f"{'rounds':>6}  {'k':>3}  {'random':>7}  {'pct d=1':>7}  {'(1/3)^rounds':>12}  {'PCT bound 1/n':>13}")
    for rounds, program in ROUNDS.items():
        rates = {}
        for strategy in ("random", "pct"):
            hits = total = 0
            for seed in range(seeds):
                seen: list[list[int]] = []
                ex = simdist.explore(
                    program,
                    CPU4,
                    runs=runs,
                    strategy=strategy,
                    depth=1,
                    seed=seed,
                    check=lambda res, seen=seen: seen.append(res.returns[0]),
                )
                n, k = ex.outcomes[0].agents, len(ex.outcomes[0].decisions)
                hits += sum(slowest_every_round(order) for order in seen[1:])
                total += len(seen) - 1
            rates[strategy] = hits / total
        print(
            f"{rounds:>6}  {k:>3}  {rates['random']:>7.3f}  {rates['pct']:>7.3f}  {(1 / 3) ** rounds:>12.4f}  {1 / n:>13.3f}"
        )


def overhead(repeats: int) -> None:
    perturbation = simdist.Perturbation(ties="random", latency=0.2, compute=0.1)
    plain, perturbed = [], []
    simdist.run(ddp_step, CPU4)
    for _ in range(repeats):  # interleaved, so that a change of the machine's load hits both alike
        t0 = time.perf_counter()
        simdist.run(ddp_step, CPU4)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        simdist.run(ddp_step, CPU4, perturbation=perturbation)
        perturbed.append(time.perf_counter() - t0)
    a, b = statistics.median(plain), statistics.median(perturbed)
    print(
        f"DDP step, 4 ranks: plain {a * 1e3:.1f} ms, perturbed (random ties, jitter) {b * 1e3:.1f} ms: {b / a:.2f}x "
        f"(medians of {repeats})"
    )


def throughput(runs: int, pool: bool) -> None:
    jitter = {"latency": 0.2, "compute": 0.1}
    for workers in (1, 2) if pool else (1,):
        # the first exploration on a pool starts its forkserver (a process that imports torch and simdist once):
        # timed apart, then a second exploration on the warm forkserver gives the rate of a long exploration
        t0 = time.perf_counter()
        simdist.explore(ddp_step, CPU4, runs=workers, workers=workers, jitter=jitter)
        start = time.perf_counter() - t0
        t0 = time.perf_counter()
        ex = simdist.explore(ddp_step, CPU4, runs=runs, workers=workers, jitter=jitter)
        wall = time.perf_counter() - t0
        print(
            f"explore(ddp_step, runs={runs}, workers={workers}): {ex.runs / wall:.1f} runs/s ({wall:.1f} s); "
            f"a first exploration of {workers} run(s) took {start:.1f} s (start-up)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--skip-pool", action="store_true", help="leave out the 2-worker figure")
    ap.add_argument("--throughput-runs", type=int, default=200, help="runs of each timed exploration")
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f}; torch {torch.__version__}"
    )
    hit_rates(args.runs, args.seeds)
    consistent_rank(args.runs, args.seeds)
    overhead(20)
    throughput(args.throughput_runs, not args.skip_pool)


if __name__ == "__main__":
    main()
