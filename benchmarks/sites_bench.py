"""Call-site cost: wall microseconds simdist spends finding the call site of each operation it issues.

Prints figures; it is not a test. Usage: ``PYTHONPATH=. python benchmarks/sites_bench.py`` from the repository root.

Two programs at 2 ranks, races off: 2000 ``dist.all_reduce`` calls from user code (the site is the user's line;
the walk passes simdist's and torch's c10d frames), and torch's ``ScheduleGPipe`` over a traced 4-layer MLP
(its transfers are issued inside torch, so the site names torch's line and the user's). Each call of
``RunContext.call_site`` is timed with ``time.perf_counter_ns`` around it (the timer adds ~0.1 us).
"""

from __future__ import annotations

import platform
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

import simdist
from simdist.comm import context

CALLS = 2000


def _all_reduces() -> None:
    t = torch.ones(1)
    for _ in range(CALLS):
        dist.all_reduce(t)


def _gpipe() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    x, y = torch.randn(64, 8), torch.randn(64, 8)
    pipe = pipeline(model, mb_args=(x.chunk(32)[0],), split_spec={"2": SplitPoint.BEGINNING})
    schedule = ScheduleGPipe(pipe.build_stage(rank, torch.device("cpu")), 32, loss_fn=F.mse_loss)
    for _ in range(4):
        schedule.step(x) if rank == 0 else schedule.step(target=y)


_TIMED = """
def timed(self):
    t0 = time.perf_counter_ns()
    site = original(self)
    spent[0] += time.perf_counter_ns() - t0
    sites.append(site)
    return site
"""


def site_us(fn: object) -> tuple[float, int, str]:
    """(mean wall us per call_site, calls, one site) over one run of ``fn`` at 2 ranks; best of 3 runs."""
    original = context.RunContext.call_site
    best: tuple[float, int, str] | None = None
    for _ in range(3):
        spent: list[int] = [0]
        sites: list[str] = []
        scope = {"time": time, "original": original, "spent": spent, "sites": sites}
        # compiled as if in simdist's comm package, so the site walk passes over the timer's frame too
        exec(compile(_TIMED, context.__file__, "exec"), scope)  # noqa: S102
        context.RunContext.call_site = scope["timed"]  # type: ignore[method-assign]
        try:
            simdist.run(fn, simdist.Cluster.switch(2, device="cpu"), races="off")  # type: ignore[arg-type]
        finally:
            context.RunContext.call_site = original  # type: ignore[method-assign]
        got = (spent[0] / len(sites) / 1e3, len(sites), str(sites[-1]))
        best = got if best is None or got[0] < best[0] else best
    assert best is not None
    return best


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch's tracer warns about its own pytree internals
    print(f"machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}")
    for name, fn in (("dist.all_reduce from user code", _all_reduces), ("torch's ScheduleGPipe", _gpipe)):
        us, calls, site = site_us(fn)
        print(f"{name:32s} {us:6.2f} us per call site ({calls} sites); e.g. {site}")


if __name__ == "__main__":
    main()
