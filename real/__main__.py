"""``python -m real SCRIPT --nproc N``: run a script's entry function on N real processes."""

from __future__ import annotations

import argparse
import os
import sys

from real.backend import BACKENDS
from real.errors import RealConfigError, RealRunError
from real.launcher import run_script
from simdist_base.script import ScriptError


def _parser() -> argparse.ArgumentParser:
    """The command line: the same script convention as `simdist run`."""
    parser = argparse.ArgumentParser(
        prog="python -m real",
        description="Run SCRIPT's entry function as every rank of N real processes (torch's elastic "
        "launcher) and print each rank's return value.",
    )
    parser.add_argument("script", metavar="SCRIPT", help="Python file defining the entry function")
    parser.add_argument("--nproc", type=int, required=True, metavar="N", help="number of processes (ranks)")
    parser.add_argument(
        "--backend", choices=BACKENDS, default="gloo", help="torch.distributed backend (default gloo)"
    )
    parser.add_argument("--entry", default="main", help="name of the function to run (default main)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before the run is killed (default 300)"
    )
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns 0 on success, 1 when a rank fails or times out, 2 for bad arguments."""
    parser = _parser()
    options = parser.parse_args(argv)
    if options.nproc < 1:
        parser.error(f"--nproc must be at least 1; got {options.nproc}")
    try:
        result = run_script(
            options.script,
            options.nproc,
            backend=options.backend,
            entry=options.entry,
            master_port=options.master_port,
            timeout=options.timeout,
        )
    except (ScriptError, RealConfigError) as exc:
        print(f"python -m real: error: {exc}", file=sys.stderr)
        return 2
    except RealRunError as exc:
        print(f"python -m real: run failed: {exc}", file=sys.stderr)
        return 1
    try:
        for rank, value in enumerate(result.returns):
            print(f"rank {rank}: {value!r}")
        print(f"wall time: {result.wall_time:.3f} s ({result.nproc} processes, backend {result.backend})")
    except BrokenPipeError:
        # the reader went away (`python -m real ... | head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


# Guarded: importing this module (the tests call `main` directly) must not run the CLI.
if __name__ == "__main__":
    sys.exit(main())
