"""``simdist calibrate``: fit a cluster file to nccl-tests output, real timelines or a sweep on this machine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simdist.calibrate import read_nccl_tests, read_timeline
from simdist.calibrate.fit import fit
from simdist.calibrate.measure import measure
from simdist.calibrate.nccltests import BINARIES
from simdist.calibrate.samples import FITTED, CalibrationError, Sample
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
    c.add_argument("--device", default="cpu", help="the fitted cluster's device model (default: cpu)")
    c.add_argument("--name", default="calibrated", help="the fitted cluster's name")
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
    if not args.inputs and not args.measure:
        raise CalibrationError("give nccl-tests output files, real timeline directories, or --measure")
    return from_inputs


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit, print the fit's residuals per size band, and write the cluster file."""
    if args.output is not None and args.output.suffix.lower() not in (".toml", ".json"):
        raise CalibrationError(f"-o {str(args.output)!r}: a cluster file ends in .toml or .json")
    what = ", ".join(args.inputs + (["--measure"] if args.measure else [])) or "the input"
    result = fit(gather(args), device=args.device, name=args.name, what=what)
    print(result.report())
    if args.output is not None:
        result.cluster.save(args.output)
        print(f"wrote {args.output}")
    return 0
