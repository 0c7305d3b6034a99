"""Cost of the equivalence oracle's checking (no localisation), against a plain simulated run of the same program.

Prints figures; it is not a test. Usage: ``python benchmarks/oracle_overhead.py [--world 4] [--steps 10] [--repeat 3]``.

The program is torch's DDP training a 4-layer MLP (width 256, batch 64 per rank, SGD with momentum) on an
H100 cluster model. "plain" is ``simdist.run`` of the parallel program alone; "checked" is
``simdist.check_equivalence`` of it against the single-process reference: the parallel run with state capture at
every step, the reference run on one rank, and the comparison of every parameter, gradient and optimizer state
tensor. The ratio is what checking a program costs over simulating it.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import simdist

WIDTH, LAYERS, BATCH = 256, 4, 64


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH * world, WIDTH, generator=g), torch.randn(BATCH * world, WIDTH, generator=g)


def parallel(steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    for step in range(steps):
        x, y = data(step, world)
        opt.zero_grad()
        F.mse_loss(m(x[rank * BATCH : (rank + 1) * BATCH]), y[rank * BATCH : (rank + 1) * BATCH]).backward()
        opt.step()


def reference(steps: int, world: int) -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    for step in range(steps):
        x, y = data(step, world)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def best_of(repeat: int, fn) -> float:  # type: ignore[no-untyped-def]
    """The least CPU time (seconds) of this process over ``repeat`` calls: less noisy than wall time on a shared machine."""
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--width", type=int, default=256, help="layer width: larger makes the run compute-bound")
    a = ap.parse_args()
    global WIDTH
    WIDTH = a.width
    cluster = simdist.Cluster.switch(a.world, device="H100")
    plain = best_of(a.repeat, lambda: simdist.run(parallel, cluster, args=(a.steps,), races="off"))
    rep = None

    def checked() -> None:
        nonlocal rep
        rep = simdist.check_equivalence(
            parallel, reference, cluster, args=(a.steps,), reference_args=(a.steps, a.world), races="off"
        )

    check = best_of(a.repeat, checked)
    assert rep is not None and rep.ok, str(rep)
    print(f"machine: {platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} torch threads".rstrip())
    print(f"program: torch DDP, {LAYERS}x Linear({WIDTH}), batch {BATCH}/rank, {a.steps} steps, {a.world} ranks")
    print(f"plain simdist.run          {plain * 1e3:8.1f} ms")
    print(f"check_equivalence          {check * 1e3:8.1f} ms   ratio {check / plain:.2f}x  ({rep.summary()})")


if __name__ == "__main__":
    main()
