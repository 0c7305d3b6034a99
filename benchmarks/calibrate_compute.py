"""simdist calibrate --compute: how well a device fitted to one profiler trace predicts what it never saw.

Prints figures; it is not a test. Usage: ``python benchmarks/calibrate_compute.py [--runs 7]``.

1. This machine's CPU: a torch profiler trace (CPU activity, shapes recorded) of two steps of an MLP
   (3 x Linear(256) + GELU + LayerNorm, batch 64, SGD) is fitted; the fitted device then prices steps of MLPs
   of other widths and batches (``simdist.compute.estimate``), each beside its measured time (the fastest of
   ``--runs`` steps, one thread: a loaded machine only ever adds time).
2. A public GPU trace: HTA's sampled rank-0 trace of a 128-rank training job
   (``tests/data/profiles/hta_sampled_rank0.json.gz``) is fitted onto the A100 on every other op, and the
   fitted device prices the ops in between.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from simdist import calibrate
from simdist.compute import estimate
from simdist.compute.profile import parse_trace

HTA = Path(__file__).resolve().parent.parent / "tests" / "data" / "profiles" / "hta_sampled_rank0.json.gz"
FITTED = (256, 64)
OTHERS = ((128, 32), (256, 256), (512, 64), (512, 128), (1024, 16), (1024, 64))


def mlp_step(width: int, batch: int) -> Callable[[], None]:
    """One training step of a 3-layer MLP of ``width`` on a batch of ``batch``."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, width)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def fastest(step: Callable[[], None], runs: int) -> float:
    """The fastest of ``runs`` calls of ``step`` after two untimed ones, in seconds."""
    step()
    step()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times)


def kinds(ops: Sequence[calibrate.PricedOp]) -> None:
    """Print the median |error| and the totals per op kind."""
    print(f"  {'kind':<19} {'ops':>5} {'median':>8} {'measured':>11} {'predicted':>11} {'total error':>12}")
    for kind in (*calibrate.device.KINDS, "all"):
        sel = [o for o in ops if kind in ("all", o.kind)]
        if sel:
            m, p = sum(o.measured for o in sel), sum(o.predicted for o in sel)
            med = statistics.median(abs(o.error) for o in sel)
            print(
                f"  {kind:<19} {len(sel):>5} {med:>8.1%} {m * 1e3:>9.3f}ms {p * 1e3:>9.3f}ms {p / m - 1:>+12.1%}"
            )


def cpu(runs: int) -> None:
    """Fit this CPU to a trace of one MLP step, then predict others."""
    torch.set_num_threads(1)
    step = mlp_step(*FITTED)
    step()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/step.json"
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        ) as p:
            step()
            step()
        p.export_chrome_trace(path)
        fit = calibrate.fit_device(path)
    print(fit.report().replace(path, "the trace"))
    print(f"\npredicted vs measured steps (width x batch; the fit saw {FITTED[0]} x {FITTED[1]}):")
    errors = []
    for width, batch in (FITTED, *OTHERS):
        measured = fastest(mlp_step(width, batch), runs)
        predicted = estimate(mlp_step(width, batch), device=fit.device)[0]
        err = predicted / measured - 1
        if (width, batch) != FITTED:
            errors.append(abs(err))
        print(f"  {width:>5} x {batch:<4} measured {measured * 1e3:8.3f} ms  predicted {predicted * 1e3:8.3f} ms  "
              f"{err:+7.1%}")  # fmt: skip
    print(
        f"  median |error| of the {len(errors)} programs the fit did not see: {statistics.median(errors):.1%}"
    )


def gpu() -> None:
    """Fit the A100 to every other op of HTA's trace and predict the rest."""
    trace = parse_trace(HTA)
    print(calibrate.fit_device(trace, base="A100").report().replace(str(HTA), HTA.name))
    seen = calibrate.fit_device(dataclasses.replace(trace, ops=trace.ops[0::2]), base="A100")
    held_out = calibrate.predict(dataclasses.replace(trace, ops=trace.ops[1::2]), seen.device)
    print("\nfitted on every other op, the ops in between:")
    kinds(held_out)


def main() -> None:
    """Measure, fit, predict, print."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} "
          f"(1-minute average), torch {torch.__version__}\n")  # fmt: skip
    cpu(args.runs)
    print()
    gpu()


if __name__ == "__main__":
    main()
