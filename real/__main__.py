"""``python -m real SCRIPT --nproc N [-- ARGS]``: run a script on N real processes, as torchrun does or by entry function.

Without ``--entry`` the script runs as torchrun runs it: as ``__main__`` in every process, with ``ARGS`` as its
command line, creating its own process group. With ``--entry NAME`` every process creates a group (``--backend``)
and calls the script's function NAME, whose return values are printed. ``simdist run`` takes the same scripts
the same way.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

import torch

from real.backend import BACKENDS
from real.emulated_cuda import DEFAULT_MODEL, EmulatedCuda
from real.errors import RealConfigError, RealRunError
from real.launcher import NO_GROUP, RealResult, launch, timeline_options
from real.options import DEFAULT_TIMEOUT, MAX_TIMEOUT, Console, LaunchOptions, TimelineOptions
from real.rendezvous import RDZV_BACKENDS, Rendezvous
from real.target import Target, checked_entry, main_target
from simdist_base.script import ScriptError

PROG = "python -m real"
#: torchrun's defaults where ``python -m real`` has the same option
MASTER_ADDR = "127.0.0.1"


def _parser() -> argparse.ArgumentParser:
    """The command line: torchrun's option names where torchrun has the option, ``--`` before the script's own."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} SCRIPT --nproc N [options] [-- SCRIPT_ARGS ...]",
        description="Run SCRIPT on N real processes through torch's elastic launcher (the engine of torchrun): "
        "as torchrun runs it (as __main__, with SCRIPT_ARGS, creating its own process group), or with --entry, "
        "by calling one of its functions in a process group real creates and printing what each rank returns.",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the Python file to run")
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=nproc_per_node,
        required=True,
        metavar="N",
        help="number of processes (ranks) on this node: a number, or as torchrun: gpu (one per visible GPU), "
        "cpu (one per CPU this process may use), auto (gpu where there are GPUs, else cpu)",
    )
    parser.add_argument(
        "--entry",
        default=None,
        metavar="NAME",
        help="call the script's function NAME in a group real creates, and print each rank's return value "
        "(default: run the script as __main__, as torchrun does)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="with --entry: the backend of the group real creates (default gloo)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds before the run is killed (default: none for a script run as torchrun runs it, as under "
        f"torchrun; {DEFAULT_TIMEOUT:g} with --entry)",
    )
    parser.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default=None,
        metavar="RANKS",
        help="show only these local ranks' output, e.g. 0 or 0,2 (default: all)",
    )
    parser.add_argument(
        "--no-prefix",
        action="store_true",
        help="leave the ranks' output lines as they are (default: prefixed with [rankN]: as torchrun's --tee)",
    )
    recorded = parser.add_argument_group("timeline")
    recorded.add_argument(
        "--timeline",
        default=None,
        metavar="DIR",
        help="record each rank's collectives and sends/recvs with their start and end times into DIR "
        "(rank<R>.timeline.json; `simdist run SCRIPT --report OUT.html --real DIR` sets them beside a simulated run)",
    )
    recorded.add_argument(
        "--profile",
        action="store_true",
        help="with --timeline: also write each rank's torch profiler trace (Kineto JSON) into DIR (rank<R>.trace.json)",
    )
    gpus = parser.add_argument_group("GPU code without GPUs")
    gpus.add_argument(
        "--emulate-cuda",
        "--emulate_cuda",
        dest="emulate_cuda",
        action="store_true",
        help="run the script's CUDA code on simdist's simulated CUDA device in each process (tensors on cuda:i "
        "compute on the CPU), its NCCL groups over gloo: the same file gives the results it gives under simdist "
        "(needs simdist)",
    )
    gpus.add_argument(
        "--emulated-devices",
        "--emulated_devices",
        dest="emulated_devices",
        type=int,
        default=None,
        metavar="N",
        help="with --emulate-cuda: simulated CUDA devices per node (default: one per local rank)",
    )
    gpus.add_argument(
        "--emulated-gpu",
        "--emulated_gpu",
        dest="emulated_gpu",
        default=DEFAULT_MODEL,
        metavar="MODEL",
        help=f"with --emulate-cuda: the GPU model the devices answer for, a simdist device preset (default {DEFAULT_MODEL})",
    )
    nodes = parser.add_argument_group("several nodes (one python -m real per node)")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
    nodes.add_argument(
        "--standalone",
        action="store_true",
        help="one node meeting itself on a free local port, as torchrun's --standalone (the default here)",
    )
    nodes.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's rank, 0 to nnodes-1 (static rendezvous only)",
    )
    nodes.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        choices=RDZV_BACKENDS,
        default="static",
        help="how the nodes meet (default static)",
    )
    nodes.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help="where the nodes meet: node 0 (static) or the store (c10d, port 29400 by default)",
    )
    nodes.add_argument(
        "--rdzv-id", "--rdzv_id", dest="rdzv_id", default="none", metavar="ID", help="the job's id (c10d)"
    )
    nodes.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=None,
        metavar="HOST",
        help="node 0's address for the static rendezvous (default 127.0.0.1)",
    )
    nodes.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        default=None,
        metavar="PORT",
        help="node 0's port for the static rendezvous (default on one node: a free one)",
    )
    nodes.add_argument(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=None,
        metavar="HOST",
        help="the address other nodes reach this one at (default: looked up)",
    )
    return parser


def nproc_per_node(text: str) -> int:
    """``--nproc-per-node``'s value as torchrun reads it: a number, ``gpu``, ``cpu`` or ``auto``."""
    try:
        return int(text)
    except ValueError:
        pass
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "gpu":
        if not gpus:
            raise argparse.ArgumentTypeError(
                f"'gpu' starts one process per visible CUDA GPU, but torch {torch.__version__} sees none on this "
                f"machine: give a number of processes"
            )
        return gpus
    if text == "cpu" or (text == "auto" and not gpus):
        # the CPUs this process may run on, as torchrun counts them (cgroups and taskset respected)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if text == "auto":
        return gpus
    raise argparse.ArgumentTypeError(f"expected a number of processes, gpu, cpu or auto; got {text!r}")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(``python -m real``'s own arguments, the script's): the script's follow the first ``--``."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; 0 on success, 1 when a rank fails or the run times out, 2 when it cannot start."""
    own, script_args = split_argv(sys.argv[1:] if argv is None else list(argv))
    parser = _parser()
    options, extra = parser.parse_known_args(own)
    if extra:
        parser.error(_unrecognized(own, options.script, extra))
    if options.nproc < 1:
        parser.error(f"--nproc must be at least 1; got {options.nproc}")
    try:
        target, backend, launch_options = _plan(options, tuple(script_args))
        result = launch(target, backend, launch_options)
    except (ScriptError, RealConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except RealRunError as exc:
        print(f"{PROG}: run failed: {exc}", file=sys.stderr)
        return 1
    try:
        _report(result, options)
    except BrokenPipeError:
        # the reader went away (`python -m real ... | head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _unrecognized(own: list[str], script: str, extra: list[str]) -> str:
    """argparse's complaint about ``extra``, and where the script's arguments go when they followed the script."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    after_script = own.index(script) + 1 if script in own else len(own)
    if all(arg in own[after_script:] for arg in extra):
        # torchrun passes everything after the script to it; here options may follow the script, so `--` marks
        # where the script's own arguments begin (as for simdist run)
        message += f"; the script's own arguments follow `--`: {PROG} {script} [options] -- {' '.join(extra)}"
    return message


def _plan(
    options: argparse.Namespace, script_args: tuple[str, ...]
) -> tuple[Target, str | None, LaunchOptions]:
    """What to launch, with which backend and options; ScriptError or RealConfigError before anything starts."""
    if options.entry is None:
        if options.backend is not None:
            raise RealConfigError(
                f"--backend {options.backend} chooses the group real creates around an entry function; without "
                f"--entry the script runs as torchrun runs it and creates its own group "
                f"(init_process_group(backend=...)): drop --backend, or name the function with --entry"
            )
        target: Target = main_target(options.script, script_args)
    else:
        target = checked_entry(options.script, options.entry, script_args)
    if options.timeout is not None:
        timeout = options.timeout
    else:  # torchrun bounds no run; an entry function is bounded as real.run bounds it
        timeout = DEFAULT_TIMEOUT if options.entry is not None else MAX_TIMEOUT
    launch_options = LaunchOptions(
        options.nproc,
        timeout,
        env={},
        rendezvous=_rendezvous(options),
        console=Console(prefix=not options.no_prefix, local_ranks=_local_ranks(options.local_ranks_filter)),
        emulate_cuda=_emulation(options),
        timeline=_timeline(options),
    )
    # on emulated GPUs an entry function's group is NCCL's, presented over gloo, unless --backend says otherwise
    default = "auto" if options.emulate_cuda else "gloo"
    return target, options.backend or default, launch_options


def _emulation(options: argparse.Namespace) -> EmulatedCuda | None:
    """The simulated CUDA devices ``--emulate-cuda`` asks for; RealConfigError for their options without it."""
    if not options.emulate_cuda:
        given = [
            flag
            for flag, value in (
                ("--emulated-devices", options.emulated_devices is not None),
                ("--emulated-gpu", options.emulated_gpu != DEFAULT_MODEL),
            )
            if value
        ]
        if given:
            raise RealConfigError(
                f"{', '.join(given)} describes the devices of --emulate-cuda: add --emulate-cuda"
            )
        return None
    return EmulatedCuda(options.emulated_devices, options.emulated_gpu)


def _rendezvous(options: argparse.Namespace) -> Rendezvous:
    """torchrun's rendezvous options as a Rendezvous: ``--master-addr/--master-port`` name the static endpoint."""
    endpoint = options.rdzv_endpoint
    if options.standalone:
        given = [
            flag
            for flag, value in (
                ("--nnodes", options.nnodes != 1),
                ("--node-rank", options.node_rank != 0),
                ("--rdzv-endpoint", endpoint is not None),
                ("--master-addr", options.master_addr is not None),
                ("--master-port", options.master_port is not None),
            )
            if value
        ]
        if given:
            raise RealConfigError(
                f"--standalone runs one node meeting itself on a free local port, but {', '.join(given)} "
                f"{'is' if len(given) == 1 else 'are'} given: drop --standalone to launch on several nodes, or "
                f"drop {', '.join(given)}"
            )
        return Rendezvous()
    if options.master_port is not None or options.master_addr is not None:
        if options.rdzv_backend != "static" or endpoint is not None:
            which = "--rdzv-endpoint" if endpoint is not None else "--rdzv-backend c10d"
            raise RealConfigError(
                f"--master-addr and --master-port name node 0 of the static rendezvous, but {which} is given: "
                f"name the meeting point once"
            )
        if options.master_port is None:
            raise RealConfigError(f"--master-addr {options.master_addr} needs --master-port: node 0's port")
        endpoint = f"{options.master_addr or MASTER_ADDR}:{options.master_port}"
    return Rendezvous(
        nnodes=options.nnodes,
        node_rank=options.node_rank,
        endpoint=endpoint,
        backend=options.rdzv_backend,
        run_id=options.rdzv_id,
        local_addr=options.local_addr,
    )


def _local_ranks(text: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,2`` as {0, 2}; RealConfigError naming the option for anything else."""
    if text is None:
        return None
    try:
        return frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise RealConfigError(
            f"--local-ranks-filter takes local ranks separated by commas, e.g. 0 or 0,2; got {text!r}"
        ) from None


def _report_timeline(result: RealResult) -> None:
    """Say where the timeline went and how much it holds."""
    if result.timeline is not None:
        count = sum(len(r) for r in result.timeline.records.values())
        print(
            f"{PROG}: timeline of {count} operations on {len(result.timeline.ranks)} ranks written to "
            f"{result.timeline.directory}",
            file=sys.stderr,
        )


def _timeline(options: argparse.Namespace) -> TimelineOptions | None:
    """Where ``--timeline`` records; RealConfigError for ``--profile`` without it."""
    if options.timeline is None:
        if options.profile:
            raise RealConfigError(
                "--profile writes each rank's profiler trace beside its timeline: add --timeline DIR"
            )
        return None
    return timeline_options(options.timeline, options.profile)


def _report(result: RealResult, options: argparse.Namespace) -> None:
    """Print each rank's return value under --entry; note a torchrun-style script that created no group."""
    if options.entry is not None:
        for rank, value in zip(result.ranks, result.returns):
            print(f"rank {rank}: {value!r}")
        print(f"wall time: {result.wall_time:.3f} s ({result.nproc} processes, backend {result.backend})")
        _report_timeline(result)
        return
    _report_timeline(result)
    if result.backend == NO_GROUP:
        defined = sorted(_functions(options.script))
        functions = f" (it defines {', '.join(defined)})" if defined else ""
        print(
            f"{PROG}: note: no rank of {options.script} created a process group (init_process_group): it ran as "
            f"__main__, as torchrun runs it, and ended without distributed work (an early exit, such as one "
            f"after a GPU check?). If its rank code is a function{functions}, name it with --entry NAME to "
            f"have real create the group and call it.",
            file=sys.stderr,
        )


def _functions(path: str) -> set[str]:
    """Names of the ``def`` statements at a script's top level, for the note above."""
    try:
        with open(path, "rb") as file:
            tree = ast.parse(file.read())
    except (OSError, SyntaxError, ValueError):
        return set()
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


# Guarded: importing this module (the tests call `main` directly) must not run the CLI.
if __name__ == "__main__":
    sys.exit(main())
