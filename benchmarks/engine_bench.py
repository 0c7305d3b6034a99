"""Engine performance: baton hand-off cost, wall time of one data-parallel step at scale, message rate.

Prints figures; it is not a test. Usage: ``python benchmarks/engine_bench.py [--ranks 8,64,1024,4096]``.

The step is a 2-layer MLP (16 -> 16 -> 1, batch 8) forward and backward under the H100 cost model plus one
all-reduce of its flattened gradients, on a single-switch cluster. The reference for the step is the same
per-rank work done with plain torch in one thread, one rank after another (what the simulator cannot avoid
doing), so the ratio shows the simulator's own overhead. A second reference seeds as a rank does
(:func:`seeded_as_in_a_rank`): plain torch's ``torch.manual_seed`` costs a CPU-only build some 0.3 ms a call, about
half of the plain step, which a rank skips.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import simdist
from simdist.c10d import backend

HANDOFFS = 2000


class CountingMode(TorchDispatchMode):
    """Counts the aten ops that reach a dispatch mode (what a rank's modes see of a step)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # as simdist's own modes: no dynamo-disabling shim around __torch_dispatch__ (microseconds on every op), so
        # that this mode costs what any pass-through Python mode must
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def seeded_as_in_a_rank() -> Iterator[None]:
    """``torch.manual_seed`` seeding the CPU generator only while inside, as it does in a simdist rank: plain torch's
    also queues a lazy seeding of CUDA, XPU and MTIA, each with a formatted stack trace (0.25-0.35 ms a call on a
    2-core VM with a CPU-only build), which simdist leaves out. The numbers drawn after it are the same."""
    original = torch.manual_seed
    torch.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    try:
        yield
    finally:
        torch.manual_seed = original


def mlp_local(rank: int, width: int = 16) -> torch.Tensor:
    """One rank's local work: forward, backward, flattened gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    torch.manual_seed(rank)
    model(torch.randn(8, width)).pow(2).mean().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def mlp_step() -> torch.Tensor:
    """The simulated step: local work plus an all-reduce of the gradients."""
    flat = mlp_local(dist.get_rank())
    dist.all_reduce(flat)
    return flat


def _sleeper() -> None:
    baton = backend.active().baton
    for _ in range(HANDOFFS):
        baton.sleep(1e-6)


def _all_reduce_only(numel: int, iters: int) -> None:
    t = torch.ones(numel)
    for _ in range(iters):
        dist.all_reduce(t)


def handoff_us(n: int = 2) -> float:
    """Wall microseconds per baton round trip (simpy loop -> rank -> simpy loop)."""
    c = simdist.Cluster.switch(n, device="cpu")
    t0 = time.perf_counter()
    simdist.run(_sleeper, c)
    return (time.perf_counter() - t0) / (n * HANDOFFS) * 1e6


def step_seconds(n: int) -> tuple[float, float, float, float]:
    """(simulated wall seconds, plain-torch serial seconds for the same local work, the same seeded as a rank seeds,
    simulated step time)."""
    c = simdist.Cluster.switch(n, bandwidth="50GB/s", latency="5us", device="H100")
    t0 = time.perf_counter()
    res = simdist.run(mlp_step, c, trace="collectives")
    sim_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in range(n):
        mlp_local(r)
    torch_wall = time.perf_counter() - t0
    with seeded_as_in_a_rank():
        t0 = time.perf_counter()
        for r in range(n):
            mlp_local(r)
        ops_wall = time.perf_counter() - t0
    return sim_wall, torch_wall, ops_wall, res.sim_time


def message_rate(n: int = 64, algorithm: str = "ring") -> tuple[float, int]:
    """Simulated messages per wall second in a collective-only run."""
    c = simdist.Cluster.ring(n, device="cpu", algorithms={"all_reduce": algorithm})
    t0 = time.perf_counter()
    res = simdist.run(_all_reduce_only, c, args=(4096, 5), trace="collectives")
    return res.messages / (time.perf_counter() - t0), res.messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", default="8,64,1024,4096")
    args = ap.parse_args()
    print(f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}; python {platform.python_version()}; torch {torch.__version__}")
    simdist.run(mlp_step, simdist.Cluster.switch(2, device="H100"))  # one-time torch warm-up (dispatch modes)
    hs = [handoff_us() for _ in range(3)]
    print(f"baton hand-off: {min(hs):.1f} us per round trip (best of 3, {HANDOFFS} hand-offs per rank, 2 ranks)")
    print(
        f"{'ranks':>6} {'wall s':>8} {'torch-only s':>13} {'ratio':>6} {'seeded as a rank s':>19} {'ratio':>6} "
        f"{'sim step us':>12}"
    )
    for n in (int(x) for x in args.ranks.split(",")):
        wall, ref, ops, sim_t = step_seconds(n)
        print(
            f"{n:>6} {wall:>8.2f} {ref:>13.2f} {wall / ref:>6.2f} {ops:>19.2f} {wall / ops:>6.2f} {sim_t * 1e6:>12.2f}"
        )
    rate, count = message_rate()
    print(f"message rate: {rate:,.0f} simulated messages per wall second ({count} messages, 64-rank ring all-reduce x5)")


if __name__ == "__main__":
    main()
