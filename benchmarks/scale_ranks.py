"""Per-rank cost at scale: one data-parallel step against plain torch doing each rank's work.

Prints figures; it is not a test. Usage:
``python benchmarks/scale_ranks.py [--ranks 1024,4096,8192] [--cluster switch|ring]``.

On a switch cluster (the default) the step is engine_bench's: a 2-layer MLP (16 -> 16 -> 1, batch 8) forward
and backward under the H100 cost model plus one all-reduce of its flattened gradients, with real data. On a ring
cluster (``--cluster ring``, ring all-reduce) the same forward and backward is followed by four async all-reduces,
one per gradient (256, 16, 16 and 1 elements): at 1,024 ranks some 8 million messages. "plain torch"
is the same per-rank forward/backward run with plain torch in this thread, one rank after another, right after
the simulated run: what the simulator cannot avoid doing. The ratio is wall over wall; the CPU columns (the
process's CPU seconds, every thread included) give the same comparison without the time this process waited for
a core, which on a shared machine can be most of the wall time. "seeded as a rank" is the same plain step again
with ``torch.manual_seed`` seeding the CPU generator only, as it does in a rank: plain torch's also queues lazy
seedings of CUDA, XPU and MTIA with a formatted stack trace each, about half of this step's plain time on a
CPU-only build, which a rank leaves out. Its ratio compares the simulated step with the same work; the first
ratio flatters the simulator by that half.

It then prints what a thread per rank costs before any simulation (the thread floor): the plain step run by as
many live threads as the first world size has ranks, one thread at a time as a simulated run's ranks run (each
thread started as the one before it waits, each keeping its result until the last has run), against the same
steps in this thread, as CPU time. And the per-op share on its own: the step's forward and backward run over and
over by one rank of a switch cluster of H100s (a warm thread: no start-up, no all-reduce) against the same in plain
torch, both as CPU time, best of several batches, divided by the ops the step dispatches, beside the same plain
step under a pass-through Python dispatch mode (what torch charges any mode). Both of these seed as a rank does on
either side.
"""

from __future__ import annotations

import _thread
import argparse
import os
import platform
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from engine_bench import CountingMode, mlp_local, mlp_step, seeded_as_in_a_rank

import simdist


def mlp_grads_step(width: int = 16) -> list[torch.Tensor]:
    """The ring step: the MLP's forward and backward, then one async all-reduce per gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    torch.manual_seed(dist.get_rank())
    model(torch.randn(8, width)).pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    for w in [dist.all_reduce(g, async_op=True) for g in grads]:
        w.wait()
    return grads


def _cluster(n: int, shape: str) -> simdist.Cluster:
    if shape == "ring":
        return simdist.Cluster.ring(n, device="H100", algorithms={"all_reduce": "ring"})
    return simdist.Cluster.switch(n, bandwidth="50GB/s", latency="5us", device="H100")


def _one(n: int, shape: str = "switch") -> dict:
    """One simulated step of ``n`` ranks and its plain-torch reference, timed."""
    cluster = _cluster(n, shape)
    step = mlp_grads_step if shape == "ring" else mlp_step
    wall, cpu = time.perf_counter(), time.process_time()
    result = simdist.run(step, cluster, trace="collectives", races="off")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    torch_wall, torch_cpu = time.perf_counter(), time.process_time()
    for r in range(n):
        mlp_local(r)
    torch_wall, torch_cpu = time.perf_counter() - torch_wall, time.process_time() - torch_cpu
    with seeded_as_in_a_rank():
        ops_wall, ops_cpu = time.perf_counter(), time.process_time()
        for r in range(n):
            mlp_local(r)
        ops_wall, ops_cpu = time.perf_counter() - ops_wall, time.process_time() - ops_cpu
    return {
        "ranks": n,
        "wall_s": wall,
        "torch_s": torch_wall,
        "ratio": wall / torch_wall,
        "cpu_s": cpu,
        "torch_cpu_s": torch_cpu,
        "cpu_ratio": cpu / torch_cpu,
        "ops_s": ops_wall,
        "ops_cpu_s": ops_cpu,
        "ops_ratio": wall / ops_wall,
        "ops_cpu_ratio": cpu / ops_cpu,
        "sim_step_s": result.sim_time,
        "messages": result.messages,
    }


def rank_scaling(ranks: tuple[int, ...] = (1024, 4096, 8192), shape: str = "switch") -> list[dict]:
    """Time one simulated data-parallel step per world size in ``ranks`` on a ``shape`` cluster; print a table
    and return its rows."""
    # torch's one-time warm-up (dispatch modes)
    simdist.run(mlp_grads_step if shape == "ring" else mlp_step, _cluster(2, shape))
    mlp_local(0)
    rows = [_one(n, shape) for n in ranks]
    print(f"{shape} cluster")
    print(
        f"{'ranks':>6} {'messages':>10} {'wall s':>8} {'plain torch s':>14} {'ratio':>6} {'cpu s':>7} "
        f"{'torch cpu s':>12} {'cpu ratio':>9} {'seeded as a rank s':>19} {'ratio':>6} {'cpu ratio':>9} "
        f"{'sim step us':>12}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['messages']:>10,} {r['wall_s']:>8.2f} {r['torch_s']:>14.2f} {r['ratio']:>6.2f} "
            f"{r['cpu_s']:>7.2f} {r['torch_cpu_s']:>12.2f} {r['cpu_ratio']:>9.2f} {r['ops_s']:>19.2f} "
            f"{r['ops_ratio']:>6.2f} {r['ops_cpu_ratio']:>9.2f} {r['sim_step_s'] * 1e6:>12.2f}"
        )
    return rows


def _best_batch(calls: int, batches: int) -> float:
    """CPU seconds of the calling thread for ``calls`` of ``mlp_local``, best of ``batches``."""
    best = float("inf")
    for _ in range(batches):
        start = time.thread_time()
        for r in range(calls):
            mlp_local(r)
        best = min(best, time.thread_time() - start)
    return best


def per_op(calls: int = 300, batches: int = 7) -> dict:
    """Microseconds the cost mode adds to each op of the step, in a warm rank thread of a GPU cluster, and what a
    pass-through Python dispatch mode alone adds in plain torch (torch's share, which no simdist change removes);
    printed."""
    with CountingMode() as counting:
        mlp_local(0)
    simulated: list[float] = []

    def rank() -> None:
        _best_batch(30, 1)  # the thread's first use of torch
        simulated.append(_best_batch(calls, batches))

    simdist.run(rank, _cluster(1, "switch"), races="off")
    with seeded_as_in_a_rank():
        plain = _best_batch(calls, batches)
        with CountingMode():
            mode = _best_batch(calls, batches)
    row = {
        "ops": counting.ops,
        "step_us": simulated[0] / calls * 1e6,
        "torch_step_us": plain / calls * 1e6,
        "mode_step_us": mode / calls * 1e6,
        "per_op_us": (simulated[0] - plain) / calls / counting.ops * 1e6,
        "mode_per_op_us": (mode - plain) / calls / counting.ops * 1e6,
    }
    print(
        f"per op: {row['ops']} ops per step; {row['step_us']:.0f} us per step in a warm rank, "
        f"{row['torch_step_us']:.0f} us in plain torch: {row['per_op_us']:.1f} us per op over plain torch; "
        f"a pass-through dispatch mode alone: {row['mode_step_us']:.0f} us per step, {row['mode_per_op_us']:.1f} "
        "us per op"
    )
    return row


#: a child interpreter's measurement: 64-by-64 mm, mul and relu (MKL threads the mm) in this thread, then in the
#: one rank of a CPU cluster (compute=False), before this thread has run any parallel region
_MKL_OPS = r"""
import time, torch, simdist
N = 3000
def loop():
    x, w = torch.ones(64, 64), torch.ones(64, 64)
    for _ in range(N):
        x = torch.relu(x @ w * 0.001)
def us(fn):
    t = time.perf_counter(); fn(); return (time.perf_counter() - t) / N / 3 * 1e6
cluster = simdist.Cluster.switch(1, device="cpu")
rank = us(lambda: simdist.run(loop, cluster, compute=False))
print(us(loop), rank)
"""


def mkl_ops_in_a_rank() -> dict:
    """Ops MKL threads, in a rank of a process where ``OMP_NUM_THREADS`` is unset (a rank thread runs them with
    the run's intra-op count, not the machine's core count), against the same in plain torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", _MKL_OPS], env=env, capture_output=True, text=True, check=True
    )
    plain, rank = map(float, out.stdout.split()[-2:])
    print(
        f"MKL-threaded ops (64x64 mm, mul, relu), OMP_NUM_THREADS unset: {rank:.1f} us per op in a rank "
        f"(compute=False), {plain:.1f} in plain torch"
    )
    return {"rank_us": rank, "torch_us": plain}


#: the stack size of simdist's rank threads (simdist.engine.runner), which the thread floor's threads get too
_STACK_BYTES = 16 * 1024 * 1024


def thread_floor(n: int) -> dict:
    """CPU seconds of the plain step in ``n`` live threads run one at a time, and of the same steps in this thread;
    printed."""
    results: list[torch.Tensor] = []
    ran = _thread.allocate_lock()
    ran.acquire()

    def rank(r: int, go_on: Any) -> None:
        results.append(mlp_local(r))
        ran.release()
        go_on.acquire()  # alive until the last rank has run, as every rank of the simulated step is

    old = threading.stack_size(_STACK_BYTES)
    threads, locks = [], []
    try:
        with seeded_as_in_a_rank():
            cpu = time.process_time()
            for r in range(n):
                go_on = _thread.allocate_lock()
                go_on.acquire()
                locks.append(go_on)
                threads.append(threading.Thread(target=rank, args=(r, go_on), daemon=True))
                threads[-1].start()
                ran.acquire()
            for go_on, t in zip(locks, threads):
                go_on.release()
                t.join()
            cpu = time.process_time() - cpu
            plain = time.process_time()
            for r in range(n):
                mlp_local(r)
            plain = time.process_time() - plain
    finally:
        threading.stack_size(old)
    row = {"ranks": n, "threads_cpu_s": cpu, "torch_cpu_s": plain, "ratio": cpu / plain}
    print(
        f"thread floor: {n} live threads running the plain step one at a time: {cpu:.2f} cpu s, "
        f"{plain:.2f} in this thread ({row['ratio']:.2f}x)"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", default="1024,4096,8192")
    ap.add_argument("--cluster", choices=("switch", "ring"), default="switch")
    args = ap.parse_args()
    print(
        f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}; python {platform.python_version()}; "
        f"torch {torch.__version__}"
    )
    ranks = tuple(int(x) for x in args.ranks.split(","))
    rank_scaling(ranks, args.cluster)
    thread_floor(ranks[0])
    per_op()
    mkl_ops_in_a_rank()


if __name__ == "__main__":
    main()
