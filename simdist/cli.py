"""The ``simdist`` command line: ``simdist run``, ``simdist bench``, ``simdist clusters``."""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from simdist import algorithms
from simdist.bench import COLLECTIVES, bench, format_table
from simdist.engine.runner import run
from simdist.errors import ClusterSpecError, RaceWarning, SimdistError
from simdist.network import Cluster
from simdist.network.presets import PRESETS
from simdist.script import ScriptError, load_entry
from simdist.units import parse_size


def _cluster(spec: str, world_size: int | None) -> Cluster:
    return Cluster.load(spec, world_size)


def _size(text: str) -> int:
    """Bytes from "8", "64K", "128M", "1G" (nccl-tests' binary suffixes) or any unit string ("25MiB")."""
    suffix = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip()
    if t[-1:].upper() in suffix and t[:-1].isdigit():
        return int(t[:-1]) * suffix[t[-1].upper()]
    return parse_size(t)


def cmd_run(args: argparse.Namespace) -> int:
    """Run a script's entry function on every rank of a simulated cluster."""
    fn = load_entry(args.script, args.entry)
    cluster = _cluster(args.cluster, args.world_size)
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # races are summarised once below rather than warned per site
        warnings.simplefilter("ignore", RaceWarning)
        res = run(fn, cluster, seed=args.seed, progress=args.progress, gloo_threads=args.gloo_threads, races=args.races)
    wall = time.perf_counter() - t0
    for rank, value in enumerate(res.returns):
        if value is not None or args.show_none:
            print(f"rank {rank}: {value!r}")
    print(
        f"simulated time {res.sim_time * 1e6:.3f} us on {cluster.name} ({cluster.world_size} ranks); "
        f"{res.messages} messages; wall {wall:.2f} s; trace hash {res.trace_hash[:16]}"
    )
    if args.trace:
        path = res.trace.save_chrome(args.trace)
        print(f"trace written to {path} (open it in ui.perfetto.dev)")
    if res.races:
        print(res.race_summary())
        return 3
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Print the nccl-tests table for one collective."""
    if args.collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {args.collective!r}; choose one of {', '.join(COLLECTIVES)}")
    cluster = _cluster(args.cluster, args.world_size)
    rows = bench(
        cluster,
        args.collective,
        _size(args.minbytes),
        _size(args.maxbytes),
        args.stepfactor,
        args.datatype,
        args.op,
        args.root,
        args.algorithm,
    )
    print(format_table(rows, args.collective, cluster))
    return 1 if any(r.wrong for r in rows) else 0


def cmd_clusters(args: argparse.Namespace) -> int:
    """List the named cluster presets."""
    for name, preset in sorted(PRESETS.items()):
        print(f"{name:14s} {preset.summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    p = argparse.ArgumentParser(prog="simdist", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run SCRIPT's entry function on every rank of a simulated cluster")
    r.add_argument("script", help="a Python file defining the rank entry function (default name: main)")
    r.add_argument("--cluster", default="switch", help="preset name or .toml/.json cluster file (default: switch)")
    r.add_argument("--world-size", type=int, default=None, help="number of ranks (sizes a preset; checks a file)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--trace", default=None, help="write the Chrome/Perfetto trace JSON here")
    r.add_argument("--entry", default="main", help="name of the entry function in SCRIPT (default: main)")
    r.add_argument("--progress", default="nccl", choices=("nccl", "gloo"),
                   help="backend progress semantics: nccl (one stream per group) or gloo (a pool of threads per group; default: nccl)")
    r.add_argument("--gloo-threads", type=int, default=2, help="threads per group with --progress gloo (default: 2)")
    r.add_argument("--races", default="warn", choices=("error", "warn", "off"),
                   help="race detector: error (stop at the first race), warn (report every race; exit status 3), off")
    r.add_argument("--show-none", action="store_true", help="also print ranks that returned None")
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="nccl-tests style table for one collective on a simulated cluster")
    b.add_argument("collective", nargs="?", default="all_reduce", help=f"one of {', '.join(COLLECTIVES)} (default: all_reduce)")
    b.add_argument("--cluster", default="dgx-h100")
    b.add_argument("--world-size", type=int, default=None)
    b.add_argument("-b", "--minbytes", default="8")
    b.add_argument("-e", "--maxbytes", default="64M")
    b.add_argument("-f", "--stepfactor", type=int, default=2)
    b.add_argument("-d", "--datatype", default="float")
    b.add_argument("-o", "--op", default="sum")
    b.add_argument("-r", "--root", type=int, default=0)
    b.add_argument("-a", "--algorithm", default="auto", help=f"one of {', '.join(algorithms.NAMES)}, or auto (default)")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("clusters", help="list cluster presets")
    c.set_defaults(func=cmd_clusters)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``simdist`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ClusterSpecError, ScriptError, ValueError, FileNotFoundError, SyntaxError) as e:
        # the run could not start: bad arguments, cluster or script (as python -m real, exit status 2)
        print(f"simdist: error: {type(e).__name__ + ': ' if isinstance(e, SyntaxError) else ''}{e}", file=sys.stderr)
        return 2
    except SimdistError as e:  # the run started and simdist diagnosed it
        print(f"simdist: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

