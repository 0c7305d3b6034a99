"""What link latency adds to one step of torch's own pipeline schedules, against their closed form.

Prints figures; it is not a test. Usage: ``python benchmarks/pipeline_latency.py [--latency 5us]``.

The pipeline: p = 4 equal stages (each a stack of Linear layers built directly as a ``PipelineStage``), m = 8
microbatches, torch's ``ScheduleGPipe`` and ``Schedule1F1B``, on ``p`` H100s behind one switch. Each schedule
runs twice, with zero-latency links and with ``--latency`` per link (a stage-to-stage hop crosses two links,
through the switch). On real GPUs the host enqueues kernels and sends and runs ahead of the device, so a
receive is posted long before its data is due and a hop's latency lands on the critical path only while the
pipeline fills and drains: about 2(p - 1) hops per step, whatever m is. A host that waited for its device
before each send or receive would pay about a hop per microbatch instead.

Columns: the step's simulated time on each network, the difference, that difference in hop latencies, and
the same difference predicted by the schedule's dependency graph (``tests/pipeline_dag.py``: each stage runs
its actions in order, each transfer leaves when produced and takes one hop) from the stages' forward and
backward times under the cost model. GPipe's graph puts 2(p - 1) hops on the critical path; 1F1B's puts more,
since in its steady state a stage's next forward waits for a backward that came back from the next stage.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import simdist
from simdist.compute import estimate, get_device
from simdist.units import parse_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pipeline_dag import SCHEDULES as ORDERS
from pipeline_dag import step_end

STAGES, MICROBATCHES, WIDTH, DEPTH, BATCH = 4, 8, 1024, 4, 64 * 8
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def stage_module(index: int) -> torch.nn.Module:
    torch.manual_seed(index)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def pipeline_step(schedule: str) -> float:
    rank, n = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(stage_module(rank), rank, n, torch.device("cpu"))
    sched = SCHEDULES[schedule](stage, MICROBATCHES, loss_fn=loss_fn)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    target = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(2):  # the first step also infers shapes and allocates buffers: time the second
        dist.barrier()
        simdist.synchronize()
        start = simdist.now()
        if rank == 0:
            sched.step(x)
        elif rank == n - 1:
            sched.step(target=target)
        else:
            sched.step()
        simdist.synchronize()
        times.append((start, simdist.now()))
    return times[-1]


def stage_seconds() -> tuple[float, float]:
    """Forward and backward of one stage on one microbatch under the H100 cost model (seconds), gradients
    accumulating as from the second microbatch on."""
    module = stage_module(0)
    x = torch.randn(BATCH // MICROBATCHES, WIDTH, requires_grad=True)
    module(x).sum().backward()
    forward, _ = estimate(lambda: module(x), device=get_device("H100"))
    out = module(x)
    backward, _ = estimate(lambda: out.backward(torch.ones_like(out)), device=get_device("H100"))
    return forward, backward


def step_time(schedule: str, latency: str) -> float:
    cluster = simdist.Cluster.switch(STAGES, bandwidth="450GB/s", latency=latency, device="H100")
    result = simdist.run(pipeline_step, cluster, args=(schedule,), races="off", trace="collectives")
    return max(end for _, end in result.returns) - min(start for start, _ in result.returns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--latency", default="5us", help="latency of each link (a hop crosses two)")
    args = ap.parse_args()
    hop = 2 * parse_time(args.latency)
    print(f"# machine: {platform.machine()}; python {platform.python_version()}; torch {torch.__version__}")
    print(f"# p={STAGES} stages, m={MICROBATCHES} microbatches, stage = {DEPTH} x Linear({WIDTH}, {WIDTH}), "
          f"batch {BATCH}; hop latency {hop * 1e6:g} us; fill + drain = 2(p-1) = {2 * (STAGES - 1)} hops")
    forward, backward = stage_seconds()
    print(f"# one stage, one microbatch: forward {forward * 1e6:.1f} us, backward {backward * 1e6:.1f} us (H100 cost model)")
    print(f"{'schedule':>9} {'ideal (us)':>11} {'latency (us)':>13} {'added (us)':>11} {'hops':>6} {'graph: hops':>12}")
    for name in SCHEDULES:
        ideal = step_time(name, "0us")
        slow = step_time(name, args.latency)
        orders = ORDERS[name](STAGES, MICROBATCHES)
        zeros = [0.0] * STAGES
        graph = step_end(orders, forward, backward, hop, zeros) - step_end(orders, forward, backward, 0.0, zeros)
        print(f"{name:>9} {ideal * 1e6:11.1f} {slow * 1e6:13.1f} {(slow - ideal) * 1e6:11.1f} "
              f"{(slow - ideal) / hop:6.1f} {graph / hop:12.1f}")

if __name__ == "__main__":
    main()
