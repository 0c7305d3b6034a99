"""Wall cost of running GPU code on simulated GPUs: per op and per training step, against the same program written
for the CPU under simdist, and against plain torch.

Prints figures; it is not a test. Usage: ``python benchmarks/gpu_emulation_bench.py [--quick]``.

Per op: CPU time of the calling thread per call (``time.thread_time``: on a shared machine wall time measures the
neighbours), the best of several repeats, for

- ``torch``: CPU tensors, no dispatch mode (plain torch);
- ``cpu, cost mode``: CPU tensors under simdist's per-op cost mode (what a program written for the CPU costs
  under simdist on a GPU cluster);
- ``cuda, cost mode``: simulated GPU tensors under the same mode, which also unwraps and re-wraps them (what a
  program written for GPUs costs).

Per step: a training step (4 x Linear(256, 256) with ReLU, batch 32, forward, backward and AdamW with
``foreach=True``) written for CUDA and for the CPU, each run for ``steps`` steps on one simulated H100 rank; the
process CPU time of runs of two lengths gives the cost of one step (the difference, over the steps between them),
so the set-up of a run drops out. ``torch`` is the CPU program without simdist.

Factories (``torch.rand``, ``torch.ones``) on the host of a rank that used its GPU: under the cost mode, against the
same with the ``device=cpu`` and ``pin_memory=False`` torch hands a dispatch mode passed on to aten (which the cost
mode leaves out), and against plain torch.

FSDP2's initialisation: a model made on the meta device, sharded with ``fully_shard``, moved to the GPUs and reset
(DTensor's random ops), on 8 and 32 ranks of ``dgx-h100`` nodes: wall time and simulated time, beside plain torch
making and resetting the same model once per rank.

DDP's construction and one step on 64 and 128 ranks of ``dgx-h100`` nodes: torch's DDP reads every rank's parameter
count with ``item()``, ``n`` value reads on each of ``n`` ranks; wall time, beside the same run with every wait for
the GPU slept at once (as simdist did before it kept such waits as host time), which must give the same simulated
time.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
from collections.abc import Callable

import torch

import simdist
from simdist.clock.baton import current_rank_state
from simdist.clock.ranktime import RankTime
from simdist.compute import ComputeCostMode, cost, get_device
from simdist.cuda import native
from simdist.cuda.rank import RankCuda
from simdist.cuda.tensor import SimCudaTensor

H100 = get_device("H100")
CUDA0 = torch.device("cuda", 0)


def _per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Microseconds of thread CPU time per call of ``fn``, the best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def _ops(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    return {
        "add 64x64": lambda: a + b,
        "mm 64x64": lambda: a @ b,
        "add_ (in place)": lambda: a.add_(0.0),
        "view": lambda: a.view(4096),
    }


def per_op(calls: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(op, torch, cpu under the cost mode, cuda under the cost mode), microseconds per call."""
    host = torch.randn(64, 64), torch.randn(64, 64)
    device = SimCudaTensor(host[0].clone(), CUDA0), SimCudaTensor(host[1].clone(), CUDA0)
    rank = RankCuda(0, lambda index: 0, lambda: None)
    rank.use()
    rows: dict[str, list[float]] = {}
    for name, fn in _ops(*host).items():
        rows[name] = [_per_call(fn, calls, repeats)]
    with ComputeCostMode(H100, lambda seconds, name: None):
        for name, fn in _ops(*host).items():
            rows[name].append(_per_call(fn, calls, repeats))
    with ComputeCostMode(H100, lambda seconds, name: None, cuda=rank):
        for name, fn in _ops(*device).items():
            rows[name].append(_per_call(fn, calls, repeats))
    return [(name, *figures) for name, figures in rows.items()]


def train(kind: str, steps: int) -> None:
    """The training loop, written for ``kind`` ("cuda" or "cpu")."""
    if kind == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(32, 256).to(kind)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _process_seconds(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def factories(calls: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(factory, torch, under the cost mode of a rank that used its GPU, the same with the ``device=cpu`` and
    ``pin_memory=False`` torch hands the mode passed on to aten), microseconds per call."""
    rank = RankCuda(0, lambda index: 0, lambda: None)
    rank.use()
    calls_of = {"torch.rand(20)": lambda: torch.rand(20), "torch.ones(20)": lambda: torch.ones(20)}
    rows = []
    for name, fn in calls_of.items():
        plain = _per_call(fn, calls, repeats)
        with ComputeCostMode(H100, lambda seconds, name: None, cuda=rank):
            lean = _per_call(fn, calls, repeats)
            kept = cost._as_aten_assumes
            cost._as_aten_assumes = lambda kwargs: kwargs
            try:
                full = _per_call(fn, calls, repeats)
            finally:
                cost._as_aten_assumes = kept
        rows.append((name, plain, lean, full))
    return rows


def per_step(short: int, long: int, repeats: int) -> dict[str, float]:
    """Milliseconds of process CPU time per step: the GPU program and its CPU twin under simdist, and plain torch."""
    one = simdist.Cluster.switch(1, device="H100")
    out: dict[str, float] = {}
    programs = {
        "cuda under simdist": lambda steps: simdist.run(train, one, args=("cuda", steps), races="off"),
        "cpu under simdist": lambda steps: simdist.run(train, one, args=("cpu", steps), races="off"),
        "torch": lambda steps: train("cpu", steps),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a simulated run computes on one thread
    try:
        for name, program in programs.items():
            program(
                short
            )  # once-per-process costs (the native pieces' first installation, lazy imports) drop out
            best = float("inf")
            for _ in range(repeats):
                a = _process_seconds(functools.partial(program, short))
                b = _process_seconds(functools.partial(program, long))
                best = min(best, (b - a) / (long - short))
            out[name] = best * 1e3
    finally:
        torch.set_num_threads(threads)
    return out


def _fsdp2_init(layers: int, width: int) -> float:
    """FSDP2's initialisation as its examples write it: the model made on the meta device, each layer and the
    model wrapped with ``fully_shard``, then moved onto the GPU and reset (DTensor random ops, whose first makes the
    rank's RNG tracker). Returns the rank's simulated time at the end."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % 8)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cuda")
    for layer in model:
        layer.reset_parameters()
    torch.cuda.synchronize()
    return simdist.now()


def fsdp2_init(ranks: list[int], layers: int = 4, width: int = 64) -> list[tuple[int, float, float, float]]:
    """(ranks, wall seconds, simulated ms, wall seconds of the same model made and reset once in plain torch, times
    the ranks) of :func:`_fsdp2_init` on ``dgx-h100`` nodes."""
    rows = []
    for n in ranks:
        start = time.perf_counter()
        res = simdist.run(_fsdp2_init, simdist.Cluster.preset("dgx-h100", world_size=n), args=(layers, width))
        wall = time.perf_counter() - start
        start = time.perf_counter()
        torch.manual_seed(0)
        for _ in range(n):
            for layer in torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]):
                layer.reset_parameters()
        plain = time.perf_counter() - start
        rows.append((n, wall, max(res.returns) * 1e3, plain))
    return rows


def _ddp_step() -> float:
    """The PyTorch DDP tutorial's step: DDP's construction (which reads every rank's parameter count with ``item()``:
    ``n`` value reads on each of ``n`` ranks) and one step of a small model; returns the rank's simulated time."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("nccl")
    device = dist.get_rank() % 8
    torch.cuda.set_device(device)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device])
    torch.optim.SGD(ddp.parameters(), lr=1e-3).zero_grad()
    ddp(torch.randn(20, 10)).sum().backward()
    torch.cuda.synchronize()
    return simdist.now()


def _waits_slept_at_once(self: RankTime, until: float) -> None:
    """A host's wait for its GPU as it was before it kept waits as host time: two baton hand-offs each."""
    state = current_rank_state()
    if state is not None:
        self.settle()
        if self.host_runs_ahead:
            self.baton.sleep(until - self.env.now, "synchronizing with its device")


def ddp_construction(ranks: list[int]) -> list[tuple[int, float, float, float]]:
    """(ranks, wall seconds, wall seconds with the waits slept at once, simulated ms) of :func:`_ddp_step` on
    ``dgx-h100`` nodes."""
    rows = []
    # the process's first DDP run pays its imports: not timed
    simdist.run(_ddp_step, simdist.Cluster.preset("dgx-h100", world_size=8))
    for n in ranks:
        cluster = simdist.Cluster.preset("dgx-h100", world_size=n)
        start = time.perf_counter()
        res = simdist.run(_ddp_step, cluster)
        wall = time.perf_counter() - start
        kept = RankTime.wait_for_device
        RankTime.wait_for_device = _waits_slept_at_once  # type: ignore[method-assign]
        try:
            start = time.perf_counter()
            ref = simdist.run(_ddp_step, cluster)
            slept = time.perf_counter() - start
        finally:
            RankTime.wait_for_device = kept  # type: ignore[method-assign]
        assert ref.sim_time == res.sim_time, (ref.sim_time, res.sim_time)
        rows.append((n, wall, slept, max(res.returns) * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and steps (noisier)")
    args = parser.parse_args()
    calls, repeats, short, long = (500, 3, 2, 12) if args.quick else (3000, 7, 5, 45)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}")
    native.install(1)  # the guard: autograd on simulated GPU tensors outside a run (the per-op figures)
    try:
        rows = per_op(calls, repeats)
    finally:
        native.uninstall()
    print("\nper op, us of thread CPU time per call (best of repeats)")
    print(f"{'op':<18}{'torch':>8}{'cpu, cost mode':>16}{'cuda, cost mode':>17}{'cuda/cpu':>10}")
    for name, plain, cpu, cuda in rows:
        print(f"{name:<18}{plain:>8.1f}{cpu:>16.1f}{cuda:>17.1f}{cuda / cpu:>10.2f}")
    print(
        "\nfactories on the host of a rank that used its GPU, us of thread CPU time per call (best of repeats)"
    )
    print(f"{'factory':<18}{'torch':>8}{'cost mode':>11}{'keywords passed on':>20}{'ratio':>8}")
    for name, plain, lean, full in factories(calls, repeats):
        print(f"{name:<18}{plain:>8.1f}{lean:>11.1f}{full:>20.1f}{full / lean:>8.2f}")
    steps = per_step(short, long, repeats=3 if not args.quick else 1)
    print(
        "\nper training step, ms of process CPU time (4 x Linear(256,256), batch 32, fwd+bwd+AdamW foreach)"
    )
    for name, ms in steps.items():
        print(f"{name:<20}{ms:>8.2f}")
    print(f"{'cuda / cpu':<20}{steps['cuda under simdist'] / steps['cpu under simdist']:>8.2f}")
    print(f"{'cuda / torch':<20}{steps['cuda under simdist'] / steps['torch']:>8.2f}")
    print(
        "\nFSDP2 on the meta device, fully_shard, to_empty, reset_parameters (4 x Linear(64,64)), dgx-h100 nodes"
    )
    print(f"{'ranks':>6}{'wall s':>9}{'simulated ms':>14}{'plain torch x ranks, s':>24}{'ratio':>8}")
    for n, wall, sim_ms, plain in fsdp2_init([8] if args.quick else [8, 32]):
        print(f"{n:>6}{wall:>9.2f}{sim_ms:>14.3f}{plain:>24.4f}{wall / plain:>8.0f}")
    print(
        "\nDDP's construction and one step (the DDP tutorial's model), dgx-h100 nodes: n value reads on each of n "
        "ranks;\nagainst the same run with each wait for the GPU slept at once (two baton hand-offs per read)"
    )
    print(f"{'ranks':>6}{'wall s':>9}{'slept at once, s':>18}{'ratio':>8}{'simulated ms':>14}")
    for n, wall, slept, sim_ms in ddp_construction([32] if args.quick else [64, 128]):
        print(f"{n:>6}{wall:>9.2f}{slept:>18.2f}{slept / wall:>8.2f}{sim_ms:>14.3f}")


if __name__ == "__main__":
    main()
