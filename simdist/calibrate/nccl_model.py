"""Fit NCCL's tuning model (``collective_model="nccl"``) to nccl-tests times: its corrections
(:class:`simdist.algorithms.nccl.Overrides`), a latency added to every call and a factor on each algorithm's
bandwidth, found by coordinate descent on the log errors.

NCCL's model prices a call by the (algorithm, protocol) of least time, ``latency + bytes / bandwidth``; the fit
keeps that structure and NCCL's own figures, and moves only what measurements of one cluster can tell: how much
slower or faster every call starts (the latency, seconds) and how much of NCCL's bandwidth each algorithm reaches
(its factor). Each round searches the latency, then every factor together (where the measurements lie above
every algorithm's time, slowing one alone only hands its sizes to another), then each factor; an algorithm the
tuner never picks at the measured sizes moves with the common factor only.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simdist.algorithms import nccl
from simdist.calibrate.fit import BANDS, Residual
from simdist.calibrate.samples import CalibrationError, Sample, check
from simdist.calibrate.search import bracketed, log_loss
from simdist.network import Cluster
from simdist.network.models import nccl_knows

#: the range the latency correction is searched in, seconds (NCCL's own latencies are 5-50 us)
LATENCY_RANGE = (-20e-6, 200e-6)
#: the range of each algorithm's bandwidth factor
FACTOR_RANGE = (0.1, 10.0)
#: weight of the squared log of each factor added to the loss (a sample off by 10% costs 0.009)
PRIOR = 1e-3
#: rounds of coordinate descent (the corrections settle in two or three on the tables tried)
ROUNDS = 4


@dataclass(frozen=True)
class NcclFit:
    """NCCL's model corrected to the samples, the cluster it times, and each sample beside its prediction."""

    overrides: nccl.Overrides
    cluster: Cluster
    residuals: tuple[Residual, ...]

    def bands(self) -> list[tuple[str, int, float, float]]:
        """(band, samples, median |error|, max |error|) per size band that has samples."""
        out = []
        for i, (label, low) in enumerate(BANDS):
            high = BANDS[i + 1][1] if i + 1 < len(BANDS) else math.inf
            errs = sorted(abs(r.error) for r in self.residuals if low <= r.sample.nbytes < high)
            if errs:
                out.append((label, len(errs), statistics.median(errs), errs[-1]))
        return out

    def report(self) -> str:
        """The corrections and the residuals per size band, as ``simdist calibrate`` prints them."""
        o = self.overrides
        factors = ", ".join(f"{a} x{f:.3g}" for a, f in o.bandwidth) or "none"
        picked = sorted({r.algorithm for r in self.residuals})
        lines = [
            (
                f"fitted NCCL's model on {self.cluster.name!r} ({self.cluster.world_size} x {self.cluster.device_name}): "
                f"latency {o.latency * 1e6:+.2f} us per call, bandwidth factors {factors}"
            ),
            (
                f"collectives: {', '.join(sorted({r.sample.collective for r in self.residuals}))}; "
                f"{len(self.residuals)} samples; NCCL's choices: {', '.join(picked)}"
            ),
            "residuals (predicted vs measured) per size band:",
            f"  {'band':<16} {'samples':>7} {'median':>8} {'max':>8}",
        ]
        for label, count, med, worst in self.bands():
            lines.append(f"  {label:<16} {count:>7} {med:>8.1%} {worst:>8.1%}")
        errs = [abs(r.error) for r in self.residuals]
        lines.append(f"  {'all':<16} {len(errs):>7} {statistics.median(errs):>8.1%} {max(errs):>8.1%}")
        return "\n".join(lines)


def nccl_cluster(device: object, ranks: int, nodes: int, name: str) -> Cluster:
    """The DGX-like cluster of ``ranks`` GPUs ``device`` on ``nodes`` nodes that NCCL's model times."""
    if not nccl_knows(device):
        raise CalibrationError(
            f"NCCL's model is known for {', '.join(nccl.GENERATIONS)} only; --device {getattr(device, 'name', device)!r}"
            f" is not one of them: fit the alpha-beta model (--model alpha-beta)"
        )
    generation = nccl.generation_of(
        getattr(device, "name", None) or Cluster.switch(2, device=device).device_name
    )
    assert generation is not None
    preset = "dgx-h100" if generation.compute_capability >= 90 else "dgx-a100"
    if ranks % nodes:
        raise CalibrationError(
            f"{ranks} ranks over {nodes} nodes: NCCL's model needs the same GPUs in every node"
        )
    cluster = Cluster.preset(preset, world_size=ranks, device=device, gpus_per_node=ranks // nodes, name=name)
    return cluster


def predict(fab: nccl.Fabric, samples: Sequence[Sample]) -> list[nccl.Choice]:
    """NCCL's (corrected) choice and time for each sample."""
    return [nccl.choose(fab, s.collective, s.nbytes) for s in samples]


def fit_nccl(
    samples: Sequence[Sample],
    device: object = "H100",
    name: str = "calibrated",
    what: str = "the measurements",
) -> NcclFit:
    """NCCL's model with the latency and per-algorithm bandwidth factors that best explain ``samples``."""
    rows = check(samples, what)
    other = sorted({s.collective for s in rows} - set(nccl.COLLECTIVES))
    if other:
        raise CalibrationError(
            f"{what}: NCCL's model times {', '.join(c for c in nccl.COLLECTIVES if c != 'barrier')}; "
            f"{', '.join(other)} is not among them: fit the alpha-beta model (--model alpha-beta)"
        )
    cluster = nccl_cluster(device, rows[0].ranks, rows[0].nodes, name)
    base = cluster.nccl_fabric(list(range(cluster.world_size)))
    measured = np.array([s.seconds for s in rows])
    algorithms = sorted(
        {a for s in rows for a, _ in nccl.candidates(base, s.collective)}, key=nccl.ALGORITHMS.index
    )

    def loss(overrides: nccl.Overrides) -> float:
        fab = dataclasses.replace(base, overrides=overrides)
        # a faint pull towards NCCL's own figures: where the times cannot tell (an algorithm no size picks
        # whatever its factor below some value), the factor stays as near 1 as they allow
        prior = PRIOR * sum(math.log(f) ** 2 for _, f in overrides.bandwidth)
        return log_loss(np.array([c.seconds for c in predict(fab, rows)]), measured) + prior

    latency, factors = 0.0, dict.fromkeys(algorithms, 1.0)
    # coordinate descent that keeps a step only where it lowers the loss: NCCL's choice of algorithm changes with
    # the corrections, so the loss has several valleys along each coordinate and a search may land in a worse one
    best = loss(nccl.Overrides(latency, tuple(factors.items())))

    def accept(trial_latency: float, trial: dict[str, float]) -> None:
        # judged as it will be written (rounded): the best point may sit where a choice flips, and rounding
        # after the search could land on the worse side
        nonlocal latency, factors, best
        trial_latency, trial = round(trial_latency, 9), {a: round(f, 3) for a, f in trial.items()}
        value = loss(nccl.Overrides(trial_latency, tuple(trial.items())))
        if value < best:
            latency, factors, best = trial_latency, trial, value

    for _ in range(ROUNDS):

        def shifted(x: float, factors: dict[str, float] = factors) -> float:
            return loss(nccl.Overrides(x, tuple(factors.items())))

        accept(bracketed(shifted, *LATENCY_RANGE, tol=1e-8), factors)

        # every factor together first: where the measured times lie above every algorithm's, slowing one
        # algorithm alone only hands its sizes to another
        def scaled(log_g: float, latency: float = latency, base: dict[str, float] = factors) -> float:
            trial = {a: f * math.exp(log_g) for a, f in base.items()}
            return loss(nccl.Overrides(latency, tuple(trial.items())))

        g = math.exp(bracketed(scaled, -2.0, 2.0))
        accept(latency, {a: min(max(f * g, FACTOR_RANGE[0]), FACTOR_RANGE[1]) for a, f in factors.items()})
        for algo in algorithms:

            def with_factor(
                log_f: float, algo: str = algo, latency: float = latency, factors: dict[str, float] = factors
            ) -> float:
                trial = {**factors, algo: math.exp(log_f)}
                return loss(nccl.Overrides(latency, tuple(trial.items())))

            accept(latency, {**factors, algo: math.exp(bracketed(with_factor, *map(math.log, FACTOR_RANGE)))})
    overrides = nccl.Overrides(
        round(latency, 9), tuple((a, round(f, 3)) for a, f in factors.items() if round(f, 3) != 1)
    )
    cluster.nccl_overrides = overrides
    fab = dataclasses.replace(base, overrides=overrides)
    residuals = tuple(Residual(s, c.label, c.seconds) for s, c in zip(rows, predict(fab, rows)))
    return NcclFit(overrides, cluster, residuals)
