"""simdist calibrate end to end on this machine: fit a cluster to gloo collectives measured on real processes,
then predict what the fit never saw (other sizes, other collectives, a DDP training step) and print the errors.

Prints figures; it is not a test. Usage: ``python benchmarks/calibrate_localhost.py [--ranks 2] [--iters 15]
[--fit all_reduce [--fit all_reduce,broadcast,all_gather ...]] [--medium switch,shared]``.

1. ``simdist.calibrate.measure`` times all-reduce, broadcast, all-gather and reduce-scatter at 8 B to 8 MiB
   (x2 apart) on ``--ranks`` real gloo processes (the lower quartile of each size's calls, each call's time the
   slowest rank's), and a DDP step (below) is timed.
2. Each fit sees the collectives of a ``--fit`` (default: all-reduce, what DDP runs) at every other size (8 B,
   32 B, ... x4 apart) only, under ``--model`` on each ``--medium`` (``shared``: one medium that both directions
   take turns on, as the processes of one host do); with several collectives in a ``--fit``, the rate of gloo's
   own adds and copies is fitted too. Every fit is made from the same measurements.
3. simdist then simulates, on the fitted cluster file, those collectives at the sizes in between, the other
   collectives at every size, and a step of torch's DistributedDataParallel on an MLP; each prediction is set
   beside its measurement.

The DDP step: each rank measures its own forward, backward and optimizer step without synchronisation
(``no_sync``) and the step with it; the simulated step charges the measured compute (``simdist.charge``) and times DDP's
all-reduces on the fitted cluster, so its error is the communication's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import real
import simdist
from simdist import calibrate
from simdist.bench import bench
from simdist.network import Cluster

SIZES = tuple(8 << k for k in range(21))  # 8 B .. 8 MiB
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
WIDTH, DEPTH, BATCH = 512, 4, 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def ddp_rank(steps: int, warmup: int, measured_compute: float | None) -> tuple[list[float], list[float]]:
    """(compute-only step seconds, DDP step seconds) of this rank; in simdist, ``measured_compute`` is charged."""
    torch.set_num_threads(1)
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, WIDTH)
    clock = simdist.now if measured_compute is not None else time.perf_counter
    compute, step = [], []
    for i in range(warmup + steps):
        if measured_compute is None:
            dist.barrier()
            t0 = clock()
            with model.no_sync():
                model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            t1 = clock()
            if i >= warmup:
                compute.append(t1 - t0)
        dist.barrier()
        t0 = clock()
        if measured_compute is not None:
            simdist.charge(measured_compute)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            step.append(clock() - t0)
    return compute, step


def _quartile(values: list[float]) -> float:
    return sorted(values)[len(values) // 4]


def main() -> None:
    """Measure, fit, predict, print."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument(
        "--fit",
        action="append",
        help="the collectives the fit sees (comma-separated; default all_reduce); given again, another fit",
    )
    p.add_argument(
        "--model", default="gloo", choices=("gloo", "alpha-beta"), help="the collective model fitted"
    )
    p.add_argument(
        "--medium",
        default="switch",
        help="gloo's model: switch (duplex links through a switch), shared (one medium both directions take turns "
        "on), or both comma-separated: each fit on each, from the same measurements",
    )
    args = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} "
          f"(1-minute average), torch {torch.__version__}, {args.ranks} gloo processes")  # fmt: skip
    measured = calibrate.measure(args.ranks, COLLECTIVES, SIZES, iters=args.iters)
    res = real.run(ddp_rank, args.ranks, "gloo", args=(args.steps, 3, None))
    compute = statistics.median(_quartile(c) for c, _ in res.returns)
    real_step = _quartile([max(r[1][k] for r in res.returns) for k in range(args.steps)])
    print(f"DDP step ({DEPTH} x Linear({WIDTH}), {sum(p.numel() for p in _model().parameters())} parameters): "
          f"measured {real_step * 1e3:.2f} ms (compute {compute * 1e3:.2f} ms); load now {os.getloadavg()[0]:.1f}")  # fmt: skip
    summary = []
    for fit_arg in args.fit or ["all_reduce"]:
        for medium in args.medium.split(","):
            fitted = tuple(fit_arg.split(","))
            errors = _predict(args, measured, fitted, medium, compute, real_step)
            summary.append((medium, fit_arg, errors))
    print("\nsummary: median |error| (signed median per collective)")
    for medium, fit_arg, errors in summary:
        parts = [
            f"{k} {statistics.median(map(abs, v)):.1%}"
            + (f" ({statistics.median(v):+.0%})" if k in COLLECTIVES else "")
            for k, v in errors.items()
            if k != "DDP step"
        ]
        parts.append(f"DDP step {errors['DDP step'][0]:+.1%}")
        print(f"  {args.model} {medium}, fit sees {fit_arg}: " + ", ".join(parts))


def _predict(
    args: argparse.Namespace,
    measured: list[calibrate.Sample],
    fitted: tuple[str, ...],
    medium: str,
    compute: float,
    real_step: float,
) -> dict[str, list[float]]:
    """Fit ``fitted`` at every other size on ``medium``, predict the rest and the DDP step; the signed errors."""
    seen = [s for s in measured if s.collective in fitted and SIZES.index(s.nbytes) % 2 == 0]
    fit = calibrate.fit(seen, device="cpu", name="localhost", collective_model=args.model, medium=medium)
    print(f"\n--- {args.model} model, {medium} medium, fit sees {', '.join(fitted)}")
    print(fit.report())
    with tempfile.TemporaryDirectory() as tmp:
        fit.cluster.save(f"{tmp}/localhost.toml")
        cluster = Cluster.from_file(f"{tmp}/localhost.toml")
    errors: dict[str, list[float]] = {}
    print("held out: predicted vs measured")
    print(f"  {'collective':<15} {'bytes':>9} {'measured us':>12} {'predicted us':>13} {'error':>8}")
    for collective in COLLECTIVES:
        rows = {r.size: r.time_us * 1e-6 for r in bench(cluster, collective, SIZES[0], SIZES[-1], 2)}
        for s in measured:
            if s.collective != collective or s in seen or s.nbytes not in rows:
                continue
            err = rows[s.nbytes] / s.seconds - 1
            kind = "other sizes" if collective in fitted else "other collectives"
            errors.setdefault(kind, []).append(err)
            errors.setdefault(collective, []).append(err)
            print(
                f"  {collective:<15} {s.nbytes:>9} {s.seconds * 1e6:>12.1f} {rows[s.nbytes] * 1e6:>13.1f} {err:>+8.1%}"
            )
    sim = simdist.run(ddp_rank, cluster, args=(args.steps, 3, compute), compute=False)
    sim_step = statistics.median(max(r[1][k] for r in sim.returns) for k in range(args.steps))
    errors["DDP step"] = [sim_step / real_step - 1]
    errors["all"] = [e for k in ("other sizes", "other collectives", "DDP step") for e in errors.get(k, [])]
    print(f"DDP step predicted {sim_step * 1e3:.2f} ms, error {sim_step / real_step - 1:+.1%}")
    print("median |error| of the predictions:")
    for kind, errs in errors.items():
        print(f"  {kind:<18} {len(errs):>3} predictions  {statistics.median(map(abs, errs)):>6.1%}  "
              f"(signed median {statistics.median(errs):+.1%})")  # fmt: skip
    return errors


if __name__ == "__main__":
    main()
