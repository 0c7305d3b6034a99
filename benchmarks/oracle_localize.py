"""Wall time of localisation against a plain simulated run: one small MLP training step on 4 ranks.

Prints the median of a few repetitions of: the plain data-parallel run (``simdist.run``), the same run with
every rank recording its ops (the recorded rerun), the recorded one-rank reference run, and the whole
:func:`simdist.oracle.localize.localize` call (both recorded runs, alignment and comparison), each with its
ratio to the plain run. The target is at most 4x for the whole localisation.

    python3 benchmarks/oracle_localize.py [--width 256] [--layers 4] [--batch 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import simdist
from simdist.oracle.localize import localize
from simdist.oracle.record import Recorder, recording, wrap


def make(width: int, layers: int, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The MLP and a full batch, seeded."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 10)), torch.randn(batch, width), torch.randn(batch, 10)


def reference(width: int, layers: int, batch: int) -> None:
    """One SGD step on the full batch."""
    model, x, y = make(width, layers, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def parallel(width: int, layers: int, batch: int) -> None:
    """One data-parallel SGD step: each rank its rows, gradients all-reduced and averaged."""
    model, x, y = make(width, layers, batch)
    r, n = dist.get_rank(), dist.get_world_size()
    b = batch // n
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nn.functional.mse_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n
    opt.step()


def median_seconds(body: Callable[[], object], repeat: int) -> float:
    """Median wall-clock seconds of ``repeat`` calls of ``body`` (after one warm-up call)."""
    body()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        body()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def recorded(fn: Callable[..., None], cluster: simdist.Cluster, kwargs: dict) -> None:
    recorders: dict[int, Recorder] = {}
    with recording():
        simdist.run(wrap(fn, 0, recorders, dist.get_rank), cluster, kwargs=kwargs, races="off")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    kwargs = {"width": a.width, "layers": a.layers, "batch": a.batch}
    cluster = simdist.Cluster.switch(a.ranks, device="H100")
    one = simdist.Cluster.switch(1, device="H100")
    rows = [
        ("plain run", lambda: simdist.run(parallel, cluster, kwargs=kwargs, races="off")),
        ("recorded rerun", lambda: recorded(parallel, cluster, kwargs)),
        ("recorded reference", lambda: recorded(reference, one, kwargs)),
        (
            "localize (both reruns, alignment)",
            lambda: localize(parallel, reference, cluster, 0, kwargs=kwargs, run_options={"races": "off"}),
        ),
        # again last: the machine's load may have changed while the others ran
        ("plain run (again)", lambda: simdist.run(parallel, cluster, kwargs=kwargs, races="off")),
    ]
    print(f"MLP {a.layers}x{a.width}, batch {a.batch}, {a.ranks} ranks on {cluster.device}, one SGD step; "
          f"median of {a.repeat}")
    base = None
    for name, body in rows:
        s = median_seconds(body, a.repeat)
        base = base or s
        print(f"  {name:36s} {s * 1e3:8.1f} ms  {s / base:5.2f}x")


if __name__ == "__main__":
    main()
