"""``simdist calibrate``: fit a cluster file to nccl-tests output, real timelines or a sweep on this machine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simdist.algorithms import nccl
from simdist.calibrate import read_nccl_tests, read_timeline
from simdist.calibrate.device import DeviceFit, fit_device
from simdist.calibrate.fit import Fit, fit
from simdist.calibrate.measure import measure
from simdist.calibrate.medium import MEDIA
from simdist.calibrate.nccl_model import NcclFit, fit_nccl
from simdist.calibrate.nccltests import BINARIES
from simdist.calibrate.samples import FITTED, CalibrationError, Sample
from simdist.compute.devicefile import device_config
from simdist.compute.devices import DeviceSpec, get_device
from simdist.compute.profile import parse_trace
from simdist.network import Cluster
from simdist.network.models import nccl_knows
from simdist.units import parse_size


def add_parser(sub: Any, output_file: Callable[[str], Path]) -> None:
    """Add ``calibrate`` to the subcommands ``sub``; ``output_file`` checks the file to write."""
    c = sub.add_parser(
        "calibrate", help="fit a cluster file to nccl-tests output, real timelines or --measure"
    )
    c.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="an nccl-tests output file (all_reduce_perf ... > FILE), or a real timeline directory",
    )
    c.add_argument(
        "-o",
        "--output",
        type=output_file,
        default=None,
        metavar="FILE.toml",
        help="write the fitted cluster here (.toml or .json); Cluster.from_file loads it",
    )
    c.add_argument(
        "--measure",
        action="store_true",
        help="also time a sweep of collectives on real gloo processes of this machine",
    )
    c.add_argument("--world-size", type=int, default=2, help="ranks of the --measure sweep (default: 2)")
    c.add_argument(
        "--sizes",
        default="8:2M",
        metavar="MIN:MAX",
        help="the --measure sweep's sizes, x4 apart (default: 8:2M)",
    )
    c.add_argument(
        "--collective",
        default=None,
        choices=sorted(set(BINARIES.values()) & set(FITTED)),
        help="the collective of nccl-tests files whose text does not name its binary",
    )
    c.add_argument(
        "--in-place", action="store_true", help="fit nccl-tests' in-place times (default: out-of-place)"
    )
    c.add_argument(
        "--compute",
        default=None,
        metavar="TRACE.json",
        help="also fit the device's compute figures to a torch profiler trace (Kineto JSON) of one rank's step",
    )
    c.add_argument(
        "--cluster",
        default=None,
        metavar="SPEC",
        help="with --compute and no network input: the cluster (preset or file) to put the fitted device in",
    )
    c.add_argument(
        "--device",
        default="cpu",
        help="the fitted cluster's device model, or the base device a GPU trace is fitted onto (default: cpu)",
    )
    c.add_argument("--name", default="calibrated", help="the fitted cluster's name")
    c.add_argument(
        "--model",
        default="auto",
        choices=("auto", "nccl", "gloo", "alpha-beta"),
        help="the collective model fitted: NCCL's (auto: where the device is one it knows), gloo's (auto: a "
        "--measure sweep alone) or alpha-beta links",
    )
    c.add_argument(
        "--medium",
        default="switch",
        choices=MEDIA,
        help="gloo's model: the ranks joined by duplex links through a switch (default), or one medium every "
        "transfer crosses, both ways (processes on one host, 2 ranks)",
    )
    c.set_defaults(func=cmd_calibrate)


def _sizes(text: str) -> tuple[int, ...]:
    low, sep, high = text.partition(":")
    if not sep:
        raise CalibrationError(f"--sizes {text!r}: expected MIN:MAX, e.g. 8:2M")
    lo, hi = (parse_size(t if t[-1:].isdigit() or t.endswith("B") else t + "iB") for t in (low, high))
    if not 1 <= lo < hi:
        raise CalibrationError(f"--sizes {text!r}: expected 1 <= MIN < MAX")
    out = [lo]
    while out[-1] * 4 <= hi:
        out.append(out[-1] * 4)
    return tuple(out)


def gather(args: argparse.Namespace) -> list[Sample]:
    """The samples the command line names (files, timeline directories, a sweep)."""
    from_inputs: list[Sample] = []
    for name in args.inputs:
        path = Path(name)
        if path.is_dir():
            from_inputs += read_timeline(path)
        else:
            from_inputs += read_nccl_tests(path, args.collective, args.in_place)
    if args.measure:
        if args.world_size < 2:
            raise CalibrationError(f"--world-size {args.world_size}: the sweep needs at least 2 ranks")
        from_inputs += measure(args.world_size, sizes=_sizes(args.sizes))
    if not args.inputs and not args.measure and args.compute is None:
        raise CalibrationError(
            "give nccl-tests output files, real timeline directories, --measure, or --compute TRACE.json"
        )
    return from_inputs


def _device_fit(args: argparse.Namespace) -> DeviceFit | None:
    """The device fitted to ``--compute``'s trace (onto ``--device`` for a GPU trace), or None without one."""
    if args.compute is None:
        return None
    trace = parse_trace(args.compute)
    if trace.kind == "cpu":
        if get_device(args.device).is_gpu:
            raise CalibrationError(
                f"{args.compute} is a CPU trace (no GPU kernels in it): it fits this machine's CPU, not a "
                f"{args.device}; leave --device out, or profile on the GPU with ProfilerActivity.CUDA"
            )
        return fit_device(trace)
    return fit_device(trace, base=args.device if get_device(args.device).is_gpu else None)


def _fits_nccl(model: str, samples: list[Sample], device: object) -> bool:
    """Whether to fit NCCL's model: asked for, or (``auto``) GPU measurements of collectives it times, on a
    device it knows."""
    if model != "auto":
        return model == "nccl"
    return nccl_knows(device) and all(s.collective in nccl.COLLECTIVES for s in samples)


def _with_device(cluster: Cluster, spec: str, device: DeviceSpec, name: str) -> Cluster:
    """``cluster`` (named by ``spec``: a preset or a file) with ``device`` as every rank's."""
    config = cluster.to_config()
    config["cluster"]["device"] = device_config(device)
    config["cluster"]["name"] = name
    return Cluster.from_config(config, source=spec)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit, print the fit's residuals per size band, and write the cluster file."""
    if args.output is not None and args.output.suffix.lower() not in (".toml", ".json"):
        raise CalibrationError(f"-o {str(args.output)!r}: a cluster file ends in .toml or .json")
    what = ", ".join(args.inputs + (["--measure"] if args.measure else [])) or "the input"
    samples = gather(args)
    if args.compute is not None and not samples and args.cluster is None:
        raise CalibrationError(
            f"--compute {args.compute} fits a device, and a cluster file needs a network too: give network "
            f"measurements (nccl-tests output, a timeline, --measure) or the cluster to put the device in "
            f"(--cluster dgx-a100, --cluster mine.toml)"
        )
    base = Cluster.load(args.cluster) if args.cluster is not None and not samples else None
    device_fit = _device_fit(args)
    if device_fit is not None:
        print(device_fit.report())
    device = device_fit.device if device_fit else args.device
    if base is None:
        gloo = args.model == "gloo" or (args.model == "auto" and args.measure and not args.inputs)
        result: Fit | NcclFit = (
            fit_nccl(samples, device, args.name, what)
            if _fits_nccl(args.model, samples, device)
            else fit(
                samples,
                device=device,
                name=args.name,
                what=what,
                collective_model="gloo" if gloo else "alpha-beta",
                medium=args.medium,
            )
        )
        print(result.report())
        cluster = result.cluster
    else:
        assert device_fit is not None
        cluster = _with_device(base, args.cluster, device_fit.device, args.name)
        print(f"the fitted device put in {args.cluster}: {cluster.world_size} ranks")
    if args.output is not None:
        cluster.save(args.output)
        print(f"wrote {args.output}")
    return 0
