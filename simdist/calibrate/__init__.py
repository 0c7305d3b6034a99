"""Fit a cluster file to measurements: nccl-tests output, a real run's timeline, or a sweep on this machine.

    from simdist import calibrate
    samples = calibrate.read_nccl_tests("all_reduce.txt") + calibrate.read_nccl_tests("all_gather.txt")
    fit = calibrate.fit(samples, device="H100")
    print(fit.report())            # fitted latency and bandwidth, residuals per size band
    fit.cluster.save("mine.toml")  # simdist.Cluster.from_file("mine.toml") loads it

``samples`` holds the measurements and refuses what a fit cannot trust; ``nccltests`` reads nccl-tests' text,
``records`` a real timeline, ``measure`` times a sweep on real gloo processes, ``fit`` fits the alpha-beta model,
``nccl_model`` fits NCCL's model's corrections to nccl-tests times,
``device`` fits a device's compute figures to a torch profiler trace (``calls`` rebuilds its ops on meta tensors).
"""

from __future__ import annotations

from pathlib import Path

from simdist.calibrate.device import DeviceFit, PricedOp, fit_device, predict
from simdist.calibrate.fit import BANDS, Fit, Residual, fit
from simdist.calibrate.measure import measure
from simdist.calibrate.nccl_model import NcclFit, fit_nccl
from simdist.calibrate.nccltests import BINARIES
from simdist.calibrate.nccltests import read as parse_nccl_tests
from simdist.calibrate.records import samples as timeline_samples
from simdist.calibrate.samples import FITTED, CalibrationError, Sample
from simdist_base.timeline import TimelineError
from simdist_base.timeline import load as load_timeline


def read_nccl_tests(path: str | Path, collective: str | None = None, in_place: bool = False) -> list[Sample]:
    """The samples of the nccl-tests output saved at ``path`` (out-of-place times, or in-place)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    return parse_nccl_tests(text, str(path), collective, in_place)


def read_timeline(directory: str | Path) -> list[Sample]:
    """The samples of a real run's timeline directory (``real.run(..., timeline=DIR)``)."""
    try:
        timeline = load_timeline(directory)
    except TimelineError as exc:
        raise CalibrationError(str(exc)) from None
    return timeline_samples(timeline, str(directory))


__all__ = [
    "BANDS",
    "BINARIES",
    "FITTED",
    "CalibrationError",
    "DeviceFit",
    "Fit",
    "NcclFit",
    "PricedOp",
    "Residual",
    "Sample",
    "fit",
    "fit_device",
    "fit_nccl",
    "measure",
    "parse_nccl_tests",
    "predict",
    "read_nccl_tests",
    "read_timeline",
    "timeline_samples",
]
