"""The equivalence oracle on real processes: the parallel program's final state against its reference's.

Each rank process runs the program under the oracle's capture (:class:`simdist.oracle.Capture`) and returns
what it held after its last optimizer step; the reference runs in this process on one simulated rank. The
comparison is the oracle's, on that last step only: a real run has no replay, so no step-by-step search and no
localisation (run the same program under :func:`simdist.check_equivalence` for those).
:func:`check_final_states` checks several programs on one launch, each rank process running them in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


def final_state(
    fn: Callable[..., Any], seed: int, args: tuple, kwargs: dict[str, Any]
) -> tuple[int, RankStep | None]:
    """Run ``fn`` in this rank process under the capture; (steps taken, the state after the last one)."""
    torch.manual_seed(seed)  # as simdist seeds every rank
    capture = Capture()
    with capture.installed():
        fn(*args, **kwargs)
    steps = capture.ranks.get(dist.get_rank() if dist.is_initialized() else 0, [])
    return len(steps), (steps[-1] if steps else None)


def final_states(
    runs: list[tuple[Callable[..., Any], int, tuple, dict[str, Any]]],
) -> list[tuple[int, RankStep | None]]:
    """:func:`final_state` of each (fn, seed, args, kwargs) in turn, in this rank process."""
    return [final_state(*run) for run in runs]


@dataclass(frozen=True)
class FinalStateCheck:
    """One program for :func:`check_final_states`: its fields mean what :func:`check_final_state`'s keywords
    of the same names mean."""

    parallel: Callable[..., Any]
    reference: Callable[..., Any]
    seed: int = 0
    args: tuple = ()
    kwargs: dict[str, Any] | None = None
    reference_args: tuple | None = None
    reference_kwargs: dict[str, Any] | None = None
    exact: bool = False
    tolerances: Mapping[torch.dtype, Tolerance] | None = None
    names: Mapping[str, str] | Callable[[str], str | None] | None = None
    ignore: tuple[str, ...] | list[str] = ()
    shards: Mapping[str, int | tuple[int, int]] | None = None
    loss: str | None = "mean"
    options: OracleOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # checked here, before any process starts
        options = OracleOptions(
            exact=self.exact,
            tolerances=self.tolerances,
            names=self.names,
            ignore=self.ignore,
            shards=self.shards,
            loss=self.loss,
        )
        object.__setattr__(self, "options", options)


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
    processes by reference, as :func:`real.run` requires (a top-level function), and ``emulate_cuda`` what it
    means there (a program written for GPUs on a machine without them). The report's ``steps`` is the number of
    steps taken; a divergence is reported at the last one.
    """
    check = FinalStateCheck(
        parallel,
        reference,
        seed,
        args,
        kwargs,
        reference_args,
        reference_kwargs,
        exact,
        tolerances,
        names,
        ignore,
        shards,
        loss,
    )
    return check_final_states([check], nproc, backend=backend, timeout=timeout, emulate_cuda=emulate_cuda)[0]


def check_final_states(
    checks: Sequence[FinalStateCheck],
    nproc: int,
    *,
    backend: str | None = "gloo",
    timeout: float = 300.0,
    emulate_cuda: bool | EmulatedCuda = False,
) -> list[EquivalenceReport]:
    """:func:`check_final_state` of each of ``checks`` on one launch of ``nproc`` real processes: each rank
    process runs the programs in turn (each from ``torch.manual_seed`` of its seed), one report per check.

    A launch costs more than a small program (each process starts torch); the programs share the processes and
    their default group, so one that raises fails the launch: check such a program alone.
    """
    checks = list(checks)
    if not all(isinstance(c, FinalStateCheck) for c in checks):
        raise TypeError(f"checks must be real.oracle.FinalStateCheck objects; got {checks!r}")
    runs = [(c.parallel, c.seed, c.args, c.kwargs or {}) for c in checks]
    got = real_run(final_states, nproc, backend, args=(runs,), timeout=timeout, emulate_cuda=emulate_cuda)
    return [_compared(c, [returns[k] for returns in got.returns], nproc) for k, c in enumerate(checks)]


def _compared(
    check: FinalStateCheck, got: list[tuple[int, RankStep | None]], nproc: int
) -> EquivalenceReport:
    """The report of ``check`` whose ranks returned ``got`` (steps taken, last state): its reference run here."""
    capture = Capture()
    # the capture sees the reference's rank alone: checks and plain runs in other threads stay out of it
    with capture.installed(everywhere=False):
        ref = sim_run(
            capture.bind(check.reference),
            Cluster.switch(1, device="cpu"),
            seed=check.seed,
            races="off",
            compute=False,
            args=check.args if check.reference_args is None else check.reference_args,
            kwargs=check.kwargs if check.reference_kwargs is None else check.reference_kwargs,
        )
    ref_steps = capture.ranks.get(0, [])
    counts = {rank: n for rank, (n, _) in enumerate(got)}
    comparison = Comparison.of(check.options)
    last = len(ref_steps) - 1
    if set(counts.values()) != {len(ref_steps)}:
        text = ", ".join(f"rank {r}: {n}" for r, n in counts.items())
        divergences = [
            Divergence(
                max(last, 0),
                "steps",
                "steps",
                (),
                None,
                f"optimizer steps taken differ ({text}; the reference: {len(ref_steps)})",
            )
        ]
    else:
        divergences = comparison.step(last, {r: s for r, (_, s) in enumerate(got)}, ref_steps[last])
    return EquivalenceReport(
        steps=len(ref_steps),
        divergences=divergences,
        localization=None,
        parallel=None,
        reference=ref,
        world_size=nproc,
        exact=check.options.exact,
        compared=comparison.counts,
        parallel_name=getattr(check.parallel, "__qualname__", "parallel"),
        reference_name=getattr(check.reference, "__qualname__", "reference"),
        localization_note="real runs are compared at their last step only; localise under simdist.check_equivalence",
    )
