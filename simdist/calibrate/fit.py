"""Fit a cluster's link latency and bandwidth to measured collective times (the alpha-beta model).

Every algorithm's uncontended time is linear in the latency ``α`` of one message's route and the seconds per
byte ``β`` of its bandwidth (``registry``'s closed forms, which simulated runs on an uncontended switch equal),
so for the algorithm ``auto`` picks, a measured time ``t`` gives one linear equation ``a·α + b·β ≈ t``. The fit
minimises the squared *relative* errors (each equation divided by ``t``), so an 8-byte call and a 64 MiB one
weigh the same, then asks ``auto`` again with the fitted prices and refits until its choices stop changing.
The fitted cluster is a switch: every rank one link up to it and one down, each of half the route's latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simdist import algorithms
from simdist.calibrate.medium import MEDIA, check_shared, shared_cluster, shared_terms
from simdist.calibrate.samples import CalibrationError, Sample, check
from simdist.comm.selection import GLOO, GLOO_COPIES
from simdist.network import Cluster
from simdist.network.models import check_collective_model
from simdist.units import MAX_BANDWIDTH, MIN_BANDWIDTH

#: size bands the residuals are reported in: (label, smallest bytes), each up to the next band's start
BANDS = (("< 64 KiB", 0), ("64 KiB - 1 MiB", 64 << 10), ("1 - 16 MiB", 1 << 20), (">= 16 MiB", 16 << 20))
#: a sample this many times slower than the first fit, and off by more than ``OUTLIER_SPREAD`` times the median
#: sample is, while the sizes either side of it are not, is left out as noise: a rank descheduled mid-call
OUTLIER = 2.0
OUTLIER_SPREAD = 4.0
#: refits after which ``auto``'s choices must have settled (they settle in two or three on every input tried)
_MAX_ROUNDS = 20


@dataclass(frozen=True)
class Residual:
    """A sample beside the fitted model's time for it."""

    sample: Sample
    algorithm: str
    predicted: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted / self.sample.seconds - 1.0


@dataclass(frozen=True)
class Fit:
    """The fitted parameters, the cluster they describe, and how well they explain each sample."""

    #: seconds of one message's route between two ranks (alpha)
    alpha: float
    #: bytes/s of a route (1 / beta)
    bandwidth: float
    cluster: Cluster
    residuals: tuple[Residual, ...]
    #: samples left out of the fit as noise: off the first fit by more than ``OUTLIER`` times (a loaded machine)
    outliers: tuple[Sample, ...] = ()
    #: bytes/s at which a rank works through its own memory (gloo's adds and copies); inf where not fitted
    local_bandwidth: float = math.inf
    #: ``switch`` (duplex links) or ``shared`` (one medium every transfer crosses)
    medium: str = "switch"

    def bands(self) -> list[tuple[str, int, float, float]]:
        """(band, samples, median |error|, max |error|) per size band that has samples."""
        out = []
        for i, (label, low) in enumerate(BANDS):
            high = BANDS[i + 1][1] if i + 1 < len(BANDS) else math.inf
            errs = sorted(abs(r.error) for r in self.residuals if low <= r.sample.nbytes < high)
            if errs:
                out.append((label, len(errs), float(np.median(errs)), errs[-1]))
        return out

    def report(self) -> str:
        """The fitted parameters and the residuals per size band, as ``simdist calibrate`` prints them."""
        n = self.cluster.world_size
        kind = "switch cluster" if self.medium == "switch" else "shared medium"
        adds = (
            f", local copies and adds {self.local_bandwidth / 1e9:.4g} GB/s"
            if self.local_bandwidth != math.inf
            else ""
        )
        lines = [
            (
                f"fitted {n}-rank {kind}{' (gloo algorithms)' * (self.cluster.collective_model == 'gloo')}: "
                f"route latency {self.alpha * 1e6:.3f} us, bandwidth "
                f"{self.bandwidth / 1e9:.4g} GB/s (each link: {self.alpha / 2 * 1e6:.3f} us){adds}"
            ),
            f"collectives: {', '.join(sorted({r.sample.collective for r in self.residuals}))}; {len(self.residuals)} samples",
            "residuals (predicted vs measured) per size band:",
            f"  {'band':<16} {'samples':>7} {'median':>8} {'max':>8}",
        ]
        for label, count, med, worst in self.bands():
            lines.append(f"  {label:<16} {count:>7} {med:>8.1%} {worst:>8.1%}")
        errs = [abs(r.error) for r in self.residuals]
        lines.append(f"  {'all':<16} {len(errs):>7} {float(np.median(errs)):>8.1%} {max(errs):>8.1%}")
        if self.outliers:
            shown = "; ".join(f"{o.source} ({o.seconds * 1e6:.3g} us)" for o in self.outliers[:5])
            more = f" and {len(self.outliers) - 5} more" if len(self.outliers) > 5 else ""
            lines.append(
                f"left out as noise ({len(self.outliers)}, over {OUTLIER:g}x slower than the fit): {shown}{more}"
            )
        return "\n".join(lines)


#: collectives in whose time, under gloo's model, each rank works through its own memory (adds, copies): with
#: another collective beside one of them, the samples tell that rate apart from the bytes' on the links
LOCAL_WORK = ("all_reduce", "reduce_scatter", "reduce", "all_gather")


def _terms(
    s: Sample, algorithm: str | None, alpha: float, beta: float, gamma: float = 0.0, medium: str = "switch"
) -> tuple[str, float, float, float]:
    """(algorithm, a, b, c) with the sample's closed-form time ``a·α + b·β + c·γ`` (``γ``: seconds per byte a
    receiver spends adding a reduce message in, gloo's model only); ``auto``'s pick when None, gloo's algorithms
    when ``"gloo"`` (a reduce-scatter is the ring all-reduce of its input, as ProcessGroupGloo runs it)."""
    n, m = s.ranks, float(s.nbytes)
    if medium == "shared":
        return shared_terms(s, alpha, beta, gamma)
    if s.collective == "sendrecv":  # every rank sends m bytes to the next and receives from the previous
        return "sendrecv", 1.0, m, 0.0
    if algorithm == "gloo" and s.collective not in GLOO:
        algorithm = None  # gloo's model runs auto's choice for what gloo has no algorithm of its own for
    if algorithm == "gloo":
        algo = algorithms.get(
            "all_reduce" if s.collective == "reduce_scatter" else s.collective, GLOO[s.collective]
        )
        # a ring all-reduce adds (n-1)/n of the buffer on its critical path, a step at a time; a pipelined ring
        # reduce adds the whole buffer at its root, piece after piece; and ProcessGroupGloo's copies (GLOO_COPIES)
        added = {"all_reduce": (n - 1) / n * m, "reduce_scatter": (n - 1) / n * m, "reduce": m}.get(
            s.collective, 0.0
        )
        copies = sum(GLOO_COPIES[s.collective](n)) * m if s.collective in GLOO_COPIES else 0.0
        return algo.name, algo.estimate(n, m, 1.0, 0.0), algo.estimate(n, m, 0.0, 1.0), added + copies
    if algorithm is None:
        algo = algorithms.choose(s.collective, n, m, (alpha, beta), (alpha, beta))
    else:
        algo = algorithms.get(s.collective, algorithm)
    return algo.name, algo.estimate(n, m, 1.0, 0.0), algo.estimate(n, m, 0.0, 1.0), 0.0


def _solve(columns: np.ndarray) -> np.ndarray:
    """Non-negative ``x`` minimising sum((columns @ x - 1)^2): relative errors, as the rows are divided by t.

    With two or three unknowns every set of them held at zero is tried (the optimum of a convex problem under
    ``x >= 0`` is the unconstrained optimum of the unknowns it leaves free)."""
    k = columns.shape[1]
    ones = np.ones(columns.shape[0])
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 1 << k):
        free = [j for j in range(k) if mask >> j & 1]
        if len(free) == 1:
            col = columns[:, free[0]]
            sub = np.array([col @ ones / (col @ col)])
        else:
            sub, *_ = np.linalg.lstsq(columns[:, free], ones, rcond=None)
        if np.any(sub < 0):
            continue
        x = np.zeros(k)
        x[free] = sub
        loss = float(np.sum((columns @ x - 1.0) ** 2))
        if best is None or loss < best[0]:
            best = (loss, x)
    assert best is not None  # a single column's least-squares value is >= 0 where its entries are
    return best[1]


def fit(
    samples: Sequence[Sample],
    device: str = "cpu",
    name: str = "calibrated",
    algorithm: str | None = None,
    what: str = "the measurements",
    collective_model: str = "alpha-beta",
    medium: str = "switch",
) -> Fit:
    """The cluster whose link latency and bandwidth best explain ``samples`` (``algorithm`` pins the algorithm
    every collective is priced with; ``auto``'s choice by default, as a run makes it).

    ``collective_model="gloo"``: the samples are of torch's gloo backend, priced with the algorithms it runs
    (``simdist.comm.selection.GLOO``), and the written cluster times collectives so; where the samples have
    several collectives, one of which works through the rank's own memory (adds, ProcessGroupGloo's copies), the
    rate of that work is fitted too (``Cluster.local_bandwidth``). ``medium="shared"`` (gloo's model, two ranks): the cluster is one medium
    every transfer crosses (:mod:`simdist.calibrate.medium`), processes on one host; ``"switch"``: duplex links."""
    if medium not in MEDIA:
        raise CalibrationError(f"{what}: medium must be one of {', '.join(MEDIA)}; found {medium!r}")
    if collective_model == "gloo":
        if algorithm is not None:
            raise CalibrationError(f"{what}: the gloo model prices gloo's own algorithms; pin none")
        algorithm = "gloo"
    elif medium == "shared":
        raise CalibrationError(
            f"{what}: a shared medium is fitted under the gloo model (collective_model='gloo', or --model gloo)"
        )
    rows = check(samples, what)
    if medium == "shared":
        check_shared(list(rows), what)
    kinds = {s.collective for s in rows}
    local = algorithm == "gloo" and len(kinds) > 1 and bool(kinds & set(LOCAL_WORK))
    alpha, beta, gamma = _fit_rows(rows, algorithm, local, medium)
    # one refit without the samples the first fit cannot explain at all: noise of a loaded machine
    outliers = _noise(rows, algorithm, (alpha, beta, gamma), medium)
    if outliers:
        rows = check([s for s in rows if s not in outliers], what)
        alpha, beta, gamma = _fit_rows(rows, algorithm, local, medium)
    if beta <= 0:
        raise CalibrationError(
            f"{what}: the times do not grow with the size (the best fit moves bytes in no time); measure up to "
            f"sizes where the bandwidth shows, e.g. 64 MiB"
        )
    bandwidth = 1.0 / beta
    if not MIN_BANDWIDTH <= bandwidth <= MAX_BANDWIDTH:
        raise CalibrationError(
            f"{what}: the fitted bandwidth {bandwidth:g} B/s is outside what a link can have"
        )
    local_bandwidth = 1.0 / gamma if gamma > 0 else math.inf
    if local_bandwidth != math.inf and not MIN_BANDWIDTH <= local_bandwidth <= MAX_BANDWIDTH:
        local_bandwidth = math.inf  # an add that costs next to nothing: free, as without the term
        gamma = 0.0
    n = rows[0].ranks
    if medium == "shared":
        cluster = shared_cluster(n, bandwidth, alpha, device, name)
    else:
        cluster = Cluster.switch(n, bandwidth=bandwidth, latency=alpha / 2, device=device, name=name)
    cluster.collective_model = check_collective_model(collective_model, device)
    cluster.local_bandwidth = local_bandwidth
    residuals = []
    for s in rows:
        algo, a, b, c = _terms(s, algorithm, alpha, beta, gamma, medium)
        residuals.append(Residual(s, algo, a * alpha + b * beta + c * gamma))
    return Fit(alpha, bandwidth, cluster, tuple(residuals), outliers, local_bandwidth, medium)


def _noise(
    rows: Sequence[Sample], algorithm: str | None, params: tuple[float, float, float], medium: str
) -> tuple[Sample, ...]:
    """The samples far slower than the fit whose neighbours in size (same collective) are not: a loaded machine
    only ever adds time, to single calls; a whole range of sizes off the fit is the model's error, kept."""
    slow = {}
    for s in rows:
        _, a, b, c = _terms(s, algorithm, *params, medium)
        slow[s] = math.log(s.seconds / max(a * params[0] + b * params[1] + c * params[2], 1e-30))
    median = float(np.median([abs(v) for v in slow.values()]))
    cut = max(math.log(OUTLIER), OUTLIER_SPREAD * median)
    out = []
    for coll in sorted({s.collective for s in rows}):
        line = sorted((s for s in rows if s.collective == coll), key=lambda s: s.nbytes)
        for i, s in enumerate(line):
            neighbours = line[max(0, i - 1) : i] + line[i + 1 : i + 2]
            if slow[s] > cut and all(slow[o] < cut / 2 for o in neighbours):
                out.append(s)
    return tuple(out)


def _fit_rows(
    rows: Sequence[Sample], algorithm: str | None, local: bool, medium: str
) -> tuple[float, float, float]:
    """(α, β, γ) fitted to ``rows`` (γ only where ``local``, else 0), refitting until ``auto``'s choices (and
    the branches of the shared medium's closed forms) at the fitted prices stop changing."""
    t = np.array([s.seconds for s in rows])
    params = (50e-6, 1e-9, 0.0)  # a starting guess; the choices it implies are refitted below
    choices: list[tuple[str, float, float, float]] | None = None
    for _ in range(_MAX_ROUNDS):
        terms = [_terms(s, algorithm, *params, medium) for s in rows]
        if terms == choices:
            break
        choices = terms
        columns = [[a for _, a, _, _ in terms], [b for _, _, b, _ in terms]]
        if local:
            columns.append([c for _, _, _, c in terms])
        x = _solve(np.array(columns).T / t[:, None])
        params = (float(x[0]), float(x[1]), float(x[2]) if local else 0.0)
    return params
