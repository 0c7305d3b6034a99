"""Wall time of simulating one BucketedDDP training step at 64 and 1024 ranks.

Prints figures; it is not a test. Usage: ``python benchmarks/ddp_sim_bench.py [--ranks 64,1024]``.

The step: wrap a 4-layer MLP (64 -> 64, 16.9k parameters) in ``BucketedDDP`` (bucket_cap_mb 0.02, so four
buckets) and run forward, backward, gradient synchronisation and an SGD step, under the H100 cost model on a
two-level cluster (8 ranks per node). Wrapping (the broadcast of parameters from rank 0) is part of the
measured run, as it is of every run. Three columns compare, in the same process:

- ``races=off``: the detector off (the fastest configuration);
- ``races=warn``: the default outside tests (every aten op of rank code checked while a bucket is in flight);
- ``torch DDP``: torch's own DistributedDataParallel (C++ reducer) doing the same step under the simulator;
- ``serial torch``: the same per-rank forward/backward/step done with plain torch, one rank after another in
  one thread, without any communication: the floor any simulator of this program has to pay;
- ``seeded as a rank``: the same again with ``torch.manual_seed`` seeding the CPU generator only, as it does in a
  rank (``engine_bench.seeded_as_in_a_rank``): plain torch's lazy seeding of CUDA, XPU and MTIA costs some 0.3 ms a
  call on a CPU-only build, which a rank skips. Its ratio compares the step with the same work.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.distributed as dist
from engine_bench import seeded_as_in_a_rank
from torch.nn.parallel import DistributedDataParallel

import simdist
from simdist.strategies import BucketedDDP

WIDTH, LAYERS, BATCH, CAP_MB = 64, 4, 8, 0.02


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def local_step(model: torch.nn.Module, wrapped: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    wrapped(x).pow(2).mean().backward()
    if hasattr(wrapped, "finish_gradient_synchronization"):
        wrapped.finish_gradient_synchronization()
    opt.step()


def bucketed_step() -> None:
    model = make_model()
    local_step(model, BucketedDDP(model, bucket_cap_mb=CAP_MB), dist.get_rank())


def torch_ddp_step() -> None:
    model = make_model()
    local_step(model, DistributedDataParallel(model, bucket_cap_mb=CAP_MB), dist.get_rank())


def serial(n: int) -> float:
    t0 = time.perf_counter()
    for r in range(n):
        model = make_model()
        local_step(model, model, r)
    return time.perf_counter() - t0


def timed(fn, cluster: simdist.Cluster, races: str) -> float:
    t0 = time.perf_counter()
    simdist.run(fn, cluster, races=races, trace="collectives")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", default="64,1024")
    args = ap.parse_args()
    print(f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}; python {platform.python_version()}; torch {torch.__version__}")
    warm = simdist.Cluster.two_level(1, 2, device="H100")
    timed(bucketed_step, warm, "off")  # one-time torch warm-up (dispatch modes, autograd hooks)
    timed(torch_ddp_step, warm, "off")
    print(
        f"{'ranks':>6} {'races=off s':>12} {'races=warn s':>13} {'torch DDP s':>12} {'serial torch s':>15} "
        f"{'off/serial':>11} {'seeded as a rank s':>19} {'off/seeded':>11}"
    )
    for n in (int(x) for x in args.ranks.split(",")):
        cluster = simdist.Cluster.two_level(n // 8, 8, device="H100")
        off = timed(bucketed_step, cluster, "off")
        warn = timed(bucketed_step, cluster, "warn")
        ddp = timed(torch_ddp_step, cluster, "off")
        ref = serial(n)
        with seeded_as_in_a_rank():
            same = serial(n)
        print(
            f"{n:>6} {off:>12.2f} {warn:>13.2f} {ddp:>12.2f} {ref:>15.2f} {off / ref:>11.2f} {same:>19.2f} "
            f"{off / same:>11.2f}"
        )


if __name__ == "__main__":
    main()
