"""The equivalence oracle on real processes: the parallel program's final state against its reference's.

Each rank process runs the program under the oracle's capture (:class:`simdist.oracle.Capture`) and returns
what it held after its last optimizer step; the reference runs in this process on one simulated rank. The
comparison is the oracle's, on that last step only: a real run has no replay, so no step-by-step search and no
localisation (run the same program under :func:`simdist.check_equivalence` for those).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from real.emulated_cuda import EmulatedCuda
from real.launcher import run as real_run
from simdist.engine.runner import run as sim_run
from simdist.network.cluster import Cluster
from simdist.options import OracleOptions
from simdist.oracle.capture import Capture, RankStep
from simdist.oracle.check import Comparison
from simdist.oracle.report import Divergence, EquivalenceReport
from simdist.oracle.tolerance import Tolerance


def final_state(fn: Callable[..., Any], seed: int, args: tuple, kwargs: dict[str, Any]) -> tuple[int, RankStep | None]:
    """Run ``fn`` in this rank process under the capture; (steps taken, the state after the last one)."""
    torch.manual_seed(seed)  # as simdist seeds every rank
    capture = Capture()
    with capture.installed():
        fn(*args, **kwargs)
    steps = capture.ranks.get(dist.get_rank() if dist.is_initialized() else 0, [])
    return len(steps), (steps[-1] if steps else None)


def check_final_state(
    parallel: Callable[..., Any],
    reference: Callable[..., Any],
    nproc: int,
    *,
    backend: str | None = "gloo",
    seed: int = 0,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    reference_args: tuple | None = None,
    reference_kwargs: dict[str, Any] | None = None,
    exact: bool = False,
    tolerances: Mapping[torch.dtype, Tolerance] | None = None,
    names: Mapping[str, str] | Callable[[str], str | None] | None = None,
    ignore: tuple[str, ...] | list[str] = (),
    shards: Mapping[str, int | tuple[int, int]] | None = None,
    loss: str | None = "mean",
    timeout: float = 300.0,
    emulate_cuda: bool | EmulatedCuda = False,
) -> EquivalenceReport:
    """Run ``parallel`` on ``nproc`` real processes, ``reference`` on one simulated rank; compare their last steps.

    The arguments mean what they mean for :func:`simdist.check_equivalence`; ``parallel`` must reach the
    processes by reference, as :func:`real.run` requires (a top-level function). The report's ``steps`` is the
    number of steps taken; a divergence is reported at the last one. ``backend`` and ``emulate_cuda`` are
    :func:`real.run`'s: a program written for GPUs runs on a machine without them with ``backend="nccl",
    emulate_cuda=True``.
    """
    opts = OracleOptions(exact=exact, tolerances=tolerances, names=names, ignore=ignore, shards=shards, loss=loss)
    got = real_run(final_state, nproc, backend, args=(parallel, seed, args, kwargs or {}), timeout=timeout,
                   emulate_cuda=emulate_cuda)
    capture = Capture()
    # the capture sees the reference's rank alone: checks and plain runs in other threads stay out of it
    with capture.installed(everywhere=False):
        ref = sim_run(
            capture.bind(reference), Cluster.switch(1, device="cpu"), seed=seed, races="off", compute=False,
            args=args if reference_args is None else reference_args,
            kwargs=kwargs if reference_kwargs is None else reference_kwargs,
        )
    ref_steps = capture.ranks.get(0, [])
    counts = {rank: n for rank, (n, _) in enumerate(got.returns)}
    comparison = Comparison.of(opts)
    last = len(ref_steps) - 1
    if set(counts.values()) != {len(ref_steps)}:
        text = ", ".join(f"rank {r}: {n}" for r, n in counts.items())
        divergences = [Divergence(max(last, 0), "steps", "steps", (), None,
                                  f"optimizer steps taken differ ({text}; the reference: {len(ref_steps)})")]
    else:
        divergences = comparison.step(last, {r: s for r, (_, s) in enumerate(got.returns)}, ref_steps[last])
    return EquivalenceReport(
        steps=len(ref_steps), divergences=divergences, localization=None, parallel=None, reference=ref,
        world_size=nproc, exact=opts.exact, compared=comparison.counts,
        parallel_name=getattr(parallel, "__qualname__", "parallel"),
        reference_name=getattr(reference, "__qualname__", "reference"),
        localization_note="real runs are compared at their last step only; localise under simdist.check_equivalence",
    )
